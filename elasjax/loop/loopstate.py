"""What the training loop threads from step to step (`LoopState`), and the message that hands it
to a restarted process that rejoins the job (`LoopPackage`).

The loop (`Trainer._run`) is the one writer of its `LoopState`: where training stands (a
`recovery.Position` with its last verified checksums), the current plan's snapshot pool, the
pending cut-over, the fault events still to fire, and the run's record (losses, events, the
timeline the failures' cost is read from). Collaborators (`Recoverer`, `Cutovers`, `Admissions`)
are given what they need of it and return what they did. A live process produces the rejoin
message from it (`LoopState.package`) and a newcomer consumes it (`LoopState.arrived`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from ..observe.events import CutoverAbandoned, CutoverEvent, JoinEvent
from ..observe.metrics import RecoveryEvent, Timeline
from ..plan.planner import Plan
from ..transfer.shards import TransferLog
from .recovery import PendingCutover, Position


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the loop has seen and written so far: a newcomer may become the writer later, and its
    files and `end` event then go on from here."""

    losses: dict
    evals: dict
    digests: dict
    timeline: Any
    recoveries: list
    joins: list
    growths: list
    migrations: list
    lines: tuple[int, int]  # lines written to metrics.jsonl and events.jsonl
    run_s: float
    loop_s: float


@dataclasses.dataclass(frozen=True)
class LoopPackage:
    """The rejoin message: what a newcomer needs of the loop at the admission's boundary
    (`LoopState.package`; pickled with the runtime's counters, `membership.Admission`)."""

    step: int
    plan: Any
    good: dict  # the state's last verified checksums
    live: tuple[int, ...]
    lost_hosts: tuple[int, ...]
    kept: Any
    pending: list  # fault events still to fire
    plans: list[str]  # every plan the run stood on
    stood_on: list  # the first plan of each program the run stood on (`LoopState.stood_on`)
    redo_until: int
    seen: Seen
    ckpt_generation: int = 0  # the generation of the checkpoints' barriers (`Checkpointer`)


@dataclasses.dataclass
class LoopState:
    """What the loop threads from step to step (see the module docstring)."""

    pos: Position
    pending: list  # scheduled fault events not fired yet (`faults.FaultEvent`)
    plans: list[str] = dataclasses.field(default_factory=list)  # every plan stood on, in order
    # compile key -> the first plan of that program the run stood on (its executables were
    # compiled then: `Cutovers._interim` cuts over to one without a compile)
    stood_on: dict[Any, Plan] = dataclasses.field(default_factory=dict)
    pool: Any = None  # the current plan's snapshot pool (`transfer.snapshot.SnapshotPool`)
    # the cut-over pending at a later step boundary (`Cutovers`), None when there is none
    cutover: PendingCutover | None = None
    abandoned: list[CutoverAbandoned] = dataclasses.field(default_factory=list)
    migrations: list[CutoverEvent] = dataclasses.field(default_factory=list)
    growths: list[CutoverEvent] = dataclasses.field(default_factory=list)
    joins: list[JoinEvent] = dataclasses.field(default_factory=list)
    recoveries: list[RecoveryEvent] = dataclasses.field(default_factory=list)
    open_event: RecoveryEvent | None = None  # a recovery whose first good step is not read yet
    recovered_at: float = 0.0  # when the open recovery resumed (its first step counts from here)
    redo_until: int = -1  # steps up to this one run again (after a checkpoint restore)
    # the standby and the prepared transitions follow the plan after the next good step (after
    # a recovery or a join; not sooner: their compiles would compete with that step)
    protect_due: bool = False
    # the standby set of the current plan is building in the background and not yet announced
    # as built (`Trainer._after_step`)
    standby_building: bool = False
    # the checksums of the newest step read: `pos.state`'s once no step is in flight
    good: dict[str, str] | None = None
    # dispatched steps whose metrics are not read yet (`stepping.Stepper.read`), oldest first
    inflight: collections.deque = dataclasses.field(default_factory=collections.deque)
    # what the loop has read: each step's loss, held-out loss and sample digest
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    evals: dict[int, float] = dataclasses.field(default_factory=dict)
    digests: dict[int, str] = dataclasses.field(default_factory=dict)
    # the run's steps, pauses and recoveries, for the failures' whole cost (`failure_costs`)
    timeline: Timeline = dataclasses.field(default_factory=Timeline)
    transfer_logs: list[TransferLog] = dataclasses.field(default_factory=list)
    recovery_at: int | None = None  # where the open recovery goes in the timeline
    t_done: float = 0.0  # when the newest step read had run
    t_first_done: float = 0.0  # ... and the first one
    seq: int = 0  # steps given to the step clock (`metrics.StepClock`)

    @property
    def loop_s(self) -> float:
        """Wall time from the first step's completion to the last one's, as the host saw them."""
        return self.t_done - self.t_first_done

    def stand_on(self, plan: Plan) -> None:
        """The run stands on `plan` now (start, recovery, cut-over)."""
        self.plans.append(plan.name)
        self.stood_on.setdefault(plan.compile_key, plan)

    def verified(self) -> Position:
        """`pos` with its state's checksums, for a move that verifies against them (a
        recovery, a cut-over, an admission): every step in flight must have been read."""
        if self.inflight:
            raise AssertionError(f"{len(self.inflight)} steps still in flight: read them first")
        return dataclasses.replace(self.pos, good=self.good)

    def end_notes(self, standby: str | None = None) -> list[str]:
        """What the run did not do that it was asked or expected to (the `end` event's notes):
        abandoned cut-overs, cut-over and admission faults that never fired, the `standby`'s note if any, a
        cut-over still pending at the end."""
        notes = [
            f"the cut-over to {a.optimal_plan} was abandoned at step {a.step}: its "
            f"background compile failed ({next(iter(a.errors.values()))[:200]}); the run "
            f"stayed on {'its plan' if a.kind == 'growth' else 'its fast path'}"
            for a in self.abandoned
        ]
        notes += [
            f"the fault '{e.spec}' (phase cutover, from step {e.at_step}) never fired: the run "
            "did not cut over at or after that step"
            for e in self.pending if e.phase == "cutover"
        ]
        notes += [
            f"the fault '{e.spec}' (phase admission, from step {e.at_step}) never fired: no "
            "restarted process was admitted at or after that step"
            for e in self.pending if e.phase == "admission"
        ]
        notes += [standby] if standby is not None else []
        if self.cutover is not None:
            pc = self.cutover
            since = "the join" if pc.kind == "growth" else "the failure"
            notes.append(
                f"the run ended on {self.pos.plan.name}: the "
                f"{'bigger' if pc.kind == 'growth' else 'optimal'} plan {pc.plan.name} (pending "
                f"since {since} at step {pc.step}) was not ready on every process before the "
                "last step"
            )
        return notes

    def package(self, lines: tuple[int, int], run_s: float) -> LoopPackage:
        """The rejoin message at this boundary; `lines`: the lines written so far to
        metrics.jsonl and events.jsonl, `run_s`: the run's time so far."""
        pos = self.pos
        seen = Seen(
            losses=self.losses, evals=self.evals, digests=self.digests, timeline=self.timeline,
            recoveries=self.recoveries, joins=self.joins, growths=self.growths,
            migrations=self.migrations, lines=lines, run_s=run_s, loop_s=self.loop_s,
        )
        return LoopPackage(
            step=pos.step, plan=pos.plan, good=self.good, live=tuple(sorted(pos.live)),
            lost_hosts=tuple(sorted(pos.lost_hosts)), kept=pos.kept, pending=list(self.pending),
            plans=list(self.plans), stood_on=list(self.stood_on.values()),
            redo_until=self.redo_until, seen=seen,
        )

    @classmethod
    def arrived(cls, pkg: LoopPackage, pool, now: float) -> "LoopState":
        """A newcomer's loop state from the rejoin message (its position's executables and
        state come with the admission's `ship`), with a fresh snapshot `pool`; `now`: when it
        arrived (the loop's clock goes on from the package's)."""
        pos = Position(pkg.step, pkg.plan, None, None, pkg.good, frozenset(pkg.live),
                       frozenset(pkg.lost_hosts), pkg.kept)
        seen = pkg.seen
        return cls(
            pos, pkg.pending, list(pkg.plans), {p.compile_key: p for p in pkg.stood_on},
            pool=pool, redo_until=pkg.redo_until, good=pkg.good, losses=seen.losses,
            evals=seen.evals, digests=seen.digests, timeline=seen.timeline,
            recoveries=seen.recoveries, joins=seen.joins, growths=seen.growths,
            migrations=seen.migrations, t_done=now, t_first_done=now - seen.loop_s,
        )
