"""Recovery as a plan transition, growth when devices return, and the cut-over to the optimal
plan.

One recovery path for both runtimes (the trainer is given a runtime, `elasjax.runtime`). A
recovery is the timeline of DESIGN section 4, each phase timed:

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

Growth is the other direction: devices return (a schedule's `join`), empty. The planner's best
plan over the bigger live set (`planner.growth_plan`, no growth unless it is predicted at least
`recovery.grow_min_gain` faster) becomes a pending cut-over, exactly like the optimal plan after
an async recovery: training goes on on the current plan while the bigger plan compiles in the
background, and the cut-over at a step boundary fills the returned devices from the current
plan's (live) shards, verified by checksum. Its `growth` event reports the stall.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any

import jax

from .compilation.executables import Executables, on_devices
from .compilation.standby import StandbyCoverageWarning
from .mesh import make_mesh
from .metrics import RecoveryEvent
from .planner import (
    NoPlanError,
    Plan,
    fast_path_plan,
    growth_plan,
    replan,
    same_shape,
    substitute_spares,
    torchft_kept,
    torchft_plan,
)
from .runtime.inprocess import DeviceFailure, host_values
from .sharding import path_str
from .transfer import checksum
from .transfer.reshard import transition
from .transfer.shards import (
    ShardStore,
    Transfer,
    StateMismatchError,
    TransferLog,
    UnrecoverableStateError,
    box_size,
    describe_state,
    index_to_box,
    map_shard_data,
)


# the loop's earlier name for the one error of a state that does not verify
RecoveryVerificationError = StateMismatchError


@dataclasses.dataclass
class _Attempt:
    """A recovery attempt that succeeded (`Recovering._recovery_attempt`): the new plan (and the
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
    checksums (the last verified ones), `live` the devices alive."""

    step: int
    plan: Plan
    exe: Executables
    state: Any
    good: dict[str, str] | None
    live: frozenset[int]


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


def host_checksums(rt, sums, exe: Executables) -> dict[str, str]:
    """Stacked device checksums (replicated over `exe`'s plan) -> {key: hex}, on every live
    process (`runtime.host_values`). Every plan's state is checksummed here before its first
    step (start, recovery, cut-over): the runtime learns then which collective groups run on
    its client (`note_collectives`)."""
    rt.note_collectives(exe.plan.collective_groups)
    return checksum.rows_to_host(
        exe.layout.checksum_keys, host_values(rt, sums, exe.plan.device_ids)
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


class Recovering:
    """The trainer's recovery and cut-over (a mixin of `trainer.Trainer`, which owns the
    runtime, planner inputs, executables, snapshot pool, checkpoints and background work)."""

    # -- executables ----------------------------------------------------------------------------

    # a queued needed plan waits for the compile under way unless that has more than this
    # fraction of a mean compile left; beyond it, a cold compile now is sooner
    WAIT_BEHIND = 0.25
    # a needed plan (or its program) compiling in the worker is waited for only once the worker
    # has spent this fraction of a compile's CPU time on it; before, it is ended and the plan
    # compiled here with every core, sooner than the rest of a compile at low priority plus the
    # load (a child niced beside training may have barely started)
    WORKER_WAIT_PROGRESS = 0.25

    def executables(self, plan: Plan) -> tuple[Executables, bool, bool, float]:
        """See `_executables`; a compile worker's compile runs at normal priority meanwhile
        (what it compiles now is needed: `drop_queued` ended any other)."""
        if self.worker is None or self.standby.ready(plan.compile_key):
            return self._executables(plan)
        self.worker.renice(0)
        try:
            return self._executables(plan)
        finally:
            self.worker.renice(self.worker.nice)

    def _executables(self, plan: Plan) -> tuple[Executables, bool, bool, float]:
        """(executables, already compiled in this process, standby hit, seconds waited for a
        background compile). A standby hit means the executable was ready when asked for. A
        needed plan never waits in line: a queued one jumps to the front, or is built here when
        the build under way would take longer than `WAIT_BEHIND` of building it here; with
        `standby.rebind`, when the compile under way is of its program (for other devices), that
        compile is waited for and the plan loaded from it (`executables.rebind`). Either compile, when
        it runs in the compile worker and has not got far (`WORKER_WAIT_PROGRESS`), is ended
        instead and the plan compiled here."""
        if self.standby is not None:
            key = plan.compile_key
            exe = self.standby.get(key)
            if exe is not None:
                return self._current(exe, key), True, True, 0.0
            where = self.standby.expedite(key)
            busy = self.standby.busy()
            if busy is not None and (
                busy == key or (self.cfg.standby.rebind and busy.shape_key == key.shape_key)
            ) and self._worker_early():
                took = where == "front" and self.standby.take(key)  # first: never built twice
                if self.standby.cancel_busy(busy) or took:
                    busy, where = None, "absent"  # built here
            if (
                self.cfg.standby.rebind and busy is not None and busy != key
                and busy.shape_key == key.shape_key and not self._rebindable(key)
                and (where != "front" or self.standby.take(key))
            ):  # its program is compiling now for other devices: wait for that, then load it
                t0 = time.perf_counter()
                try:
                    self.standby.wait(busy)
                except Exception as e:  # noqa: BLE001 - any compile error: recorded, then
                    # compiled here, where an error that recurs is raised
                    self.standby_errors.append(f"{busy.name}: {type(e).__name__}: {e}")
                wait_s = time.perf_counter() - t0
                exe, hit = self.exe_cache.get(
                    self.cfg, self.factory, plan, self.devices, donate=self.donate,
                    reuse_programs=self.cfg.standby.rebind,
                )
                return exe, hit, False, wait_s
            left = self.standby.busy_left_s()
            # building it here: a rebind where its program is compiled, else a compile
            here_s = self.standby.mean_rebind_s if self._rebindable(key) else self.standby.mean_compile_s
            long_wait = left is not None and left > self.WAIT_BEHIND * here_s
            # `take` fails if the thread started it meanwhile: then it is waited for, never
            # compiled twice
            # (with a compile worker, whose compile of another program `drop_queued` ended,
            # a queued plan is built here at once: the worker would start afresh, niced)
            cold = where == "absent" or (
                where == "front" and (long_wait or self.worker is not None) and self.standby.take(key)
            )
            if not cold:
                t0 = time.perf_counter()
                exe = self._current(self.standby.wait(key), key)
                return exe, False, False, time.perf_counter() - t0
        exe, hit = self.exe_cache.get(
            self.cfg, self.factory, plan, self.devices, donate=self.donate,
            reuse_programs=self.cfg.standby.rebind,
        )
        return exe, hit, False, 0.0

    def _worker_early(self) -> bool:
        """Has the compile worker spent less than `WORKER_WAIT_PROGRESS` of a compile's CPU
        time (its finished compiles' mean, else this process's first compile) on the compile
        under way? False when nothing says."""
        progress = self.worker.progress() if self.worker is not None else None
        if progress is None:
            return False
        spent, full = progress
        full = full or self.first_compile_cpu_s
        return full > 0 and spent < self.WORKER_WAIT_PROGRESS * full

    def _rebindable(self, plan: Plan) -> bool:
        """Can `plan` be built without compiling (its program is compiled for other devices)?"""
        return self.cfg.standby.rebind and self.exe_cache.program(
            self.cfg, plan, self.donate, self.factory.tx_key) is not None

    def failure_candidates(self, plan: Plan, live: set[int]) -> list[tuple[set[int], set[int]]]:
        """The likeliest next failures of `plan`: (devices lost, hosts lost) for every single
        device (where the runtime can lose one alone) and every single host."""
        fails = [({d}, set()) for d in plan.device_ids] if self.rt.device_failures else []
        fails += [
            (set(self.topo.host_devices(h)) & live, {h})
            for h in range(self.topo.n_hosts)
            if set(self.topo.host_devices(h)) & set(plan.device_ids)
        ]
        return fails

    def standby_candidates(self, plan: Plan, live: set[int]) -> list[Plan]:
        """Plans recovery would need after the likeliest next failures of `plan`
        (`failure_candidates`): their optimal plans with `standby.enabled`; the no-movement fast
        paths with `recovery.migration: async`; and with `recovery.grow_standby`, the plan of
        the likeliest growth (every down device returns). With `standby.depth: 2`, also one plan
        of each new program (`Plan.shape_key`) needed after a second failure of each of those:
        after a recovery, the standby set of the new plan then needs no compile, only loads
        (`executables.rebind`). One per program, not every device set: a loaded CPU executable holds
        hundreds of memory mappings, and a process has a bounded number (`standby.map_budget`)."""
        first = self._next_plans(plan, live)
        out = [p for p, _ in first]
        if self.cfg.standby.enabled and self.cfg.standby.depth == 2:
            programs = {p.shape_key for p in out}
            for nxt, survivors in first:
                for p, _ in self._next_plans(nxt, survivors):
                    if p.shape_key not in programs:
                        programs.add(p.shape_key)
                        out.append(p)
        if self.cfg.recovery.grow_standby and hasattr(self.rt, "join"):
            grown = self._growth_candidate(plan, live)
            if grown is not None:
                out.append(grown)
        return list(dict.fromkeys(p.compile_key for p in out))

    def _next_plans(self, plan: Plan, live: set[int]) -> list[tuple[Plan, set[int]]]:
        """(plan, its live devices) after each of `plan`'s likeliest next failures."""
        out: list[tuple[Plan, set[int]]] = []
        for gone, _ in self.failure_candidates(plan, live):
            survivors = [d for d in self.topo.device_ids if d in live - gone]
            if not survivors:
                continue
            left = set(survivors)
            if self.cfg.parallel.spares and (
                self.cfg.standby.enabled or self.cfg.recovery.migration == "async"
            ):  # a spare would take over: recovery resumes on that plan, async or not
                kept = substitute_spares(plan, survivors, self.topo)
                if kept is not None:
                    out.append((kept, left))
                    continue
            if self.cfg.recovery.migration == "async":
                fast = fast_path_plan(plan, survivors, self.cfg)
                if fast is not None:
                    out.append((fast, left))
            if self.cfg.standby.enabled:
                try:
                    out.append((replan(survivors, self.topo, self.cfg, plan, self.initial), left))
                except NoPlanError:  # a failure the planner cannot serve needs no standby
                    pass
        return out

    def _growth_candidate(self, plan: Plan, live: set[int]) -> Plan | None:
        """The plan growth would move to from `plan` if every down device of the job returned
        (`recovery.grow_standby`); None when none is down or it would not grow."""
        if set(self.topo.device_ids) <= set(live):
            return None
        try:
            g = growth_plan(list(self.topo.device_ids), self.topo, self.cfg, plan, self.initial)
        except NoPlanError:  # nothing to compile ahead for a set the planner cannot serve
            return None
        return g.best if g.grow else None

    def _renew_collectives(self, failure: DeviceFailure, plan: Plan) -> dict | None:
        """Fresh collectives where the failure may have broken some that `plan`, the plan to
        resume on, could use (`collectives`; every live process decides together). After a
        renewal, transitions planned for the old client's devices are dropped and executables
        are reloaded onto the new ones when used (`_current`)."""
        renewal = self.rt.renew_collectives(failure, plan.collective_groups)
        if renewal is not None and renewal["renewed"]:
            self.transition_plans.clear()
        return renewal

    def _current(self, exe: Executables, key) -> Executables:
        """A standby executable on the current client: reloaded (`executables.rehome`, no compile) when
        the CPU client was renewed after it was built, and kept so (built again where it cannot
        be reloaded: one that JAX's persistent cache loaded, which serves it again)."""
        current = on_devices(exe, self.devices)
        if current is None:
            current = self.exe_cache.get(
                self.cfg, self.factory, exe.plan, self.devices, donate=self.donate,
                reuse_programs=self.cfg.standby.rebind,
            )[0]
        if current is not exe:
            self.standby.put(key, current)
        return current

    def _recovery_plan(self, plan: Plan, survivors: list[int]) -> tuple[Plan, Plan]:
        """(plan to resume on, optimal plan) after a failure that leaves `survivors`."""
        optimal = replan(survivors, self.topo, self.cfg, plan, self.initial)
        if self.cfg.parallel.spares and same_shape(plan, optimal):
            return optimal, optimal  # a hot spare took over: nothing faster to resume on
        if self.cfg.recovery.migration == "async" and self.cfg.recovery.strategy == "elastic":
            fast = fast_path_plan(plan, survivors, self.cfg)
            if fast is not None and fast != optimal:
                return fast, optimal
        return optimal, optimal

    # -- background work ------------------------------------------------------------------------

    def _prepare_transitions(self, plan: Plan, exe: Executables, state, live: set[int]) -> None:
        """Plan, in the background, the transitions recovery would run after each likely next
        failure of `plan` (`failure_candidates`), from shard descriptions: `transition` then
        finds them in `transition_plans` and only executes copies. Elastic strategy only."""
        if self.jobs is None or self.cfg.recovery.strategy != "elastic":
            return
        full = describe_state(state)  # metadata of the buffers only, read on this thread
        held = set(plan.device_ids) | set(plan.spare_ids)
        jobs = []
        for gone, hosts in self.failure_candidates(plan, live):
            survivors = [d for d in self.topo.device_ids if d in live - gone]
            if survivors:
                jobs.append(functools.partial(
                    self._prepare_one, full, plan, exe.layout, gone & held, survivors,
                    self.dead_hosts | hosts,
                ))
        self.jobs.replace(jobs)

    def _prepare_one(self, full, plan, old_layout, dead, survivors, dead_hosts) -> None:
        target, _ = self._recovery_plan(plan, survivors)
        self._prepare_move(
            full, dead, target, old_layout, self.pool.describe_sources(dead, dead_hosts)
        )

    def _prepare_move(self, full, dead, target: Plan, old_layout, extra, info=None) -> None:
        layout = self.factory.layout(target)
        mesh = make_mesh(target.mesh_shape, [self.devices[i] for i in target.device_ids])
        self.transition_plans.prepare(
            full.without(dead), layout.shardings(mesh), extra, old_layout=old_layout,
            new_layout=layout, info=info,
        )

    def _refresh_standby(self, plan: Plan, live: set[int]) -> None:
        if self.standby is not None:
            keys = self.standby_candidates(plan, live)
            self.standby.submit(keys)
            if self.standby.dropped:
                msg = (
                    f"standby.max_plans={self.standby.max_plans} covers "
                    f"{len(keys) - self.standby.dropped} of the {len(keys)} plans of {plan.name}'s "
                    "likely failures (every single device and host); the others compile when "
                    "they are needed (unset max_plans to cover all)"
                )
                self.rt.log(msg)
                warnings.warn(msg, StandbyCoverageWarning, stacklevel=2)

    # -- recovery -------------------------------------------------------------------------------

    def _recover(self, pos: Position, failure: DeviceFailure, during: list) -> tuple[Position, RecoveryEvent]:
        """Recover from `failure` (raised at step `pos.step`), injecting the scheduled failures
        `during` into the first attempt's transfer. A failure during an attempt starts another
        one with every failed device so far. Returns the new position and its event (its
        `first_step_s` filled in by the loop)."""
        t_first = time.perf_counter()
        compiles_before = self.compiles.count
        if self.jobs is not None:
            self.jobs.replace([])  # plans for the old plan's failures: stop preparing them
        self.pending_cutover = None  # a new failure re-plans from scratch (returned devices too)
        failures = [failure]
        dead = set(failure.devices)
        # what survives of the last good state (held in a list: an attempt that renews the
        # collectives moves it onto the new client, for every later attempt too)
        stores = [self.rt.capture(pos.state, dead)]
        if self.ckpt is not None:
            self.ckpt.reopen(self.rt.processes())
        t_setup = time.perf_counter() - t_first  # counted in the plan phase
        renewals: list[dict] = []
        attempts = 0
        while True:
            attempts += 1
            t_attempt = time.perf_counter() if attempts > 1 else t_first + t_setup
            for f in failures:
                self.dead_hosts |= self._lost_hosts(f.devices)
            refusals_before = len(self.pool.refusals)
            try:
                a = self._recovery_attempt(pos, failures[-1], dead, stores, renewals,
                                           during if attempts == 1 else [])
                break
            except DeviceFailure as f:  # a failure during the recovery: start again
                if self.ckpt is not None:
                    self.ckpt.reopen(self.rt.processes())
                failures.append(f)
                dead |= f.devices
                stores[0] = stores[0].without(dead)
        a.plan_s += t_setup if attempts == 1 else 0.0
        self.torchft_keep = a.keep
        self.pool = a.pool
        ev = self._recovery_event(pos, a, failures, dead, renewals, attempts,
                                  retry_s=t_attempt - t_first - t_setup,
                                  refused=self.pool.refusals[refusals_before:],
                                  compiles_before=compiles_before)
        self.transfer_logs.append(a.log)
        if ev.migration == "async":
            self.pending_cutover = PendingCutover(
                a.optimal, t_first - failures[0].detect_s, pos.step)
            self.cutover_wait_s = 0.0
            self.standby.submit([a.optimal.compile_key])  # the only plan that matters now
            if self.jobs is not None:  # plan the cut-over (nothing lost, no snapshots)
                self.jobs.replace([functools.partial(
                    self._prepare_move, describe_state(a.state), set(), a.optimal,
                    a.exe.layout, None,
                )])
        else:
            # Refresh the standby set after the first step, so that its compiles do not compete
            # with the step that ends the recovery.
            self._standby_due = (a.plan, set(a.live))
        new = Position(a.resume_at, a.plan, a.exe, a.state, a.actual, frozenset(a.live))
        return new, ev

    def _recovery_attempt(self, pos: Position, failure: DeviceFailure, dead: set[int],
                          stores: list[ShardStore], renewals: list[dict], during: list) -> _Attempt:
        """One attempt: plan, executables, transfer, verify, the new plan's snapshot pool, each
        phase in a guard of its own (a failure in any of them raises `DeviceFailure`). `stores`
        holds what survives; a renewal of the collectives moves it onto the new client."""
        strategy = self.cfg.recovery.strategy
        live = set(pos.live) - dead
        with self.rt.guard("recovery/plan"):
            t0 = time.perf_counter()
            survivors = [d for d in self.topo.device_ids if d in live]
            keep = self.torchft_keep
            if not dead:  # a retry (collectives failed, nobody died): the same plan
                new_plan = optimal = pos.plan
            elif strategy == "torchft_like":
                optimal = torchft_plan(pos.plan, survivors)
                if optimal is None:
                    raise UnrecoverableStateError(
                        "params", (), f"torchft_like: no data replica is intact after "
                        f"devices {sorted(dead)} failed at step {pos.step}"
                    )
                keep = torchft_kept(self.torchft_keep, pos.plan, optimal)
                new_plan = optimal
            else:
                new_plan, optimal = self._recovery_plan(pos.plan, survivors)
            renewal = self._renew_collectives(failure, new_plan)
            if renewal is not None:
                renewals.append(renewal)
                stores[0] = stores[0].map_data(self.rt.current)
            store = stores[0]
            early = self._check_recoverable(pos, store, dead, new_plan, strategy)
            plan_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            if self.standby is not None:  # the cores go to this recovery
                key = new_plan.compile_key
                self.standby.drop_queued(  # a compile of its program is waited for
                    keep=key, spare=lambda busy: self.cfg.standby.rebind
                    and busy.shape_key == key.shape_key)
            exe, hit, standby_hit, wait_s = self.executables(new_plan)
            compile_s = time.perf_counter() - t0
        with self.rt.guard("recovery/transfer"):
            t0 = time.perf_counter()
            self.rt.inject(during, "transfer", [store])
            new_state, log, rung, resume_at, expected, tinfo = self._rebuild(
                pos, store.without(dead), dead, exe, strategy
            )
            self.rt.commit(new_state)
            transfer_s = time.perf_counter() - t0
        # a new guard: processes finish their copies at different times, and the checksums
        # below are a collective that must not wait for a slow one's copies
        with self.rt.guard("recovery/verify"):
            t0 = time.perf_counter()
            actual = host_checksums(self.rt, exe.checksum(new_state), exe)
            bad = checksum.diff(expected, actual)
            if bad:
                raise RecoveryVerificationError(
                    f"recovered state differs from the last good state in {len(bad)} "
                    f"leaves, e.g. {bad[:3]}; refusing to continue"
                )
            if any(t.src in dead for t in log.entries):
                raise AssertionError("a transfer read a failed device")  # invariant
            verify_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            # the new plan's pool replaces the old one only once this attempt succeeds: a retry
            # still needs the old plan's copies
            pool = self.pool.fresh()
            pool.configure(new_state, exe.state_shardings, exe.mesh, live)
            pool.take(new_state, resume_at)
            snapshot_s = time.perf_counter() - t0
        return _Attempt(
            new_plan, optimal, keep, live, exe, hit, standby_hit, wait_s, new_state, log, rung,
            resume_at, actual, pool, early, tinfo, plan_s, compile_s, transfer_s, verify_s,
            snapshot_s,
        )

    def _recovery_event(self, pos: Position, a: _Attempt, failures: list, dead: set[int],
                        renewals: list[dict], attempts: int, retry_s: float, refused: list,
                        compiles_before: int) -> RecoveryEvent:
        """The `recovery` event of a recovery whose last attempt `a` succeeded."""
        first, log, new_plan = failures[0], a.log, a.plan
        procs = sorted({p for f in failures for p in f.detail.get("failed_processes", [])})
        detail = {k: v for k, v in first.detail.items() if k not in ("failed_processes", "bytes_lost")}
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
            bytes_lost=sum(f.detail.get("bytes_lost", 0) for f in failures),
            steps_lost=pos.step - a.resume_at,
            detect_s=first.detect_s,
            retry_s=retry_s,
            plan_s=a.plan_s,
            compile_s=a.compile_s,
            standby_hit=a.standby_hit,
            standby_wait_s=a.wait_s,
            exe_cache_hit=a.hit,
            transfer_s=a.transfer_s,
            verify_s=a.verify_s,
            snapshot_s=a.snapshot_s,
            runtime=self.rt.kind,
            failure_simulation=self.rt.failure_simulation,
            attempts=attempts,
            verified=True,
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
            collectives_renewed=any(r["renewed"] for r in renewals),
            renew_s=sum(r["renew_s"] for r in renewals),
            renew_reasons=" | ".join(r["renew_reasons"] for r in renewals),
            client_kept=" | ".join(r["kept_client"] for r in renewals if not r["renewed"]),
            detail=detail,
        )

    def _lost_hosts(self, devices) -> set[int]:
        """Hosts all of whose devices are gone (a host failure, as opposed to device ones)."""
        dead = set(devices)
        return {
            h for h in range(self.topo.n_hosts) if set(self.topo.host_devices(h)) <= dead
        }

    def _check_recoverable(self, pos, store, dead, plan: Plan, strategy: str) -> dict:
        """Plan the transition now, from descriptions (the plan lands in the plan cache, so the
        transfer phase only executes it): a slice that no source can provide, and no checkpoint
        to fall back on, stops the recovery here instead of after compiling the new plan.
        Returns {plan_hit: planned before the failure, plan_s: planning time now}."""
        info = {"plan_hit": False, "plan_s": 0.0}
        if strategy != "elastic":
            return info
        try:
            self._prepare_move(
                store, dead, plan, pos.exe.layout,
                self.pool.describe_sources(dead, self.dead_hosts), info,
            )
        except UnrecoverableStateError as err:
            if self.ckpt is None:
                raise UnrecoverableStateError(
                    err.leaf, err.box, f"devices {sorted(dead)} failed at step {pos.step}; no "
                    "surviving copy, no snapshot, and no checkpoint (checkpoint.dir)"
                ) from err
        return info

    def _rebuild(self, pos: Position, store: ShardStore, dead: set[int], exe, strategy: str):
        """(state, log, rung, resumed step, expected checksums, transition info): from live
        sources, else from the newest checkpoint (losing the steps since)."""
        tinfo: dict = {}
        try:
            if strategy == "checkpoint_restart":
                raise UnrecoverableStateError("state", (), "checkpoint_restart restores from disk")
            snaps = self.pool.sources(dead, self.dead_hosts, version=pos.step)
            # device snapshots of an old CPU client (renewed at this failure), on the new one
            snaps = {k: map_shard_data(v, self.rt.current) for k, v in snaps.items()}
            new_state, log = transition(
                store,
                exe.state_shardings,
                devices=self.devices,
                extra_sources=snaps,
                old_layout=pos.exe.layout,
                new_layout=exe.layout,
                plans=self.transition_plans,
                info=tinfo,
                transport=self.rt,
                threads=self.rt.threads,
            )
            return new_state, log, log.worst_rung(), pos.step, pos.good, tinfo
        except UnrecoverableStateError as err:
            if self.ckpt is None or strategy == "torchft_like":
                raise UnrecoverableStateError(
                    err.leaf, err.box, f"devices {sorted(dead)} failed at step {pos.step}; no "
                    "surviving copy, no verified snapshot, and no checkpoint (checkpoint.dir)"
                ) from err
            ck_step = self.ckpt.latest_step()
            if ck_step is None:
                raise
            new_state, meta = self._restore(ck_step, exe)
            self.ckpt.drop_after(ck_step)
            return new_state, checkpoint_log(new_state), "checkpoint", ck_step, meta["checksums"], tinfo

    # -- growth ---------------------------------------------------------------------------------

    def _join(self, pos: Position, joins: list) -> tuple[Position, dict]:
        """Devices return at the boundary before step `pos.step`: they join the live set, empty.
        When the planner finds a plan over the bigger set worth growing to, it becomes the
        pending cut-over (compiled in the background while training goes on); otherwise the
        devices stay spare. Returns the new position and the `join` event."""
        t0 = time.perf_counter()
        ids = sorted({d for e in joins for d in e.device_ids})
        self.rt.join(ids)
        live = frozenset(pos.live | set(ids))
        self.dead_hosts -= {self.topo.host_of(d) for d in live}  # their memory is usable again
        survivors = [d for d in self.topo.device_ids if d in live]
        g = growth_plan(survivors, self.topo, self.cfg, pos.plan, self.initial)
        ev = {
            "type": "join", "step": pos.step, "devices": ids,
            "spec": "; ".join(e.spec for e in joins), "n_live": len(live), "plan": pos.plan.name,
            "best_plan": g.best.name, "predicted_step_s": g.current_s,
            "best_predicted_step_s": g.best_s, "predicted_gain": g.gain, "grow": g.grow,
            "reason": g.reason,
        }
        if g.grow:
            ev["replaces_pending"] = (
                self.pending_cutover.plan.name if self.pending_cutover is not None else None)
            self.pending_cutover = PendingCutover(
                g.best, t0, pos.step, "growth", tuple(ids), g.gain)
            self.cutover_wait_s = 0.0
            self.standby.submit([g.best.compile_key])  # the only plan that matters now
            if self.jobs is not None:  # plan the cut-over's copies in the background too
                self.jobs.replace([functools.partial(
                    self._prepare_move, describe_state(pos.state), set(), g.best,
                    pos.exe.layout, None,
                )])
        elif self.pending_cutover is None:
            self._standby_due = (pos.plan, set(live))  # the likely failures' plans changed
        ev["plan_s"] = time.perf_counter() - t0
        return dataclasses.replace(pos, live=live), ev

    # -- cut-over -------------------------------------------------------------------------------

    def _cutover_due(self, step: int) -> tuple[bool, dict | None]:
        """(cut over now?, an `cutover_abandoned` event). Cut over when the optimal plan is
        compiled on every process, or wait for it once the run has spent
        `recovery.max_fast_path_steps` steps on the fast path. If its background compile failed
        on any process, the run stays on the fast path (which trains the same computation) and
        the error is returned as an event, never raised."""
        pc = self.pending_cutover
        optimal, fail_step = pc.plan, pc.step
        key = optimal.compile_key
        limit = self.cfg.recovery.max_fast_path_steps
        try:
            if limit and step - fail_step >= limit and not self.standby.ready(key):
                t0 = time.perf_counter()
                self.standby.wait(key)
                self.cutover_wait_s += time.perf_counter() - t0
            err = self.standby.error(key)
        except Exception as e:  # the compile failed while we waited (`wait` raises its error)
            err = e
        # each process's [state, error message]: lists survive the runtime's agreement
        status = ["ready" if self.standby.ready(key) else "compiling", ""]
        if err is not None:
            status = ["error", f"{type(err).__name__}: {err}"[:500]]
        votes = self.rt.agree(status)
        errors = {str(p): msg for p, (state, msg) in votes.items() if state == "error"}
        if errors:
            self.pending_cutover = None
            return False, {
                "type": "cutover_abandoned", "kind": pc.kind, "step": step,
                "optimal_plan": optimal.name, "errors": errors,
                "stays_on": "the current plan (the same computation; fewer devices used)",
            }
        return all(state == "ready" for state, _ in votes.values()), None

    def _cutover(self, pos: Position) -> tuple[Position, dict]:
        """Move to the optimal plan (compiled in the background) at a step boundary. Each part
        is its own guard (a failure leaves `pos` as it was: the old state is intact)."""
        pc = self.pending_cutover
        optimal, t_fail, fail_step = pc.plan, pc.t_start, pc.step
        new_exe = self._current(self.standby.get(optimal.compile_key), optimal.compile_key)
        with self.rt.guard("cutover/transfer"):
            t0 = time.perf_counter()
            tinfo: dict = {}
            new_state, log = transition(
                ShardStore.capture(pos.state), new_exe.state_shardings, devices=self.devices,
                old_layout=pos.exe.layout, new_layout=new_exe.layout, plans=self.transition_plans,
                info=tinfo, transport=self.rt, threads=self.rt.threads,
            )
            self.rt.commit(new_state)
            transfer_s = time.perf_counter() - t0
        if not log.sources() <= set(pos.plan.device_ids):  # invariant: returned devices are empty
            raise AssertionError(f"a cut-over read {log.sources() - set(pos.plan.device_ids)}, "
                                 f"outside {pos.plan.name}")
        with self.rt.guard("cutover/verify"):
            t0 = time.perf_counter()
            actual = host_checksums(self.rt, new_exe.checksum(new_state), new_exe)
            bad = checksum.diff(pos.good, actual)
            if bad:
                raise RecoveryVerificationError(f"cut-over changed {len(bad)} leaves, e.g. {bad[:3]}")
            verify_s = time.perf_counter() - t0
            pool = self.pool.fresh()
            pool.configure(new_state, new_exe.state_shardings, new_exe.mesh, set(pos.live))
            pool.take(new_state, pos.step)
        self.pool = pool
        self.pending_cutover = None
        self.transfer_logs.append(log)
        self._refresh_standby(optimal, set(pos.live))
        self._prepare_transitions(optimal, new_exe, new_state, set(pos.live))
        mig = {
            "type": pc.kind,
            "step": pos.step,
            ("join_step" if pc.kind == "growth" else "failure_step"): fail_step,
            "from_plan": pos.plan.name,
            "to_plan": optimal.name,
            "bytes_moved": log.bytes_moved,
            "bytes_cross_process": log.cross_process_bytes,
            "transfers": log.transfers,
            "transfer_s": transfer_s,
            "verify_s": verify_s,
            # waited for the optimal plan's compile (after `recovery.max_fast_path_steps`)
            "compile_wait_s": self.cutover_wait_s,
            "stall_s": self.cutover_wait_s + transfer_s + verify_s,
            "transfer_plan_hit": tinfo["plan_hit"],
            "transfer_plan_s": tinfo["plan_s"],
            "steps_on_fast_path": pos.step - fail_step,
            "time_to_optimal_s": time.perf_counter() - t_fail,
            "verified": True,
        }
        if pc.kind == "growth":
            mig.update(joined_devices=list(pc.joined), n_devices=optimal.n_devices,
                       from_n_devices=pos.plan.n_devices, predicted_gain=pc.predicted_gain,
                       sources=sorted(log.sources()))
        new = Position(pos.step, optimal, new_exe, new_state, actual, pos.live)
        return new, mig
