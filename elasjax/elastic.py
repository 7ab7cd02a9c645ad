"""Elasticity for your own JAX state and train step: the *pieces* entry point.

You keep your model, your loss, your optax optimizer and your loop. At step boundaries you call:

- `plan_mesh(devices, axes)`: a mesh over the live devices (which axis sizes to use, spares);
- `ElasticState.commit(state, step)`: after a good step, record the state's checksums and
  snapshot the shards a failure would otherwise lose (buddy device / host memory copies);
- `ElasticState.recover(failed)`: after a failure, re-plan the mesh over the survivors, rebuild
  the state on it from live copies only (surviving replicas, then verified snapshots), and verify
  every leaf against the checksums of the last committed step. The state is bitwise the one that
  was committed, or recovery raises (`UnrecoverableStateError`, `StateMismatchError`); it never
  continues with re-initialised or partly stale values.

Any pytree of arrays works: float (f32, bf16, f64), integer (int32, int64), bool leaves and typed
PRNG keys. The state's layout is yours: a function `shardings(mesh)` returning a pytree of
`NamedSharding`s that matches the state, on any mesh axes. `zero_shardings(stage, ...)` gives
it the loop's ZeRO stages (1: optimizer state over the data axis; 3: parameters too) as
sharding edits (`partition_over`): the optimizer still sees the parameter structure, so any
optax transform keeps its meaning.

The computation stays the fault-free one when the step follows the consistency contract: the
same global batch at every step (`pad_batch` pads it to the data degree with weight-0 rows),
the loss normalised by the global count of real items (not a mean over replicas), and random
draws keyed by (step, global sample id) (`sample_keys`).

Failures here are the in-process kind: `simulate_failure` deletes every buffer on the failed
devices (the state's and the snapshots'), so recovery can only read what a real failure leaves.
Real process deaths under `jax.distributed` run through the trainer (`elasjax launch`); this
class refuses a multi-process job with a clear error.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .compilation.pieces_standby import PiecesStandby, StandbyProgress
from .config import CheckpointConfig, SnapshotConfig
from .core import rng
from .core.sharding import path_str
from .observe.metrics import RecoveryRecord
from .plan.planner import Topology
from .runtime.inprocess import InProcessRuntime
from .transfer import checksum, reshard
from .transfer.checkpoint import Checkpointer
from .transfer.coverage import Coverage, coverage, explain
from .transfer.shards import (
    ShardStore,
    StateMismatchError,
    UnrecoverableStateError,
    describe_state,
    is_key,
    key_data_sharding,
)
from .transfer.snapshot import SnapshotPool
from .transfer.verified import verify_and_protect

PyTree = Any

__all__ = [
    "ElasticState",
    "Coverage",
    "Recovery",
    "StandbyProgress",
    "StateMismatchError",
    "pad_batch",
    "partition_over",
    "zero_shardings",
    "ZeroShardings",
    "plan_mesh",
    "sample_keys",
    "state_checksums",
]


# ---------------------------------------------------------------------------------------------
# Meshes.


def plan_mesh(
    devices: Sequence[jax.Device], axes: Mapping[str, int | Sequence[int]]
) -> tuple[Mesh, list[jax.Device]]:
    """A mesh over as many of `devices` as the axis sizes allow, and the devices left spare.

    `axes` maps each mesh axis name, in mesh order, to its size: an int, a sequence of allowed
    sizes (first preferred), or -1 for at most one axis that takes the rest. Among the allowed
    sizes, the choice that uses the most devices wins; ties go to the earlier preferences. With
    `{"data": -1, "model": (2, 1)}`, 8 devices give data 4 x model 2 and 7 give data 7 x model 1
    (all 7 used) where `{"data": -1, "model": 2}` gives data 3 x model 2 and one spare.
    Devices keep their given order (the last axis fastest), so keep a host's devices together.
    """
    devices = list(devices)
    if not devices:
        raise ValueError("plan_mesh: no devices")
    names = list(axes)
    rest = [a for a in names if axes[a] == -1]
    if len(rest) > 1:
        raise ValueError(f"plan_mesh: axes {rest} are all -1; at most one axis may take the rest")
    options = []
    for a in names:
        v = axes[a]
        sizes = [-1] if v == -1 else ([int(v)] if isinstance(v, (int, np.integer)) else [int(s) for s in v])
        if not sizes or any(s < 1 and s != -1 for s in sizes):
            raise ValueError(
                f"plan_mesh: axis '{a}' = {v!r}; allowed values: a positive int, a sequence of "
                "positive ints (first preferred), or -1 (the rest)"
            )
        options.append(sizes)
    best = None
    for rank, combo in enumerate(itertools.product(*options)):
        fixed = math.prod(s for s in combo if s != -1)
        if fixed > len(devices):
            continue
        shape = [len(devices) // fixed if s == -1 else s for s in combo]
        used = math.prod(shape)
        if best is None or used > best[0]:
            best = (used, shape)
    if best is None or best[0] == 0:
        raise ValueError(
            f"plan_mesh: no allowed shape of axes {dict(axes)} fits {len(devices)} live device(s)"
        )
    used, shape = best
    mesh = Mesh(np.asarray(devices[:used], dtype=object).reshape(shape), tuple(names))
    return mesh, devices[used:]


def partition_over(
    shardings: PyTree, abstract: PyTree, axis: str = "data"
) -> tuple[PyTree, list[str]]:
    """Shard each leaf over mesh axis `axis` as well (ZeRO-1 for optimizer state): the first
    dimension that is not sharded yet and divides by the axis size gets it. Returns the new
    shardings and the paths of the arrays that could not be partitioned (no free dimension
    divides by the axis size, as happens on an uneven data degree), which stay as they were:
    they are listed, never hidden. Scalars stay as they are."""
    left: list[str] = []

    def one(path, sh, x):
        if not isinstance(sh, NamedSharding):
            raise TypeError(f"partition_over: '{path_str(path)}' has a {type(sh).__name__}; "
                            "allowed: NamedSharding")
        n = sh.mesh.shape[axis]
        spec = list(sh.spec) + [None] * (len(x.shape) - len(sh.spec))
        if n == 1 or len(x.shape) == 0 or axis in jax.tree.leaves(spec):
            return sh  # nothing to do, or a scalar: nothing to partition
        for i, (dim, s) in enumerate(zip(x.shape, spec)):
            if s is None and dim % n == 0:
                spec[i] = axis
                return NamedSharding(sh.mesh, PartitionSpec(*spec))
        left.append(path_str(path))
        return sh

    out = jax.tree_util.tree_map_with_path(
        one, shardings, abstract, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    return out, left


@dataclasses.dataclass(frozen=True)
class ZeroShardings:
    """`zero_shardings`' result: the parameters' and the optimizer state's shardings, and the
    paths of the arrays no dimension of which could be partitioned (left as they were)."""

    params: PyTree
    opt: PyTree
    left: list[str]


def zero_shardings(
    stage: int, params: PyTree, opt: PyTree, abstract_params: PyTree, abstract_opt: PyTree,
    axis: str = "data",
) -> ZeroShardings:
    """The loop's `zero.stage` for your own state, as sharding edits over mesh axis `axis`
    (`partition_over`): stage 0 leaves both as given; 1 partitions the optimizer state; 3 the
    parameters too (XLA gathers them where your step uses them). Stage 2 partitions the loop's
    gradient accumulators, which your step owns: it is refused, use 1 (and constrain your
    accumulators to the optimizer state's shardings if you keep any). `params`/`opt` are
    shardings trees (`opt_state_shardings` gives the optimizer's), `abstract_*` the arrays or
    `jax.eval_shape` results they describe."""
    if stage not in (0, 1, 3):
        why = (" (stage 2 partitions the loop's gradient accumulators; your step owns its "
               "gradients)" if stage == 2 else "")
        raise ValueError(f"zero_shardings: stage = {stage!r}{why}; allowed values: 0, 1, 3")
    if stage == 0:
        return ZeroShardings(params, opt, [])
    opt, left = partition_over(opt, abstract_opt, axis)
    if stage == 3:
        params, left_p = partition_over(params, abstract_params, axis)
        left = left_p + left
    return ZeroShardings(params, opt, left)


# ---------------------------------------------------------------------------------------------
# The consistency contract: the same batch, keys and normalisation on any mesh.


def pad_batch(batch: Mapping[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """The global batch padded along its first axis to a multiple of `multiple` (the data
    degree), with a `weight` entry: 1 for real rows, 0 for padding. A loss of the form
    `sum(loss_i * weight_i) / sum(weight)` is then the same estimator on any data degree."""
    sizes = {k: np.shape(v)[0] for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"pad_batch: the batch's entries differ in their first axis: {sizes}")
    if "weight" in batch:
        raise ValueError("pad_batch: the batch already has a 'weight' entry")
    n = next(iter(sizes.values()))
    pad = -n % multiple
    out = {k: np.concatenate([v, np.zeros((pad, *np.shape(v)[1:]), np.asarray(v).dtype)])
           for k, v in batch.items()}
    out["weight"] = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
    return out


def sample_keys(root: jax.Array, step, sample_ids) -> jax.Array:
    """One PRNG key per global sample id at `step`: `fold_in(fold_in(root, step), id)`. No draw
    then depends on the mesh or on which device runs the sample."""
    return rng.sample_keys(rng.step_key(root, step), sample_ids)


@jax.jit
def _checksums(tree):
    return checksum.tree_checksums(tree)


def state_checksums(state: PyTree) -> dict[str, str]:
    """{leaf path: 16 hex digits}: a checksum of each leaf's bits that does not depend on how the
    leaf is sharded (equal values give equal checksums on any mesh)."""
    return checksum.to_host(_checksums(state))


# ---------------------------------------------------------------------------------------------
# The state.


@dataclasses.dataclass(kw_only=True)
class Recovery(RecoveryRecord):
    """What one `recover` did (the fields every recovery reports: `RecoveryRecord`), and the
    meshes before and after, the spare devices left out of the new mesh, and why the snapshot
    rungs failed when a checkpoint was used (`unrecoverable`). `compile_s`: the wait for the
    standby's executable of the new mesh (a cold compile when it was not ready), or without
    standby the compile of the new mesh's checksums. Times in seconds."""

    from_mesh: dict[str, int]
    to_mesh: dict[str, int]
    spares: list[int]
    unrecoverable: str = ""

    @property
    def total_s(self) -> float:
        return self.plan_s + self.compile_s + self.transfer_s + self.verify_s


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
        a host fails. Buddy snapshots go to another host.
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
        devices_per_host: int = 1,
        devices: Sequence[jax.Device] | None = None,
        snapshot: SnapshotConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
    ):
        if jax.process_count() > 1:
            raise NotImplementedError(
                "ElasticState runs in one process (simulated failures); for real process deaths "
                "on jax.distributed use the trainer (`elasjax launch`)"
            )
        devs = sorted(mesh.devices.flat, key=lambda d: d.id) if devices is None else list(devices)
        if devices_per_host < 1 or len(devs) % devices_per_host:
            raise ValueError(
                f"devices_per_host = {devices_per_host} must be >= 1 and divide the job's "
                f"{len(devs)} devices"
            )
        self.devices = {d.id: d for d in devs}
        self.topology = Topology(tuple(d.id for d in devs), devices_per_host)
        self.axes = dict(axes) if axes is not None else {
            a: (-1 if i == 0 else n) for i, (a, n) in enumerate(mesh.shape.items())
        }
        self.shardings_fn = shardings
        self.mesh = mesh
        self.live: set[int] = set(self.devices)
        self.spares: list[int] = sorted(self.live - {d.id for d in mesh.devices.flat})
        self.pool = SnapshotPool(snapshot or SnapshotConfig(), self.topology,
                                 InProcessRuntime(topology=self.topology))
        self.dead_hosts: set[int] = set()
        self.step = -1
        self.good: dict[str, str] | None = None
        self._sums = None
        self._sums_fn = None  # the state's checksums compiled for `self.mesh` (`_commit_sums`)
        self._survivors: ShardStore | None = None
        self._failed: set[int] = set()  # failed since the last recovery
        self.recoveries: list[Recovery] = []
        self.checkpointer = Checkpointer(checkpoint) if checkpoint and checkpoint.dir else None
        self._standby: PiecesStandby | None = None
        self._exe = None
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

    def commit(self, state: PyTree, step: int) -> None:
        """`state` is the good state after `step`: keep its checksums (computed on device, read
        lazily) and snapshot its unique shards (asynchronously; filed at the next commit or
        recovery). Call it once per step, after your train step returns."""
        for (path, x), sh in zip(jax.tree_util.tree_flatten_with_path(state)[0], self._want):
            if not x.sharding.is_equivalent_to(sh, x.ndim):
                raise ValueError(
                    f"commit: leaf '{path_str(path)}' is sharded {x.sharding}, not as "
                    f"`shardings(mesh)` says ({sh}); jit your step with "
                    "out_shardings=elastic.shardings() so the snapshots cover what you hold"
                )
        self.state, self.step = state, step
        self._sums = self._commit_sums()(state)
        for x in jax.tree.leaves(self._sums):
            x.copy_to_host_async()
        self.good = None
        raw = _unwrap_keys(state)
        self.pool.take(raw, step)
        if self.checkpointer is not None and self.checkpointer.due(step):
            self.checkpointer.save(step, raw, self.committed_checksums())

    def close(self) -> None:
        """Wait for checkpoint writes in flight; stop the standby compiles."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self._standby is not None:
            self._standby.close()

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
        self._standby = PiecesStandby(
            self._lower, max_meshes=None if max_meshes is None else int(max_meshes),
            rebind=rebind, progress=progress,
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
        """The meshes `recover` would plan after each single device or host failure."""
        live = [i for i in self.topology.device_ids if i in self.live]
        lose = [{d} for d in live] + [
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
        lost since the last `simulate_failure` (that one's are already known).

        Raises `UnrecoverableStateError` (a slice has no live copy; the message names the leaf)
        or `StateMismatchError` (a rebuilt leaf's checksum differs); the state is then unusable
        and the previous one is not touched."""
        t0 = time.perf_counter()
        extra_dead = set(failed) - (set(self.devices) - self.live)
        good = self.committed_checksums()
        self.live -= extra_dead
        self._failed |= extra_dead
        dead = set(self.devices) - self.live
        self.dead_hosts |= self._hosts_lost(dead)
        if mesh is None:
            mesh, spare = plan_mesh([self.devices[i] for i in self.topology.device_ids
                                     if i in self.live], self.axes)
        else:
            gone = {d.id for d in mesh.devices.flat} & dead
            if gone:
                raise ValueError(f"recover: the given mesh uses failed devices {sorted(gone)}")
            spare = [self.devices[i] for i in sorted(self.live - {d.id for d in mesh.devices.flat})]
        hit, compile_s = None, 0.0
        if self._standby is not None:
            self._standby.drop_queued(keep=mesh)  # the cores go to this recovery
            hit = self._standby.ready(mesh)
            tc = time.perf_counter()
            # at once on a hit; a queued mesh jumps the line
            exe, sums_fn = self._standby.wait(mesh)
            compile_s = time.perf_counter() - tc
        else:
            tc = time.perf_counter()
            sums_fn = self._compile_checksums(mesh)
            compile_s = time.perf_counter() - tc
        store = self._survivors if self._survivors is not None else ShardStore.capture(self.state)
        store = store.without(dead)
        refusals_before = len(self.pool.refusals)
        extra = self.pool.sources(dead, self.dead_hosts, version=self.step)
        t1 = time.perf_counter()
        plan_s = t1 - t0 - compile_s
        step, why = self.step, ""
        try:
            new, log = reshard.transition(
                store, self.shardings(mesh), devices=self.devices, extra_sources=extra
            )
            rung, moved, transfers = log.worst_rung(), log.bytes_moved, log.transfers
        except UnrecoverableStateError as e:
            if self.checkpointer is None or self.checkpointer.latest_step() is None:
                raise UnrecoverableStateError(e.leaf, e.box, self._explain(e.leaf, e.box, dead)) from None
            why = str(e)
            new, step, good = self._from_checkpoint(mesh)
            rung, moved, transfers = "checkpoint", 0, 0
        jax.block_until_ready(new)
        t2 = time.perf_counter()
        # (compiled for the shardings of `mesh`, which a checkpoint restore may not give)
        same = all(x.sharding.is_equivalent_to(sh, x.ndim) for x, sh in zip(
            jax.tree.leaves(new), jax.tree.leaves(self.shardings(mesh))))

        done = verify_and_protect(  # the previous state and pool are untouched if this raises
            new, checksums=lambda s: checksum.to_host((sums_fn if same else _checksums)(s)),
            expected=good, what="recovered state", against=f"the state of step {step}",
            pool=self.pool, configure=lambda p: self._configure_pool(p, new, mesh), step=step,
            take=_unwrap_keys(new))
        rec = Recovery(
            step=step, failed_devices=sorted(self._failed),
            from_mesh=dict(self.mesh.shape), to_mesh=dict(mesh.shape),
            spares=[d.id for d in spare], rung=rung, bytes_moved=moved,
            transfers=transfers, verify=done.compared.as_dict(),
            verified=done.compared.verified, plan_s=plan_s, transfer_s=t2 - t1,
            verify_s=done.verify_s, refused_snapshots=self.pool.refusals[refusals_before:],
            steps_lost=self.step - step, unrecoverable=why, standby_hit=hit,
            compile_s=compile_s,
        )
        self.step = step
        self.state, self.mesh, self.spares = new, mesh, rec.spares
        self._sums_fn = sums_fn if same else None  # (compiled for `mesh`'s shardings)
        self._survivors, self._failed = None, set()
        self.pool = done.pool  # the new layout is protected at once
        self.recoveries.append(rec)
        if self._standby is not None:
            self._exe = exe
            self._standby.submit(self.likely_meshes())  # the next failure's meshes
        return rec

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

