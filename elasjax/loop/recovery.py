"""Recovery as a plan transition (growth and cut-over: `elasjax.loop.cutover`).

One recovery path for both runtimes (the trainer is given a runtime, `elasjax.runtime`). A
recovery is the timeline of ARCHITECTURE.md, section 1, each phase timed:

`detect` (the runtime reports the failed devices) -> `plan` (the planner over the survivors) ->
`compile` (the new plan's executables: a standby hit, a wait for a background compile, or a
compile) -> `transfer` (rebuild the state on the new mesh from live sources: surviving replicas,
verified snapshot copies; or, when a slice has none and a checkpoint is configured, the newest
Orbax checkpoint, losing the steps since) -> `verify` (checksums of the rebuilt state against
those of the last good state) -> `snapshot` (the new plan's snapshot pool, filled at once) ->
`first_step`.

Each phase runs in a runtime `guard`: under the multi-controller runtime its end is a barrier of
the live processes, and a process that dies inside it makes every survivor raise the same
`DeviceFailure`. A failure during a recovery starts the recovery again from what is left (the last
good state's surviving shards and the snapshots); `retry_s` is the time the failed attempts took.

A recovery that cannot be verified raises; a slice with no live copy and no checkpoint raises
`UnrecoverableStateError`. The run never continues with re-initialised or partly stale state.

The recovery's collaborators are given, not shared: an `ExecutableSource` (executables),
`Contingencies` (plans), a `TransitionPlanner` (transfers planned ahead) and the checkpointer.
It returns what it did (`Recovered`); the loop owns the position and the snapshot pool.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable
from typing import Any

import jax

from ..compilation.executables import Executables
from ..compilation.source import ExecutableSource
from ..compilation.standby import BackgroundJobs
from ..config import Config
from ..core.mesh import make_mesh
from ..core.sharding import path_str
from ..layout.state import StateFactory, make_optimizer
from ..observe.metrics import RecoveryEvent
from ..plan.contingencies import Contingencies
from ..plan.planner import Plan, Topology, same_shape, torchft_kept, torchft_plan
from ..runtime.attempts import Attempts, until_recovered
from ..runtime.collectives import Renewal
from ..runtime.inprocess import DeviceFailure, host_values
from ..transfer import checksum
from ..transfer.checkpoint import restore_onto
from ..transfer.coverage import LOOP, coverage, explain
from ..transfer.reshard import TransitionPlanCache, transition
from ..transfer.shards import (
    ShardStore,
    StateMismatchError,
    Transfer,
    TransferLog,
    UnrecoverableStateError,
    box_size,
    box_str,
    describe_state,
    index_to_box,
    map_shard_data,
    uncovered,
)
from ..transfer.snapshot import SnapshotPool
from ..transfer.verified import Comparison, Protected, verify_and_protect

# the loop's earlier name for the one error of a state that does not verify
RecoveryVerificationError = StateMismatchError


@dataclasses.dataclass(frozen=True)
class _Rebuilt:
    """The state a recovery rebuilt (`Recoverer._rebuild`), not verified yet."""

    state: Any
    log: TransferLog
    rung: str
    resume_at: int  # the step it is the state of (older than the failure's after a checkpoint)
    expected: dict  # the checksums it must have
    tinfo: dict  # the transfer's own planning: {"plan_hit", "plan_s"}


@dataclasses.dataclass
class _Attempt:
    """A recovery attempt that succeeded (`Recoverer._attempt`): the new plan (and the
    optimal one it may cut over to later), its executables, the rebuilt and verified state, the
    new snapshot pool, and each phase's time."""

    plan: Plan
    optimal: Plan
    keep: Any  # torchft_like: the data replicas kept
    live: set
    exe: Executables
    hit: bool
    standby_hit: bool
    wait_s: float
    state: Any
    log: TransferLog
    rung: str
    resume_at: int
    actual: dict  # the rebuilt state's checksums
    compared: Comparison  # what its verification compared
    pool: Any  # the new plan's SnapshotPool, its first snapshot taken
    early: dict  # the transition planned before the failure: {"plan_hit", "plan_s"}
    tinfo: dict  # the transfer's own planning: {"plan_hit", "plan_s"}
    plan_s: float
    compile_s: float
    transfer_s: float
    verify_s: float
    snapshot_s: float


@dataclasses.dataclass
class Position:
    """Where training stands: `state` is the state after `step` steps on `plan`, `good` its
    checksums (the last verified ones), `live` the devices alive, `lost_hosts` the hosts whose
    memory is gone (every device failed, none returned), `kept` the initial data replicas still
    training (`recovery.strategy: torchft_like`; None otherwise)."""

    step: int
    plan: Plan
    exe: Executables
    state: Any
    good: dict[str, str] | None
    live: frozenset[int]
    lost_hosts: frozenset[int] = frozenset()
    kept: tuple[int, ...] | None = None


@dataclasses.dataclass
class PendingCutover:
    """A plan to cut over to at a step boundary once compiled: the optimal plan after an async
    recovery (`kind` "migration"), or a bigger plan after devices returned ("growth")."""

    plan: Plan
    t_start: float  # when the change became known (the failure's detection, or the join)
    step: int  # the step of the failure or the join
    kind: str = "migration"
    joined: tuple[int, ...] = ()  # growth: the devices that returned
    predicted_gain: float = 0.0  # growth: relative step-time gain predicted by the cost model
    # growth through an interim plan: the best plan, pending once the run stands on the interim
    after: PendingCutover | None = None
    wait_s: float = 0.0  # seconds the loop has waited for its compile (`Cutovers.due`)


def host_checksums(rt, sums, exe: Executables) -> dict[str, str]:
    """Stacked device checksums (replicated over `exe`'s plan) -> {key: hex}, on every live
    process (`runtime.host_values`)."""
    return checksum.rows_to_host(
        exe.layout.checksum_keys, host_values(rt, sums, exe.plan.device_ids)
    )


def protect_moved(rt, exe: Executables, state, expected: dict[str, str], what: str,
                  against: str, pool, step: int, live) -> Protected:
    """The loop's moves (recovery, cut-over, admission) end here: `verify_and_protect` with the
    checksums of `exe`'s plan on every live process and a pool over its shardings and mesh."""
    return verify_and_protect(
        state, checksums=lambda s: host_checksums(rt, exe.checksum(s), exe), expected=expected,
        what=what, against=against, pool=pool, step=step, commit=rt.commit,
        configure=lambda p: p.configure(state, exe.state_shardings, exe.mesh, set(live)),
    )


def checkpoint_log(state) -> TransferLog:
    log = TransferLog()
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = path_str(path)
        for d, idx in x.sharding.devices_indices_map(tuple(x.shape)).items():
            box = index_to_box(idx, x.shape)
            nbytes = x.dtype.itemsize * box_size(box)
            log.entries.append(Transfer(name, box, "checkpoint", d.id, nbytes, "checkpoint"))
    return log


class TransitionPlanner:
    """Plans transitions before they are needed, on a background thread, from shard
    descriptions: recovery and cut-over then find them in `cache` and only execute copies
    (`reshard.transition`). Without `recovery.prepare_transfers` nothing runs ahead and each
    transition is planned when it runs."""

    def __init__(self, cfg: Config, factory: StateFactory, devices, contingencies: Contingencies,
                 where):
        self.cfg, self.factory, self.devices, self.contingencies = cfg, factory, devices, contingencies
        self.cache = TransitionPlanCache(where=where)
        self.jobs = (
            BackgroundJobs("elasjax-transfer-plans") if cfg.recovery.prepare_transfers else None
        )

    def for_failures(self, pos: Position, pool) -> None:
        """Plan the transitions recovery would run after each likely next failure of
        `pos.plan` (`Contingencies.failures`), with `pool`'s snapshots as sources. Elastic
        strategy only."""
        if self.jobs is None or self.cfg.recovery.strategy != "elastic":
            return
        full = describe_state(pos.state)  # metadata of the buffers only, read on this thread
        plan, live = pos.plan, set(pos.live)
        held = set(plan.device_ids) | set(plan.spare_ids)
        jobs = []
        for gone, hosts in self.contingencies.failures(plan, live):
            survivors = self.contingencies.survivors(live - gone)
            if survivors:
                jobs.append(functools.partial(
                    self._for_failure, full, plan, pos.exe.layout, gone & held, survivors,
                    set(pos.lost_hosts) | hosts, pool,
                ))
        self.jobs.replace(jobs)

    def _for_failure(self, full, plan, old_layout, dead, survivors, lost_hosts, pool) -> None:
        target, _ = self.contingencies.recovery_plan(plan, survivors)
        self.move(full, dead, target, old_layout, pool.describe_sources(dead, lost_hosts))

    def for_cutover(self, pos: Position, target: Plan) -> None:
        """Plan the move of `pos`'s state to `target` (nothing lost, no snapshots), instead of
        any failure's."""
        if self.jobs is not None:
            self.jobs.replace([functools.partial(
                self.move, describe_state(pos.state), set(), target, pos.exe.layout, None,
            )])

    def move(self, full: ShardStore, dead, target: Plan, old_layout, extra, info=None) -> None:
        """Plan (into `cache`) the transition of the described state `full`, less `dead`'s
        shards, onto `target`, with `extra` sources; raises `UnrecoverableStateError` when a
        slice has no source."""
        layout = self.factory.layout(target)
        mesh = make_mesh(target.mesh_shape, [self.devices[i] for i in target.device_ids])
        self.cache.prepare(
            full.without(dead), layout.shardings(mesh), extra, old_layout=old_layout,
            new_layout=layout, info=info,
        )

    def stop(self) -> None:
        """Drop what is queued (plans for a plan that is no longer the current one)."""
        if self.jobs is not None:
            self.jobs.replace([])

    def wait_idle(self) -> None:
        if self.jobs is not None:
            self.jobs.wait_idle()

    def close(self) -> None:
        if self.jobs is not None:
            self.jobs.close()

    @property
    def done(self) -> int:
        return self.jobs.done if self.jobs is not None else 0

    @property
    def errors(self) -> list[str]:
        return self.jobs.errors if self.jobs is not None else []


@dataclasses.dataclass
class Recovered:
    """What a recovery returns (`Recoverer.recover`): where training resumes, the `recovery`
    event (its `first_step_s` filled in by the loop), the new plan's snapshot pool (its first
    snapshot taken), the transfers it ran, and, after an async recovery, the cut-over to the
    optimal plan it leaves pending."""

    pos: Position
    event: RecoveryEvent
    pool: Any
    log: TransferLog
    cutover: PendingCutover | None


def _at(during: list, point: str) -> list:
    """The scheduled failures `during` a recovery that strike as its phase `point` begins
    (`faults.RECOVERY_PHASES`)."""
    return [e for e in during if e.phase == f"recovery/{point}"]


class Recoverer:
    """Recovery from failures, for the loop (`trainer.Trainer`) on either runtime. `source`
    gives executables, `contingencies` the plans, `transitions` the transfers planned ahead;
    `ckpt` (a `Checkpointer` or None) is the last rung; `compiles` counts XLA compiles."""

    def __init__(self, cfg: Config, rt, topo: Topology, factory: StateFactory,
                 source: ExecutableSource, contingencies: Contingencies,
                 transitions: TransitionPlanner, ckpt, compiles):
        self.cfg, self.rt, self.topo, self.factory = cfg, rt, topo, factory
        self.source, self.contingencies, self.transitions = source, contingencies, transitions
        self.ckpt, self.compiles = ckpt, compiles

    def recover(self, pos: Position, pool, failure: DeviceFailure, during: list) -> Recovered:
        """Recover from `failure` (raised at step `pos.step`, `pool` holding the snapshots of
        `pos.state`), injecting the scheduled failures `during` into the first attempt's
        transfer. A failure during an attempt starts another one with every failed device so
        far."""
        t_first = time.perf_counter()
        compiles_before = self.compiles.count
        self.transitions.stop()  # plans for the old plan's failures: stop preparing them
        dead = set(failure.devices)
        lost_hosts = set(pos.lost_hosts)
        # what survives of the last good state (held in a list: an attempt that renews the
        # collectives moves it onto the new client, for every later attempt too)
        stores = [self.rt.capture(pos.state, dead)]
        if self.ckpt is not None:
            self.ckpt.reopen(self.rt.processes())
        t_setup = time.perf_counter() - t_first  # counted in the plan phase
        renewals: list[Renewal] = []
        refusals_before = 0

        def attempt(run: Attempts) -> _Attempt:
            nonlocal refusals_before
            for f in run.failures:
                lost_hosts.update(self.topo.hosts_lost(f.devices))
            refusals_before = len(pool.refusals)  # (the new plan's pool shares the list)
            return self._attempt(pos, pool, run.failures[-1], dead, lost_hosts, stores, renewals,
                                 during if run.first else [])

        def fold(f: DeviceFailure) -> None:  # a failure during the recovery: start again
            if self.ckpt is not None:
                self.ckpt.reopen(self.rt.processes())
            dead.update(f.devices)
            stores[0] = stores[0].without(dead)

        a, run = until_recovered([failure], attempt, fold)
        failures, attempts = run.failures, run.count
        t_attempt = run.t_last if attempts > 1 else t_first + t_setup
        a.plan_s += t_setup if attempts == 1 else 0.0
        ev = self._event(pos, a, failures, dead, renewals, attempts,
                         retry_s=t_attempt - t_first - t_setup,
                         refused=a.pool.refusals[refusals_before:],
                         compiles_before=compiles_before)
        cutover = None
        if ev.migration == "async":
            cutover = PendingCutover(a.optimal, t_first - failures[0].detect_s, pos.step)
        new = Position(a.resume_at, a.plan, a.exe, a.state, a.actual, frozenset(a.live),
                       frozenset(lost_hosts), a.keep)
        return Recovered(new, ev, a.pool, a.log, cutover)

    def _attempt(self, pos: Position, pool, failure: DeviceFailure, dead: set[int],
                 lost_hosts: set[int], stores: list[ShardStore], renewals: list[Renewal],
                 during: list) -> _Attempt:
        """One attempt: plan, executables, transfer, verify, the new plan's snapshot pool, each
        phase in a guard of its own (a failure in any of them raises `DeviceFailure`). `stores`
        holds what survives; a renewal of the collectives moves it onto the new client."""
        strategy = self.cfg.recovery.strategy
        live = set(pos.live) - dead
        with self.rt.guard("recovery/plan"):
            t0 = time.perf_counter()
            survivors = self.contingencies.survivors(live)
            keep = pos.kept
            if not dead:  # a retry (collectives failed, nobody died): the same plan
                new_plan = optimal = pos.plan
            elif strategy == "torchft_like":
                optimal = torchft_plan(pos.plan, survivors)
                if optimal is None:
                    raise UnrecoverableStateError(
                        "params", (), f"torchft_like: no data replica is intact after "
                        f"devices {sorted(dead)} failed at step {pos.step}"
                    )
                keep = torchft_kept(pos.kept, pos.plan, optimal)
                new_plan = optimal
            else:
                new_plan, optimal = self.contingencies.recovery_plan(pos.plan, survivors)
            renewal = self._renew_collectives(failure)
            if renewal is not None:
                renewals.append(renewal)
                if not renewal.kept:
                    stores[0] = stores[0].map_data(self.rt.current)
            store = stores[0]
            self.rt.inject(_at(during, "plan"), "plan", [store])
            early = self._check_recoverable(pos, pool, store, dead, lost_hosts, new_plan, strategy)
            plan_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            standby = self.source.standby
            if standby is not None:  # the cores go to this recovery
                key = new_plan.compile_key
                standby.drop_queued(  # a compile of its program is waited for
                    keep=key, spare=lambda busy: self.cfg.standby.rebind
                    and busy.shape_key == key.shape_key)
            self.source.release_background()  # an attempt after a failed one
            # background builds wait from here to the first good step (`release_background`)
            got = self.source.get(new_plan, hold=True)
            exe = got.exe
            self.source.hold_background()  # (where `get` found nothing built)
            compile_s = time.perf_counter() - t0
        with self.rt.guard("recovery/transfer"):
            t0 = time.perf_counter()
            self.rt.inject(_at(during, "transfer"), "transfer", [store])
            built = self._rebuild(pos, pool, store.without(dead), dead, lost_hosts, exe, strategy)
            new_state, resume_at = built.state, built.resume_at
            self.rt.commit(new_state)
            transfer_s = time.perf_counter() - t0
        # a new guard: processes finish their copies at different times, and the checksums
        # below are a collective that must not wait for a slow one's copies
        if any(t.src in dead for t in built.log.entries):
            raise AssertionError("a transfer read a failed device")  # invariant
        with self.rt.guard("recovery/verify"):
            self.rt.inject(_at(during, "verify"), "verify", [store])
            # the new plan's pool replaces the old one only once this attempt succeeds: a retry
            # still needs the old plan's copies
            done = protect_moved(self.rt, exe, new_state, built.expected, "recovered state",
                                 f"the last good state (step {resume_at})", pool, resume_at, live)
        actual, new_pool = done.actual, done.pool
        verify_s, snapshot_s = done.verify_s, done.snapshot_s
        return _Attempt(
            new_plan, optimal, keep, live, exe, got.hit, got.standby_hit, got.wait_s, new_state,
            built.log, built.rung, resume_at, actual, done.compared, new_pool, early,
            built.tinfo, plan_s, compile_s, transfer_s, verify_s, snapshot_s,
        )

    def _event(self, pos: Position, a: _Attempt, failures: list, dead: set[int],
               renewals: list[Renewal], attempts: int, retry_s: float, refused: list,
               compiles_before: int) -> RecoveryEvent:
        """The `recovery` event of a recovery whose last attempt `a` succeeded."""
        first, log, new_plan = failures[0], a.log, a.plan
        procs = sorted({p for f in failures for p in f.report.failed_processes})
        detail = {k: v for k, v in first.report.as_dict().items()
                  if k not in ("failed_processes", "bytes_lost")}
        return RecoveryEvent(
            step=pos.step,
            failed_devices=sorted(dead),
            fault="; ".join(f.cause for f in failures if f.cause) or f"devices {sorted(dead)}",
            from_plan=pos.plan.name,
            to_plan=new_plan.name,
            rung=a.rung,
            bytes_moved=log.bytes_moved,
            transfers=log.transfers,
            max_transfers_per_device=log.max_per_device(),
            bytes_lost=sum(f.report.bytes_lost for f in failures),
            steps_lost=pos.step - a.resume_at,
            detect_s=first.detect_s,
            retry_s=retry_s,
            plan_s=a.plan_s,
            compile_s=a.compile_s,
            standby_hit=a.standby_hit,
            standby_wait_s=a.wait_s,
            exe_cache_hit=a.hit,
            executable_origin=a.exe.origin,
            transfer_s=a.transfer_s,
            verify_s=a.verify_s,
            snapshot_s=a.snapshot_s,
            runtime=self.rt.kind,
            failure_simulation=self.rt.failure_simulation,
            attempts=attempts,
            verify=a.compared.as_dict(),
            verified=a.compared.verified,
            resumed_at_step=a.resume_at,
            bytes_kept_in_place=log.kept_bytes,
            bytes_cross_process=log.cross_process_bytes,
            bytes_sent=log.sent,
            bytes_received=log.received,
            failed_processes=procs,
            failed_phases=[f.phase for f in failures],
            rungs=sorted(log.rungs()),
            refused_snapshots=refused,
            migration="async" if new_plan != a.optimal else "blocking",
            optimal_plan=a.optimal.name,
            strategy=self.cfg.recovery.strategy,
            compiles=compiles_before,  # completed after the first step
            # planned before the failure, and the planning time after it (in plan_s, or in
            # transfer_s when the sources differed from the described ones)
            transfer_plan_hit=a.early["plan_hit"] and a.tinfo.get("plan_hit", False),
            transfer_plan_s=(a.early["plan_s"] or 0.0) + a.tinfo.get("plan_s", 0.0),
            spare_took_over=sorted({
                self.topo.host_of(d) for d in set(new_plan.device_ids) - set(pos.plan.device_ids)
            }) if self.cfg.parallel.spares and same_shape(pos.plan, new_plan) else [],
            from_n_devices=pos.plan.n_devices,
            to_n_devices=new_plan.n_devices,
            collectives_renewed=any(not r.kept for r in renewals),
            collectives_kept=any(r.kept for r in renewals),
            renew_s=sum(r.renew_s for r in renewals),
            renew_reasons=" | ".join(r.reasons + (" (client kept)" if r.kept else "")
                                     for r in renewals),
            detail=detail,
        )

    def _renew_collectives(self, failure: DeviceFailure) -> Renewal | None:
        """Fresh collectives where the failure interrupted a block (`collectives`; every live
        process decides together). After a renewal, executables are reloaded onto the new
        client's devices when used (`ExecutableSource.current`); transitions planned before it
        stay valid (they name devices by id: `reshard._sharding_key`)."""
        return self.rt.renew_collectives(failure)

    def _check_recoverable(self, pos: Position, pool, store, dead, lost_hosts, plan: Plan,
                           strategy: str) -> dict:
        """Plan the transition now, from descriptions (the plan lands in the plan cache, so the
        transfer phase only executes it): a slice that no source can provide, and no checkpoint
        to fall back on, stops the recovery here instead of after compiling the new plan.
        Returns {plan_hit: planned before the failure, plan_s: planning time now}."""
        info = {"plan_hit": False, "plan_s": 0.0}
        if strategy != "elastic":
            return info
        try:
            self.transitions.move(
                store, dead, plan, pos.exe.layout, pool.describe_sources(dead, lost_hosts), info,
            )
        except UnrecoverableStateError as err:
            if self.ckpt is None:
                raise self._unrecoverable(err, pos, pool, dead, lost_hosts) from err
        return info

    def _unrecoverable(self, err: UnrecoverableStateError, pos: Position, pool,
                       dead: set[int], lost_hosts: set[int]) -> UnrecoverableStateError:
        """`err` (a slice with no source) explained, at step `pos.step` with no checkpoint: who
        held a lost slice of the stored state and each of its copies, the failure that took
        them all, and the snapshot settings that would have kept one
        (`transfer.coverage.explain`). The explained slice is one of the state as stored (a
        ZeRO partition's storage, where `err` may name a piece of it)."""
        live = set(pos.live) - dead
        described = describe_state(pos.state)
        missing = uncovered(described.without(dead), pool.describe_sources(dead, lost_hosts))
        why = f"devices {sorted(dead)} failed"
        if missing:
            path, box = missing[0]
            why = explain(path, box, described, pool, self.topo, live, dead,
                          set(self.topo.device_ids) - live, LOOP)
            if (path, box) != (err.leaf, err.box):
                why = f"stored as '{path}' {box_str(box)}: {why}"
        return UnrecoverableStateError(
            err.leaf, err.box, f"at step {pos.step}: {why}; no checkpoint is configured")

    def _rebuild(self, pos: Position, pool, store: ShardStore, dead: set[int], lost_hosts,
                 exe, strategy: str):
        """The state rebuilt from live sources, else from the newest checkpoint (losing the
        steps since)."""
        tinfo: dict = {}
        try:
            if strategy == "checkpoint_restart":
                raise UnrecoverableStateError("state", (), "checkpoint_restart restores from disk")
            snaps = pool.sources(dead, lost_hosts, version=pos.step)
            # device snapshots of an old CPU client (renewed at this failure), on the new one
            snaps = {k: map_shard_data(v, self.rt.current) for k, v in snaps.items()}
            new_state, log = transition(
                store,
                exe.state_shardings,
                devices=self.rt.devices,
                extra_sources=snaps,
                old_layout=pos.exe.layout,
                new_layout=exe.layout,
                plans=self.transitions.cache,
                info=tinfo,
                transport=self.rt,
                threads=self.rt.threads,
            )
            return _Rebuilt(new_state, log, log.worst_rung(), pos.step, pos.good, tinfo)
        except UnrecoverableStateError as err:
            if self.ckpt is None or strategy == "torchft_like":
                raise self._unrecoverable(err, pos, pool, dead, lost_hosts) from err
            ck_step = self.ckpt.latest_step()
            if ck_step is None:
                raise
            # read only: the verify guard checks it against `meta`'s checksums, its entry
            # barrier right before their collective (a read's time differs between processes)
            new_state, meta, _ = restore_onto(self.ckpt, ck_step, self.factory, exe,
                                              devices=self.rt.devices, transport=self.rt,
                                              threads=self.rt.threads)
            self.ckpt.drop_after(ck_step)
            return _Rebuilt(new_state, checkpoint_log(new_state), "checkpoint", ck_step,
                            meta["checksums"], tinfo)


# ---------------------------------------------------------------------------------------------
# What the loop's state on a plan survives, before it runs (`elasjax plan --coverage`).


class _InProcessPlacement:
    """The runtime a pool needs to place copies (`SnapshotPool.place`) for the in-process loop:
    one process, host copies in the holder's host memory. Nothing is moved through it."""

    me = 0
    host_copies_off_host = False

    @staticmethod
    def process_of(device) -> int:
        return 0


def _placed(cfg, plan, topo: Topology, live: set[int], devices):
    """(the described state, its snapshot pool) of the loop on `plan` over `live`, from the
    state's shapes and the plan's shardings alone (`plan_coverage`)."""
    factory = StateFactory(cfg, make_optimizer(cfg))
    mesh = make_mesh(plan.mesh_shape, [devices[i] for i in plan.device_ids])
    abstract = factory.layout(plan).abstract_on(mesh)
    pool = SnapshotPool(cfg.snapshot, topo, _InProcessPlacement(), donated=False)
    # the loop places copies over the plan's devices and its spares (`start._verify`)
    # at start, over every live device after a recovery
    pool.place(abstract, live if live != set(topo.device_ids)
               else set(plan.device_ids) | set(plan.spare_ids))
    return describe_state(abstract), pool


def plan_coverage(cfg, plan, topo: Topology, live: Iterable[int], devices, *,
                  pairs: bool = True):
    """(coverage, snapshot pool) of the loop's state on `plan` with `cfg.snapshot` (resolved
    as the loop resolves it, `SnapshotConfig.resolved`), for the in-process
    runtime: from the state's shapes (`jax.eval_shape`) and the plan's shardings alone, with no
    training step and no compile. `devices`: device id -> a `jax.Device` to lay the mesh on
    (any backend; only the layout is read). `live`: the topology's live devices (the rest have
    failed, their whole hosts' memory with them)."""
    live = set(live)
    described, pool = _placed(cfg, plan, topo, live, devices)
    dead = set(topo.device_ids) - live
    cov = coverage(described, pool, topo, live, dead_hosts=topo.hosts_lost(dead), pairs=pairs)
    return cov, pool


def plan_losses(cfg, plan, topo: Topology, live: Iterable[int], dead: Iterable[int],
                lost_hosts: Iterable[int], devices) -> list[tuple[str, tuple]]:
    """The slices (stored leaf path, box) of the loop's state on `plan`, its copies placed over
    `live`, that no live device or snapshot holds after `dead` fail with the memory of
    `lost_hosts` gone (in-process runtime: a host's memory goes only with a whole host's
    failure, `Topology.hosts_lost`); [] when the loop recovers. The recovery's own check
    (`Recoverer._check_recoverable`) from shapes and shardings alone."""
    described, pool = _placed(cfg, plan, topo, set(live), devices)
    dead = set(dead)
    return uncovered(described.without(dead), pool.describe_sources(dead, set(lost_hosts)))
