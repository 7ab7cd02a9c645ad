"""Growth when devices return, and the cut-over to a pending plan at a step boundary.

Devices that return (a schedule's `join`) join the live set, empty. The planner's best plan over
the bigger set (`planner.growth_plan`, no growth unless it is predicted at least
`recovery.grow_min_gain` faster) becomes a pending cut-over, exactly like the optimal plan after
an async recovery: training goes on on the current plan while the pending plan compiles in the
background, and the cut-over at a step boundary moves the state onto it from the current plan's
(live) shards, verified by checksum. Its `migration` or `growth` event reports the stall.

Growth does not wait for a compile where it need not: when the returned devices make possible a
plan the run has stood on before (the start plan, a plan it left at a failure), whose
executables are compiled, and that the cost model predicts faster than the current one
(`Cutovers._interim`: the one on the most devices, then the fastest measured), the run cuts over
to it at once and moves to the best plan once that is compiled (a second cut-over). The choice
depends only on the run's history and its agreed step times, never on what happens to be
compiled on one process, so every process of a `launch` job makes the same one.
"""

from __future__ import annotations

import dataclasses
import time

from ..compilation.source import ExecutableSource
from ..config import Config
from ..observe.events import CutoverAbandoned, CutoverEvent, JoinEvent
from ..plan.planner import Plan, Topology, growth_plan, predict_step_s
from ..transfer.reshard import transition
from ..transfer.shards import ShardStore, TransferLog
from .recovery import PendingCutover, Position, TransitionPlanner, protect_moved


@dataclasses.dataclass
class CutoverDone:
    """A cut-over that happened (`Cutovers.cutover`): the new position, the new plan's snapshot
    pool (its first snapshot taken), the transfers, the `migration` or `growth` event, and the
    cut-over pending next (growth's best plan after an interim one), or None."""

    pos: Position
    pool: object
    log: TransferLog
    event: CutoverEvent
    pending: PendingCutover | None


class Cutovers:
    """Pending, waiting for and making the cut-overs of a run. The pending cut-over itself
    (a `recovery.PendingCutover`) and the plans the run stood on are the loop's
    (`LoopState.cutover`, `LoopState.stood_on`): given here, returned changed."""

    def __init__(self, cfg: Config, rt, topo: Topology, initial: Plan, source: ExecutableSource,
                 transitions: TransitionPlanner):
        self.cfg, self.rt, self.topo, self.initial = cfg, rt, topo, initial
        self.source, self.transitions = source, transitions

    def _ready_everywhere(self, plan: Plan) -> bool:
        """Is `plan` compiled on every live process (they agree, so all decide alike)?"""
        sb = self.source.standby
        ready = sb is not None and sb.ready(plan.compile_key)
        return all(v[0] for v in self.rt.agree([bool(ready)]).values())

    def _agreed_paces(self, paces: dict[str, float]) -> dict[str, float]:
        """Each plan's measured step time (`paces`: this process's), the slowest process's
        (every process of a `launch` job then makes the same interim choice)."""
        votes = self.rt.agree(sorted(paces.items()))
        out: dict[str, float] = {}
        for pairs in votes.values():
            for name, s in pairs:
                out[name] = max(out.get(name, 0.0), s)
        return out

    def _interim(self, current: Plan, best: Plan, live: frozenset[int],
                 paces: dict[str, float], stood_on: dict) -> Plan | None:
        """A plan the run has stood on before (its executables were compiled then: a cut-over
        to it needs no compile) that the live devices can run, other than `best` and `current`,
        and that the cost model predicts faster than `current` (the growth itself, to `best`,
        was decided by `recovery.grow_min_gain`; this is its first step, never a slower plan).
        Among those, the one on the most devices
        (the returned devices put to work: the start plan where it fits); among as many devices,
        the one that ran fastest (the slowest process's step time, agreed), by prediction where
        one has no step time. Measured times do not decide between plans of different sizes: on
        fake CPU devices sharing two cores a 5-device plan measured as fast as the 8-device start
        plan, and the run stayed on 5 devices (experiments/RESULTS.md, "Growth to a compiled
        plan"; test_growth.py::test_an_interim_plan_uses_the_most_devices_then_the_measured_time)."""
        cfg = self.cfg
        now = predict_step_s(current, cfg)
        measured = self._agreed_paces(paces)
        options = []
        for key, p in stood_on.items():
            if key in (best.compile_key, current.compile_key):
                continue
            if not set(p.device_ids) | set(p.spare_ids) <= live:
                continue
            s = predict_step_s(p, cfg)
            if s >= now:
                continue
            pace = measured.get(p.name)
            # (more devices first; then measured before predicted, fastest first)
            options.append((-p.n_devices, pace is None, pace if pace is not None else s,
                            len(options), p))
        return min(options)[-1] if options else None

    def pend(self, pc: PendingCutover, pos: Position) -> PendingCutover:
        """`pc` pending from `pos` (returned, its wait for the compile not begun): its plan is
        the only one the standby builds now, and the move to it is planned in the background.
        A growth that a retry (collectives failed, nobody died) interrupted is pended again so:
        it keeps the devices a join returned at work, which would otherwise stay idle (a retry
        at step 19 of a rejoin at 14 ended a run on 4 of 8 devices: experiments/RESULTS.md,
        "Two restarted workers")."""
        pc = dataclasses.replace(pc, wait_s=0.0)
        # a growth's plan found compiled is ready at once; an async recovery's optimal plan is
        # not (its first step runs on the fast path it recovered to, which ends its MTTR:
        # tests/test_optimized.py::test_deterministic_zero1_on_pipelines_is_bitwise_through_failures)
        self.source.only(pc.plan, from_cache=pc.kind == "growth")
        self.transitions.for_cutover(pos, pc.plan)
        return pc

    def join(self, pos: Position, joins: list, paces: dict[str, float],
             pending: PendingCutover | None, stood_on: dict
             ) -> tuple[Position, JoinEvent, PendingCutover | None]:
        """Devices return at the boundary before step `pos.step`: they join the live set, empty.
        When the planner finds a plan over the bigger set worth growing to, it becomes the
        pending cut-over (replacing `pending`); otherwise the devices stay spare. `paces`: the
        measured step time of each plan the run has stood on (by name; `metrics.paces` of the
        loop's timeline), for the interim choice among `stood_on` (`_interim`). Returns the new
        position, the `join` event and the cut-over pending now."""
        t0 = time.perf_counter()
        ids = sorted({d for e in joins for d in e.device_ids})
        self.rt.join(ids)
        live = frozenset(pos.live | set(ids))
        # the returned hosts' memory is usable again
        lost = pos.lost_hosts - {self.topo.host_of(d) for d in live}
        survivors = [d for d in self.topo.device_ids if d in live]
        g = growth_plan(survivors, self.topo, self.cfg, pos.plan, self.initial)
        ev = JoinEvent(
            step=pos.step, devices=ids, spec="; ".join(e.spec for e in joins), n_live=len(live),
            plan=pos.plan.name, best_plan=g.best.name, predicted_step_s=g.current_s,
            best_predicted_step_s=g.best_s, predicted_gain=g.gain, grow=g.grow, reason=g.reason,
        )
        new = dataclasses.replace(pos, live=live, lost_hosts=frozenset(lost))
        if g.grow:
            ev.replaces_pending = pending.plan.name if pending is not None else None
            best = PendingCutover(g.best, t0, pos.step, "growth", tuple(ids), g.gain)
            interim = None
            if self.cfg.recovery.grow_interim and not self._ready_everywhere(g.best):
                interim = self._interim(pos.plan, g.best, live, paces, stood_on)
            if interim is not None:
                now = predict_step_s(pos.plan, self.cfg)
                gain = (now - predict_step_s(interim, self.cfg)) / now
                pending = self.pend(PendingCutover(interim, t0, pos.step, "growth", tuple(ids),
                                                   gain, after=best), new)
                ev.interim_plan = interim.name
            else:
                pending = self.pend(best, new)
        ev.plan_s = time.perf_counter() - t0
        return new, ev, pending

    def due(self, pc: PendingCutover, step: int
            ) -> tuple[bool, CutoverAbandoned | None, PendingCutover | None]:
        """(cut over to `pc` now?, a `cutover_abandoned` event, the cut-over pending after
        this: `pc` with its wait for the compile, None if abandoned). Now when its plan is
        compiled on every process, or after waiting for it once the run has spent
        `recovery.max_fast_path_steps` steps on the fast path (a growth: that many, or
        `recovery.grow_wait_steps` since the join, the sooner). If its background compile failed
        on any process, the cut-over is abandoned (the event) and the run stays on its plan
        (which trains the same computation); never raised."""
        sb = self.source.standby
        wait_s = pc.wait_s
        key = pc.plan.compile_key
        r = self.cfg.recovery
        limit = r.max_fast_path_steps
        if pc.kind == "growth":  # the sooner of the two bounds that are set
            limit = min((n for n in (limit, r.grow_wait_steps) if n), default=0)
        try:
            if limit and step - pc.step >= limit and not sb.ready(key):
                t0 = time.perf_counter()
                try:
                    sb.wait(key)
                finally:
                    wait_s += time.perf_counter() - t0
            err = sb.error(key)
        except Exception as e:  # noqa: BLE001 - the compile failed while we waited (`wait`
            # raises its error): agreed below and reported as the abandoned cut-over's event
            err = e
        # each process's [state, error message]: lists survive the runtime's agreement
        status = ["ready" if sb.ready(key) else "compiling", ""]
        if err is not None:
            status = ["error", f"{type(err).__name__}: {err}"[:500]]
        votes = self.rt.agree(status)
        errors = {str(p): msg for p, (state, msg) in votes.items() if state == "error"}
        if errors:
            ev = CutoverAbandoned(
                kind=pc.kind, step=step, optimal_plan=pc.plan.name, errors=errors,
                stays_on="the current plan (the same computation; fewer devices used)",
            )
            return False, ev, None
        now = all(state == "ready" for state, _ in votes.values())
        return now, None, dataclasses.replace(pc, wait_s=wait_s)

    def cutover(self, pos: Position, pool, pc: PendingCutover) -> CutoverDone:
        """Move to `pc`'s plan (compiled in the background) at a step boundary. Each part is its
        own guard (a failure leaves `pos` as it was: the old state is intact); `pool` is the
        current plan's snapshot pool."""
        target = pc.plan
        new_exe = self.source.ready(target)
        devices = self.rt.devices
        with self.rt.guard("cutover/transfer"):
            t0 = time.perf_counter()
            tinfo: dict = {}
            new_state, log = transition(
                ShardStore.capture(pos.state), new_exe.state_shardings, devices=devices,
                old_layout=pos.exe.layout, new_layout=new_exe.layout,
                plans=self.transitions.cache, info=tinfo, transport=self.rt,
                threads=self.rt.threads,
            )
            self.rt.commit(new_state)
            transfer_s = time.perf_counter() - t0
        if not log.sources() <= set(pos.plan.device_ids):  # invariant: returned devices are empty
            raise AssertionError(f"a cut-over read {log.sources() - set(pos.plan.device_ids)}, "
                                 f"outside {pos.plan.name}")
        with self.rt.guard("cutover/verify"):
            done = protect_moved(self.rt, new_exe, new_state, pos.good, "cut-over",
                                 "the state before it", pool, pos.step, pos.live)
        actual, new_pool, verify_s = done.actual, done.pool, done.verify_s
        growth = pc.kind == "growth"
        mig = CutoverEvent(
            kind=pc.kind,
            step=pos.step,
            failure_step=None if growth else pc.step,
            join_step=pc.step if growth else None,
            from_plan=pos.plan.name,
            to_plan=target.name,
            bytes_moved=log.bytes_moved,
            bytes_cross_process=log.cross_process_bytes,
            transfers=log.transfers,
            transfer_s=transfer_s,
            verify_s=verify_s,
            compile_wait_s=pc.wait_s,
            stall_s=pc.wait_s + transfer_s + verify_s,
            transfer_plan_hit=tinfo["plan_hit"],
            transfer_plan_s=tinfo["plan_s"],
            steps_on_fast_path=pos.step - pc.step,
            time_to_optimal_s=time.perf_counter() - pc.t_start,
            verified=done.compared.verified,
            verify=done.compared.as_dict(),
        )
        if growth:
            mig.joined_devices, mig.n_devices = list(pc.joined), target.n_devices
            mig.from_n_devices, mig.predicted_gain = pos.plan.n_devices, pc.predicted_gain
            mig.sources = sorted(log.sources())
        new = dataclasses.replace(pos, plan=target, exe=new_exe, state=new_state, good=actual)
        # on an interim plan: the best one is compiled next
        nxt = self.pend(pc.after, new) if pc.after is not None else None
        return CutoverDone(new, new_pool, log, mig, nxt)
