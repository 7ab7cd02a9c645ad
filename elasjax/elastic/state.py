"""`ElasticState`: your state, kept recoverable at each commit and rebuilt by a recovery, in one
process (failures simulated) or under `elasjax launch SCRIPT.py` (real process deaths, on the
job's runtime); `Recovery`, what one recovery did."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..compilation.pieces_standby import PiecesStandby, StandbyProgress
from ..compilation.shared import SharedBuilds
from ..config import CheckpointConfig, SnapshotConfig
from ..core.sharding import path_str
from ..plan.planner import Topology
from ..runtime import job
from ..runtime.attempts import Attempts, until_recovered
from ..runtime.inprocess import DeviceFailure, InProcessRuntime, read_replicated
from ..runtime.membership import AdmissionInterruptedError
from ..transfer import checksum, reshard
from ..transfer.checkpoint import Checkpointer
from ..transfer.coverage import Coverage, coverage, explain
from ..transfer.shards import (
    ShardStore,
    UnrecoverableStateError,
    describe_state,
    held_elsewhere,
    is_key,
    key_data_sharding,
    map_shard_data,
)
from ..transfer.snapshot import SnapshotPool
from ..transfer.verified import verify_and_protect
from .contract import _checksums, state_checksums
from .meshes import plan_mesh
from .records import Attempt, Join, Recovery
from .steps import Step

PyTree = Any


def _unwrap_keys(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


class ElasticState:
    """A state that survives device failures: snapshots at each `commit`, rebuilt by `recover`.

    Args:
      state: any pytree of `jax.Array`s (placed on `shardings(mesh)` if it is not already).
      shardings: `mesh -> pytree of NamedSharding` matching `state`: your layout on any mesh.
      mesh: the mesh to start on.
      axes: how to re-plan after a failure (`plan_mesh`); by default the same axis names with
        the first axis taking the rest and the others kept.
      devices_per_host: the failure domain: consecutive devices of `devices` fail together when
        a host fails. Buddy snapshots go to another host. Default 1 in one process; under
        `elasjax launch` a host is a process (its devices).
      devices: every device of the job, in host order (default: the mesh's, sorted by id).
      snapshot: which copies of unique shards to keep (`SnapshotConfig`; default: buddy copies
        with two hosts or more, host-memory copies with one; `copies=k`: k buddy copies on k
        other hosts, so that any k hosts failing together leave one).
      checkpoint: Orbax checkpoints (`CheckpointConfig(dir, every, keep)`), the last rung: when
        no live copy or snapshot holds a slice, `recover` restores the newest checkpoint onto
        the new mesh (and reports the steps lost).
    """

    def __init__(
        self,
        state: PyTree,
        shardings: Callable[[Mesh], PyTree],
        mesh: Mesh,
        *,
        axes: Mapping[str, int | Sequence[int]] | None = None,
        devices_per_host: int | None = None,
        devices: Sequence[jax.Device] | None = None,
        snapshot: SnapshotConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
    ):
        self.job = job.current()
        if self.job is None and jax.process_count() > 1:
            raise RuntimeError(
                "ElasticState: this jax.distributed job was not started by elasjax, so no "
                "process death could be detected or survived; run your script as the job's "
                "processes with `elasjax launch my_train.py --processes P "
                "--devices-per-process D [--kill STEP:PROCESS] [-- your args]` (docs/api.md)"
            )
        if self.job is not None:
            rt = self.job.runtime
            per = rt.topology.devices_per_host
            if devices_per_host not in (None, per):
                raise ValueError(
                    f"devices_per_host = {devices_per_host}: under `elasjax launch` a host is a "
                    f"process, which holds {per} devices; allowed values: None, {per}")
            if devices is not None and {d.id for d in devices} != set(rt.devices):
                raise ValueError("devices: under `elasjax launch` every device of the job "
                                 "(jax.devices()); allowed values: None or all of them")
            devs = [rt.devices[i] for i in rt.topology.device_ids]
            devices_per_host = per
        else:
            devs = (sorted(mesh.devices.flat, key=lambda d: d.id) if devices is None
                    else list(devices))
            devices_per_host = 1 if devices_per_host is None else devices_per_host
            if devices_per_host < 1 or len(devs) % devices_per_host:
                raise ValueError(
                    f"devices_per_host = {devices_per_host} must be >= 1 and divide the job's "
                    f"{len(devs)} devices"
                )
            rt = None
        self.topology = Topology(tuple(d.id for d in devs), devices_per_host)
        self.rt = rt if rt is not None else InProcessRuntime(topology=self.topology)
        # the runtime's own table under launch: a renewal of the collectives updates it in place
        self.devices = self.rt.devices if self.job is not None else {d.id: d for d in devs}
        self.axes = dict(axes) if axes is not None else {
            a: (-1 if i == 0 else n) for i, (a, n) in enumerate(mesh.shape.items())
        }
        self.shardings_fn = shardings
        self.mesh = mesh
        self.live: set[int] = set(self.devices)
        self.spares: list[int] = sorted(self.live - {d.id for d in mesh.devices.flat})
        self.pool = SnapshotPool(snapshot or SnapshotConfig(), self.topology, self.rt)
        self.dead_hosts: set[int] = set()
        self.step = -1
        self.good: dict[str, str] | None = None
        self._sums = None
        self._sums_fn = None  # the state's checksums compiled for `self.mesh` (`_commit_sums`)
        self._survivors: ShardStore | None = None
        self._failed: set[int] = set()  # failed since the last recovery
        self.recoveries: list[Recovery] = []
        # under launch over the job's live processes (each writes its own shards), moved to the
        # survivors at a failure and to the grown job at an admission (`Checkpointer.reopen`)
        self.checkpointer = None
        if checkpoint and checkpoint.dir:
            # a restarted process opens it with the job's processes once admitted (`_grow`)
            adm = self.rt.admission if self.job is not None else None
            self.checkpointer = Checkpointer(
                checkpoint, self.rt.processes(), joining=adm is not None,
                generation=adm.loop["ckpt_generation"] if adm is not None else 0)
        self._standby: PiecesStandby | None = None
        self._make_step = self._batch_fn = None  # your step and batch for it (`standby`)
        self._want: list = []  # the shardings `commit` checks (`_configure_pool`)
        self._exe = None
        self._open: Step | None = None  # the step whose block runs (`steps`)
        self._yielded: Step | None = None  # the step `steps` gave last
        self._first_after: Recovery | None = None  # a recovery whose first step is to come
        self.joins: list[Join] = []  # restarted processes admitted (under launch)
        if self.job is not None and self.rt.admission is not None:
            self._arrive(state)  # a restarted process: the job's state, not the one given
            return
        self.state = jax.device_put(state, self.shardings())
        self._configure_pool(self.pool, self.state, self.mesh)

    # -- layout ---------------------------------------------------------------------------------

    def shardings(self, mesh: Mesh | None = None) -> PyTree:
        """Your shardings of the state on `mesh` (default: the current one)."""
        return self.shardings_fn(self.mesh if mesh is None else mesh)

    def _raw_shardings(self, mesh: Mesh) -> PyTree:
        return jax.tree.map(
            lambda sh, x: key_data_sharding(sh, x.dtype) if is_key(x) else sh,
            self.shardings(mesh), self.state,
            is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
        )

    def _configure_pool(self, pool, state, mesh: Mesh) -> None:
        """Set up `pool` for `state` on `mesh`'s snapshots, and the shardings `commit` checks
        against."""
        self._want = jax.tree.leaves(
            self.shardings(mesh), is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
        pool.configure(_unwrap_keys(state), self._raw_shardings(mesh), mesh, self.live)

    def coverage(self, pairs: bool = True) -> Coverage:
        """Which failures of the live devices the committed state survives, with this pool's
        snapshot settings: every single device, every single host and, with `pairs`, every two
        devices and every two hosts together (`Coverage`). From the shardings and the snapshot
        records alone: nothing is copied or compiled."""
        return coverage(describe_state(self.state), self.pool, self.topology, self.live,
                        dead_hosts=self.dead_hosts, pairs=pairs)

    def _hosts_lost(self, dead: set[int]) -> set[int]:
        """Hosts all of whose devices are in `dead` (their host memory is gone)."""
        return self.topology.hosts_lost(dead)

    def _explain(self, path: str, box, dead: set[int]) -> str:
        """Why no copy of `path` `box` survived: `transfer.coverage.explain`."""
        return explain(path, box, describe_state(self.state), self.pool, self.topology,
                       self.live, self._failed, dead)

    @property
    def unprotected(self) -> list[str]:
        """Shards a failure would lose that no snapshot covers (empty unless you opted out)."""
        return list(self.pool.unprotected)

    # -- steps ----------------------------------------------------------------------------------

    def steps(self, stop: int, *, start: int | None = None) -> Iterator[Step]:
        """Your loop's steps, `start` (default: the one after the last committed) to `stop - 1`:

            for step in es.steps(n):
                with step:                  # the unit a failure interrupts and redoes
                    state, loss = train(es.state, batch(step.n))
                    es.commit(state, step.n)

        A process death inside the block (under `elasjax launch`) ends it on every survivor at
        once; the state is recovered (a mesh over the live devices, the last committed state
        rebuilt from live copies and verified: `recovery` is the record) and the same step comes
        again, on `es.state` and `es.mesh`. The loop, the batch and the step stay yours; read
        them from `es` inside the block. In one process the block only checks that the step
        committed (failures there are simulated: `simulate_failure`, `recover`)."""
        n = self.step + 1 if start is None else int(start)
        while n < stop:
            step = self._yielded = Step(self, n)
            yield step
            if step.failed:
                n = self.step + 1  # the step after the recovered state: the interrupted one
            elif not step.committed:
                raise RuntimeError(
                    f"step {n}: its block ended without `es.commit(state, {n})`; commit every "
                    "step of `es.steps` (a failure can only be recovered from a committed state)")
            else:
                n += 1

    @property
    def writer(self) -> bool:
        """Does this process write the run's files (the lowest live one; True in one process)?"""
        return bool(self.rt.writer)

    def state_digest(self) -> str:
        """One digest of the committed state's checksums: two runs that end on equal bits print
        the same digest (the loop's `state_digest`)."""
        return checksum.digest(self.committed_checksums())

    @property
    def recovery(self) -> Recovery | None:
        """The last recovery (None before the first)."""
        return self.recoveries[-1] if self.recoveries else None

    def commit(self, state: PyTree, step: int) -> None:
        """`state` is the good state after `step`: keep its checksums (computed on device, read
        lazily) and snapshot its unique shards (asynchronously; filed at the next commit or
        recovery). Call it once per step, after your train step returns. Inside a step's block
        (`steps`) the commit takes effect when the block ends well; under `elasjax launch` it
        must be inside one, and the step must not donate `es.state` (a death can interrupt it,
        and the recovery reads its input)."""
        for (path, x), sh in zip(jax.tree_util.tree_flatten_with_path(state)[0], self._want):
            if not x.sharding.is_equivalent_to(sh, x.ndim):
                raise ValueError(
                    f"commit: leaf '{path_str(path)}' is sharded {x.sharding}, not as "
                    f"`shardings(mesh)` says ({sh}); jit your step with "
                    "out_shardings=elastic.shardings() so the snapshots cover what you hold"
                )
        block = self._open
        if self.job is not None:
            if block is None:
                raise RuntimeError(
                    "commit: under `elasjax launch` a step commits inside its block: `for step "
                    "in es.steps(n): with step: ... es.commit(state, step.n)`")
            donated = [path_str(p) for p, x in jax.tree_util.tree_flatten_with_path(self.state)[0]
                       if x.is_deleted()]
            if donated:
                raise ValueError(
                    f"commit: your step donated the committed state ('{donated[0]}' is deleted); "
                    "under `elasjax launch` a death can interrupt a step and the recovery reads "
                    "its input: jit the step without donate_argnums")
        if block is not None and step != block.n:
            raise ValueError(f"commit: step {step} inside the block of step {block.n}; "
                             f"allowed: {block.n}")
        sums = self._commit_sums()(state)
        for x in jax.tree.leaves(sums):
            x.copy_to_host_async()
        raw = _unwrap_keys(state)
        if self.job is not None:  # `--kill`: right after the dispatch, its collectives in flight
            redo = self._first_after is not None  # the step a recovery redoes
            self.job.kill(self.rt, step, "recovery/first_step" if redo else "step",
                          "after_dispatch")
        self.pool.take(raw, step)
        if block is None:
            self._apply(state, step, sums)
            if self._yielded is not None and self._yielded.n == step:
                self._yielded.committed = True  # (a step of `steps` committed outside a block)
            return
        block.staged = (state, step, sums)  # (dropped with its snapshot if the step fails)
        # under launch the block's end is where a failure shows: its programs end inside it
        self.rt.commit((state, sums, self.pool.in_flight()))

    def _apply(self, state: PyTree, step: int, sums) -> None:
        """`state` is committed as the state after `step`."""
        self.state, self.step, self._sums = state, step, sums
        if self._first_after is not None:  # the first step after a recovery: until its commit
            rec, t = self._first_after
            rec.first_step_s, self._first_after = time.perf_counter() - t, None
            if self._standby is not None:  # the next failure's meshes, the first step done
                self._standby.submit(self.likely_meshes())
        # under launch the checksums are read at once (every process holds them): a read later
        # could meet a renewed client
        self.good = self._host_sums(sums) if self.job is not None else None
        if self.job is not None:
            self.job.committed(step)
        if self.checkpointer is not None and self.checkpointer.due(step):
            self.checkpointer.save(step, _unwrap_keys(state), self.committed_checksums())

    def _host_sums(self, sums) -> dict[str, str]:
        """Checksums (replicated device arrays) as hex strings, read from this process's
        devices."""
        return {path_str(p): checksum.hex_of(read_replicated(x, self.live))
                for p, x in jax.tree_util.tree_flatten_with_path(sums)[0]}

    def close(self) -> None:
        """Wait for checkpoint writes in flight; stop the standby compiles."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self._standby is not None:
            # under launch the worker ends with os._exit once the script returns: a build
            # under way is dropped, not waited for (`StandbyCompiler.close`)
            self._standby.close(0.0 if self.job is not None else 60.0)

    # -- standby executables --------------------------------------------------------------------

    def standby(
        self,
        make_step: Callable[[Mesh], Any],
        batch: Callable[[Mesh], PyTree],
        *,
        wait: bool = False,
        max_meshes: int | None = None,
        rebind: bool = True,
        progress: bool | Callable[[StandbyProgress], Any] = True,
    ) -> StandbyProgress:
        """Compile your step ahead of time for the mesh of every likely failure (each single
        device and each single host of the live set), in a background thread, so that a
        recovery finds it ready. `make_step(mesh)` returns your jitted step for that mesh
        (`jax.jit(step, out_shardings=(es.shardings(mesh), ...))`), called as
        `step(state, batch)`; `batch(mesh)` the batch's `jax.ShapeDtypeStruct`s with their
        shardings on that mesh. With `wait`, block until all are built (start-up time for a
        first recovery that is a hit). `executable()` then returns the current mesh's step.

        The likely meshes come in few shapes: one mesh of each shape is compiled, and each other
        mesh of that shape loads the compiled program onto its own devices (`rebind`; a load,
        not a compile), when the program lowered for it is the same; otherwise, or where this
        JAX or backend cannot load an executable onto other devices, it is compiled, and its
        progress line says why (`compilation/pieces_standby.py`).

        Args:
          max_meshes: None (every likely mesh) or how many likely meshes to build besides the
            current one (the first of `likely_meshes()`, single devices before hosts); the
            others' failures compile at recovery.
          rebind: False compiles every mesh.
          progress: True (a line on stderr: first the meshes to build and the expected cost,
            then one per built mesh), False (none), or a callable taking each
            `StandbyProgress` (on the standby thread, except the first).

        Returns the first announcement: the meshes to build, how many compile and rebind, and
        the expected seconds (`StandbyProgress`; later ones in `standby_log()`)."""
        if max_meshes is not None and (
            isinstance(max_meshes, bool) or not isinstance(max_meshes, (int, np.integer))
            or max_meshes < 0
        ):
            raise ValueError(
                f"standby: max_meshes = {max_meshes!r}; allowed values: None (every likely mesh) "
                "or an int >= 0 (how many likely meshes to build besides the current one)"
            )
        if not isinstance(rebind, bool):
            raise ValueError(f"standby: rebind = {rebind!r}; allowed values: True, False")
        if not (isinstance(progress, bool) or callable(progress)):
            raise ValueError(
                f"standby: progress = {progress!r}; allowed values: True (lines on stderr), "
                "False (none), or a callable taking a StandbyProgress"
            )
        self._make_step, self._batch_fn = make_step, batch
        if self._standby is not None:  # another step: nothing built for the old one applies
            self._standby.close()
        rt = self.rt
        shared = (SharedBuilds(rt.client, rt.me, rt.peer_gone, rt.log)
                  if self.job is not None and rt.shares_compiles and rebind else None)
        self._standby = PiecesStandby(
            self._lower, max_meshes=None if max_meshes is None else int(max_meshes),
            rebind=rebind, progress=progress, shared=shared,
        )
        # the current mesh's checksums too: `commit` takes them (`_commit_sums`)
        self._exe, self._sums_fn = self._standby.build_current(self.mesh)
        self._standby.submit(self.likely_meshes())
        first = self._standby.log[-1]
        if wait:
            self._standby.wait_all()
        return first

    def standby_log(self) -> list[StandbyProgress]:
        """The standby's announcements so far (the latest `pieces_standby.LOG_KEPT`)."""
        return [] if self._standby is None else list(self._standby.log)

    def likely_meshes(self) -> list[Mesh]:
        """The meshes `recover` would plan after each single device or host failure (under
        `elasjax launch` a device fails only with its process: each single host's)."""
        live = [i for i in self.topology.device_ids if i in self.live]
        singles = [{d} for d in live] if self.rt.device_failures else []
        lose = singles + [
            set(self.topology.host_devices(h)) & set(live) for h in range(self.topology.n_hosts)
        ]
        out = {}
        for gone in lose:
            left = [self.devices[i] for i in live if i not in gone]
            if gone and left and len(gone) < len(live):
                try:
                    mesh, _ = plan_mesh(left, self.axes)
                except ValueError:
                    continue  # no allowed shape fits: that failure cannot be survived anyway
                out.setdefault(mesh, None)
        return list(out)

    def _abstract(self, mesh: Mesh):
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
            self.state, self.shardings(mesh),
        )

    def _lower(self, mesh: Mesh):
        """(your step, the checksum function) lowered for the state on `mesh`."""
        abstract = self._abstract(mesh)
        step = self._make_step(mesh).lower(abstract, self._batch_fn(mesh))
        return step, self._lowered_checksums(mesh, abstract)

    def _lowered_checksums(self, mesh: Mesh, abstract=None):
        """The state's checksums on `mesh` (each device hashing its own blocks), lowered."""
        sums = jax.jit(functools.partial(checksum.tree_checksums, shardings=self.shardings(mesh)))
        return sums.lower(self._abstract(mesh) if abstract is None else abstract)

    def _commit_sums(self):
        """The checksums `commit` takes: compiled once per mesh for your shardings, so each
        device hashes its own block of a sharded leaf and one all-reduce adds them up
        (`checksum.mesh_checksums`). Under plain `jit` without the shardings, `tree_checksums`
        gathers every sharded leaf and hashes it whole on every device: `commit` then made the
        plain JAX loop of a 3.3M-parameter GPT 1.67x slower, of a 25.5M one 2.21x
        (experiments/RESULTS.md, "ElasticState.commit's checksums")."""
        if self._sums_fn is None:
            self._sums_fn = self._compile_checksums(self.mesh)
        return self._sums_fn

    def _compile_checksums(self, mesh: Mesh):
        """The state's checksums on `mesh`, one compiled program (what `recover` verifies
        with when no standby built it; compiled in its compile phase, so that `verify_s` is the
        verification alone)."""
        return self._lowered_checksums(mesh).compile()

    def executable(self):
        """Your step compiled for the current mesh (after `standby`)."""
        if self._standby is None:
            raise RuntimeError("executable(): call standby(make_step, batch) first")
        return self._exe

    def committed_checksums(self) -> dict[str, str]:
        """The checksums of the last committed state (what `recover` verifies against)."""
        if self.good is None:
            self.good = (
                checksum.to_host(self._sums) if self._sums is not None
                else state_checksums(self.state)
            )
        return self.good

    # -- restarted processes (under launch, `--worker-restarts`) ----------------------------------

    def _admit_joiners(self) -> Join | None:
        """At a step's start: admit the restarted processes the last step's verdict named
        (every live process reads the same list), and grow onto their devices (`_grow`)."""
        joiners = self.rt.joiners() if self.job is not None else []
        if not joiners:
            return None
        t0 = time.perf_counter()
        package = {"step": self.step, "good": self.committed_checksums(),
                   "mesh_ids": [d.id for d in self.mesh.devices.flat],
                   "mesh_shape": list(self.mesh.shape.items()),
                   "dead_hosts": sorted(self.dead_hosts),
                   # the checkpoints' barriers are named by it (`Checkpointer.reopen`)
                   "ckpt_generation": (self.checkpointer.generation
                                       if self.checkpointer is not None else 0)}
        admitted = self.rt.admit(package)  # a new CPU client with the newcomers
        self.live |= set(admitted.devices)
        self.dead_hosts -= {self.topology.host_of(d) for d in admitted.devices}
        store = ShardStore.capture(self.state).map_data(self.rt.current)
        try:
            return self._grow(store, admitted.processes, admitted.devices, t0)
        except DeviceFailure:
            # a failure like any other (`Step.__enter__` recovers): the committed state, on the
            # new client, is what the survivors hold; a newcomer leaves (`_arrive`), and its
            # exit is a death the recovery folds in
            self._survivors = store
            raise

    def _arrive(self, state: PyTree) -> None:
        """A restarted process admitted into the running job: the state is the job's, held by
        the others on their mesh (this process sees it as global arrays with no shard here);
        it takes part in the growth onto its devices (`_grow`), as the others do at that
        step's start. What `state` holds is not used, only its structure."""
        rt = self.rt
        t0 = time.perf_counter()
        pkg = rt.admission.loop
        names, sizes = zip(*pkg["mesh_shape"])
        old = Mesh(np.array([rt.devices[i] for i in pkg["mesh_ids"]]).reshape(sizes), names)
        self.step, self.good = pkg["step"], dict(pkg["good"])
        self.dead_hosts = set(pkg["dead_hosts"])
        self.live = set(rt.live)
        self.mesh = old

        self.state = jax.tree.map(held_elsewhere, state, self.shardings(old))
        mine = tuple(sorted(rt.devices_of(rt.me)))
        try:
            self._grow(ShardStore.capture(self.state), (rt.me,), mine, t0)
        except DeviceFailure as f:
            raise AdmissionInterruptedError(self.step, f.cause) from f

    def _grow(self, store: ShardStore, processes, devices, t0: float) -> Join:
        """Every live process and the newcomers: the committed state moved onto the mesh over
        the grown live set (the newcomers' shards copied from live ones), verified against its
        checksums, a fresh snapshot pool."""
        rt = self.rt
        with rt.guard("admit/state"):
            self.job.kill_at_admission(rt, self.step)  # (`--kill S:P:admission`)
            live = [self.devices[i] for i in self.topology.device_ids if i in self.live]
            mesh, spare = plan_mesh(live, self.axes)
            t1 = time.perf_counter()
            _, exe, sums_fn = self._executables(mesh)  # a load where its shape was built
            t2 = time.perf_counter()
            new, log = reshard.transition(store, self.shardings(mesh), devices=self.devices,
                                          transport=rt, threads=rt.threads)
            rt.commit(new)
            t3 = time.perf_counter()
        with rt.guard("admit/verify"):
            done = self._verified(new, mesh, sums_fn, self.good, "state after the admission",
                                  self.step)
        join = Join(step=self.step, processes=sorted(processes), devices=sorted(devices),
                    from_mesh=dict(self.mesh.shape), to_mesh=dict(mesh.shape),
                    bytes_moved=log.bytes_moved, bytes_cross_process=log.cross_process_bytes,
                    verify=done.compared.as_dict(), verified=done.compared.verified,
                    compile_s=t2 - t1, transfer_s=t3 - t2, verify_s=done.verify_s,
                    total_s=time.perf_counter() - t0)
        self.state, self.mesh, self.spares = new, mesh, [d.id for d in spare]
        self._sums_fn, self.pool = sums_fn, done.pool
        if self.checkpointer is not None:  # the grown job's processes save from now on
            self.checkpointer.reopen(rt.processes())
        self.joins.append(join)
        rt.log(f"admitted process(es) {join.processes} at step {self.step}: mesh "
               f"{join.from_mesh} -> {join.to_mesh}, {join.bytes_cross_process} B across "
               f"processes, verified {join.verified}, {join.total_s:.2f}s")
        if self._standby is not None:
            self._exe = exe
            self._standby.submit(self.likely_meshes())
        return join

    # -- failures -------------------------------------------------------------------------------

    def simulate_failure(self, devices: Iterable[int]) -> set[int]:
        """Simulate the loss of `devices` (ids): every buffer on them is deleted (the state's and
        the snapshot copies'), as a real failure leaves nothing readable there. Call `recover`
        next."""
        ids = set(devices)
        unknown = ids - set(self.devices)
        if unknown:
            raise ValueError(
                f"simulate_failure: devices {sorted(unknown)} are not in this job; allowed: "
                f"{sorted(self.live)}"
            )
        dead = ids - self.live
        if dead:
            raise ValueError(f"simulate_failure: devices {sorted(dead)} have failed already")
        self.committed_checksums()  # read now: a replicated checksum may sit on a failed device
        store = ShardStore.capture(self.state, set(self.devices) - self.live)
        store.fail(ids)
        for x in self.pool.device_buffers():
            for s in x.addressable_shards:
                if s.device.id in ids and not s.data.is_deleted():
                    s.data.delete()
        self._survivors = store
        self._failed |= ids
        self.live -= ids
        return ids

    def recover(self, failed: Iterable[int] = (), *, mesh: Mesh | None = None) -> Recovery:
        """Move the last committed state onto a mesh of the live devices (`mesh`, or one planned
        by `plan_mesh` over `axes`), from live copies only, and verify it. `failed`: devices
        lost since the last `simulate_failure` (that one's are already known). In one process;
        under `elasjax launch` a step's block recovers by itself (`steps`).

        Raises `UnrecoverableStateError` (a slice has no live copy; the message names the leaf)
        or `StateMismatchError` (a rebuilt leaf's checksum differs); the state is then unusable
        and the previous one is not touched."""
        if self.job is not None:
            raise RuntimeError(
                "recover: under `elasjax launch` a death is detected inside a step's block, "
                "which recovers by itself: `for step in es.steps(n): with step: ...`")
        extra_dead = set(failed) - (set(self.devices) - self.live)
        self.committed_checksums()  # read before any more devices leave
        self.live -= extra_dead
        self._failed |= extra_dead
        if mesh is not None:
            gone = {d.id for d in mesh.devices.flat} & (set(self.devices) - self.live)
            if gone:
                raise ValueError(f"recover: the given mesh uses failed devices {sorted(gone)}")
        return self._recover([], mesh)

    def _on_failure(self, failure: DeviceFailure, at: int | None) -> Recovery:
        """A death the runtime found inside the block of step `at` (every survivor gets the
        same failure; None: in an admission before a block): the step's commit is dropped and
        the last committed state recovered."""
        self.live -= failure.devices
        self._failed |= failure.devices
        return self._recover([failure], None, at)

    def _recover(self, failures: list[DeviceFailure], mesh: Mesh | None,
                 at: int | None = None) -> Recovery:
        """The recovery (`recover`): attempts until one succeeds; a death during one (under
        launch) starts the next from what is left, with every failed device so far. `at`: the
        step whose block the failure ended (its `--kill`s in the recovery's phases, first
        attempt only)."""
        t_first = time.perf_counter()
        good = self.committed_checksums()
        dead = set(self.devices) - self.live
        store = (self._survivors if self._survivors is not None
                 else self.rt.capture(self.state, dead))
        # what survives (in a list: a renewal of the collectives moves it onto the new client)
        stores = [store.without(dead)]
        refusals_before = len(self.pool.refusals)
        renewals: list = []
        if self.checkpointer is not None:  # its barriers without the dead (none in one process)
            self.checkpointer.reopen(self.rt.processes())

        def attempt(run: Attempts) -> Attempt:
            return self._attempt(stores, set(self.devices) - self.live, good, mesh,
                                 run.failures[-1] if run.failures else None, renewals,
                                 at if run.first else None)

        def fold(f: DeviceFailure) -> None:  # only under launch: a death during the recovery
            self.live -= f.devices
            self._failed |= f.devices
            if self.checkpointer is not None:
                self.checkpointer.reopen(self.rt.processes())
            stores[0] = stores[0].without(set(self.devices) - self.live)

        a, run = until_recovered(failures, attempt, fold)
        failures, attempts, t_attempt = run.failures, run.count, run.t_last
        done, log = a.done, a.log
        rec = Recovery(
            step=a.step, failed_devices=sorted(self._failed),
            from_mesh=dict(self.mesh.shape), to_mesh=dict(a.mesh.shape),
            spares=[d.id for d in a.spare], rung=a.rung,
            bytes_moved=log.bytes_moved if log else 0, transfers=log.transfers if log else 0,
            verify=done.compared.as_dict(), verified=done.compared.verified, plan_s=a.plan_s,
            transfer_s=a.transfer_s, verify_s=done.verify_s,
            refused_snapshots=self.pool.refusals[refusals_before:],
            steps_lost=self.step - a.step, unrecoverable=a.why, standby_hit=a.hit,
            compile_s=a.compile_s, failure_simulation=self.rt.failure_simulation,
            detect_s=failures[0].detect_s if failures else 0.0,
            failed_processes=sorted({p for f in failures for p in f.report.failed_processes}),
            attempts=attempts, retry_s=t_attempt - t_first,
            renew_s=sum(r.renew_s for r in renewals),
            bytes_cross_process=log.cross_process_bytes if log else 0,
        )
        self.step = a.step
        self.state, self.mesh, self.spares = a.state, a.mesh, rec.spares
        self._sums_fn = a.sums_fn if a.same else None  # (compiled for `mesh`'s shardings)
        self._survivors, self._failed = None, set()
        self.pool = done.pool  # the new layout is protected at once
        self.recoveries.append(rec)
        self._first_after = (rec, time.perf_counter())
        if self._standby is not None:
            self._exe = a.exe  # (the next failure's meshes: after the first step, `_apply`)
        return rec

    def _attempt(self, stores: list[ShardStore], dead: set[int], good: dict[str, str],
                 mesh: Mesh | None, failure: DeviceFailure | None, renewals: list,
                 at: int | None) -> Attempt:
        """One recovery attempt, each phase in a guard of the runtime (under launch a death in
        any of them raises `DeviceFailure` on every survivor; in one process a guard is
        nothing): plan (fresh collectives where the failure interrupted them, the mesh, its
        executables), transfer (from live copies and verified snapshots), verify (against the
        committed checksums; the new layout's snapshot pool)."""
        rt, launched = self.rt, self.job is not None

        def kills(phase: str) -> None:  # `--kill STEP:PROCESS:PHASE`, as the phase begins
            if launched and at is not None:
                self.job.kill(rt, at, f"recovery/{phase}", phase)

        with rt.guard("recovery/plan"):
            kills("plan")
            t0 = time.perf_counter()
            self.dead_hosts |= self._hosts_lost(dead)
            renewal = rt.renew_collectives(failure) if failure is not None else None
            if renewal is not None:
                renewals.append(renewal)
                if not renewal.kept:
                    stores[0] = stores[0].map_data(rt.current)
            live = [self.devices[i] for i in self.topology.device_ids if i in self.live]
            if mesh is None:
                mesh, spare = plan_mesh(live, self.axes)
            else:
                used = {d.id for d in mesh.devices.flat}
                spare = [d for d in live if d.id not in used]
            t1 = time.perf_counter()
            hit, exe, sums_fn = self._executables(mesh)
            compile_s = time.perf_counter() - t1
        with rt.guard("recovery/transfer"):
            kills("transfer")
            t2 = time.perf_counter()
            extra = self.pool.sources(dead, self.dead_hosts, version=self.step)
            if launched:  # device snapshots of a renewed client, on the current one
                extra = {k: map_shard_data(v, rt.current) for k, v in extra.items()}
            step, why, good_of, log = self.step, "", good, None
            try:
                new, log = reshard.transition(
                    stores[0], self.shardings(mesh), devices=self.devices, extra_sources=extra,
                    transport=rt if launched else None, threads=rt.threads if launched else None,
                )
                rung = log.worst_rung()
            except UnrecoverableStateError as e:
                if self.checkpointer is None or self.checkpointer.latest_step() is None:
                    raise UnrecoverableStateError(
                        e.leaf, e.box, self._explain(e.leaf, e.box, dead)) from None
                why = str(e)
                new, step, good_of = self._from_checkpoint(mesh)
                rung, log = "checkpoint", None
            if launched:
                rt.commit(new)
            else:
                jax.block_until_ready(new)
            transfer_s = time.perf_counter() - t2
        # (compiled for the shardings of `mesh`, which a checkpoint restore may not give)
        same = all(x.sharding.is_equivalent_to(sh, x.ndim) for x, sh in zip(
            jax.tree.leaves(new), jax.tree.leaves(self.shardings(mesh))))
        with rt.guard("recovery/verify"):
            kills("verify")
            # the previous state and pool are untouched if this raises
            done = self._verified(new, mesh, sums_fn if same else _checksums, good_of,
                                  "recovered state", step)
        return Attempt(state=new, mesh=mesh, spare=spare, done=done, log=log, step=step,
                        why=why, rung=rung, hit=hit, exe=exe, sums_fn=sums_fn, same=same,
                        plan_s=t1 - t0, compile_s=compile_s, transfer_s=transfer_s)

    def _executables(self, mesh: Mesh) -> tuple[bool | None, Any, Any]:
        """(standby hit, your step, the checksums) for `mesh`: the standby's (the cores go to
        this move: the queue is dropped; a hit was built before, on a renewed client for the
        same device ids, loaded onto the new one here), else None and the checksums compiled
        (None: no standby)."""
        if self._standby is None:
            return None, None, self._compile_checksums(mesh)
        self._standby.drop_queued(keep=mesh)
        hit = self._standby.ready(mesh) or self._standby.built_before(mesh)
        exe, sums_fn = self._standby.wait(mesh)  # at once on a hit; else jumps the line
        return hit, exe, sums_fn

    def _verified(self, new: PyTree, mesh: Mesh, sums_fn, expected: dict[str, str], what: str,
                  step: int):
        """`new` on `mesh` checked against `expected` (`verify_and_protect`), then protected by
        a fresh snapshot pool as the state of `step`; under launch its copies are waited for
        in the caller's guard."""
        return verify_and_protect(
            new, checksums=lambda s: self._host_sums(sums_fn(s)), expected=expected, what=what,
            against=f"the state of step {step}", pool=self.pool,
            configure=lambda p: self._configure_pool(p, new, mesh), step=step,
            take=_unwrap_keys(new), commit=self.rt.commit if self.job is not None else None)

    def _from_checkpoint(self, mesh: Mesh) -> tuple[PyTree, int, dict[str, str]]:
        """The newest checkpoint read onto `mesh` (keys wrapped again), its step and checksums."""
        ck = self.checkpointer
        step = ck.latest_step()
        target = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(
                jax.eval_shape(jax.random.key_data, x).shape if is_key(x) else x.shape,
                np.uint32 if is_key(x) else x.dtype, sharding=sh,
            ),
            self.state, self._raw_shardings(mesh),
        )
        raw, meta = ck.restore(step, target)
        state = jax.tree.map(
            lambda x, r: jax.random.wrap_key_data(r, impl=jax.random.key_impl(x)) if is_key(x) else r,
            self.state, raw,
        )
        return state, int(meta["step"]), meta["checksums"]
