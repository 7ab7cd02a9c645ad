"""What a run tells its user at its start and its end (the loop's accounts, apart from the loop).

At the start: the failures before it, a resume's deleted checkpoints, the `start` event (the plan,
the mode, the snapshots and what the standby builds), an unprotected state's warning, and the
printed lines (`announce`). At the end, after the last reads: each failure's cost, the `end`
event (the state digest, what was prepared and what failed), the printed summary and the
`RunSummary` returned to the caller (`conclude`). Neither changes the loop's state
(`loopstate.LoopState`); both only read it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..compilation.source import ExecutableSource
from ..config import Config
from ..observe.events import (
    CutoverEvent,
    Emitter,
    EndEvent,
    FailureBeforeStart,
    FailureCost,
    JoinEvent,
    StartEvent,
    WarningEvent,
)
from ..observe.metrics import RecoveryEvent, failure_costs
from ..observe.report import (
    print_summary,
    shared_cost,
    shared_cost_line,
    standby_cost,
    standby_cost_line,
)
from ..plan.planner import Plan
from ..runtime.base import Runtime
from ..transfer import checksum
from ..transfer.shards import TransferLog
from .loopstate import LoopState
from .start import Started


@dataclasses.dataclass
class RunSummary:
    """What a run did (`elasjax.run` returns it; the files under `out_dir` say the same):

    - `out_dir`: where config.yaml, metrics.jsonl and events.jsonl were written (None: nowhere);
    - `losses`, `eval_losses`: step -> training loss, and held-out loss at the evaluated steps;
    - `recoveries`: one `RecoveryEvent` per recovery (its MTTR phases, rung, plans, bytes);
    - `plans`: every plan the run stood on, in order; `final_plan`: the last one (a `Plan`);
    - `checksums`: the final state's per-leaf checksums (equal across runs = bitwise equal state);
    - `sample_digests`: step -> digest of the dataset indices it used (`elasjax compare` checks
      them against a reference run);
    - `state`: the final train state (`TrainState`: params, optimizer state, step) on the final
      plan's mesh, in its storage layout: how to get the trained parameters back;
    - `migrations`, `growths`, `joins`: the `migration`, `growth` and `join` events
      (`events.CutoverEvent`, `events.JoinEvent`: dataclasses, readable as mappings too);
    - `transfer_logs`: one `TransferLog` per recovery and per cut-over, in order;
    - `notes`: what the run did not do that it was asked or expected to (the `end` event's);
    - `failure_costs`: the time each failure cost until the run was back at pace
      (`events.FailureCost`);
    - `goodput`: the run's goodput and badput by cause, each >= 0, and apart from them the
      time steps faster than their pace gained, `gained_s` (`metrics.failure_costs`: good_s +
      sum of badput - gained_s = wall_s)."""

    out_dir: Path | None
    losses: dict[int, float]
    eval_losses: dict[int, float]
    recoveries: list[RecoveryEvent]
    plans: list[str]
    final_plan: Plan
    checksums: dict[str, str]
    sample_digests: dict[int, str]
    state: Any = None
    migrations: list[CutoverEvent] = dataclasses.field(default_factory=list)
    transfer_logs: list[TransferLog] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    joins: list[JoinEvent] = dataclasses.field(default_factory=list)
    growths: list[CutoverEvent] = dataclasses.field(default_factory=list)
    failure_costs: list[FailureCost] = dataclasses.field(default_factory=list)
    goodput: dict = dataclasses.field(default_factory=dict)

    @property
    def final_loss(self) -> float | None:
        """The last trained step's loss; None when no step was left to train."""
        return self.losses[max(self.losses)] if self.losses else None



class UnprotectedStateWarning(UserWarning):
    """The run opted out of snapshots and its plan holds state that one failure can lose."""


def announce(s: Started, ew: Emitter, cfg: Config, rt: Runtime, *, ckpt_dir, n_params: int,
             optimizer: str, mode: str, standby: dict, standby_line: str,
             faults: Sequence[str], progress: bool) -> None:
    """The start's events and lines: the failures before it, a resume's deleted checkpoints,
    the `start` record (`standby`: its standby part, `faults`: the schedule as specs), an
    unprotected state's warning."""
    pos, pool, plan, step = s.pos, s.pool, s.pos.plan, s.pos.step
    for f in s.failures:
        ew.emit(FailureBeforeStart(sorted(f.devices), f.phase, f.cause, f.report.as_dict()))
    if s.dropped:  # a checkpoint is never deleted without a word
        msg = (f"resumed from checkpoint {step}: deleted the newer checkpoints "
               f"{list(s.dropped)} in {ckpt_dir} (they belong to the timeline "
               "this run abandons; their steps are trained again)")
        ew.emit(WarningEvent("checkpoint.resume_step", msg), f"warning: {msg}")
        if rt.writer:
            warnings.warn(msg, stacklevel=3)
    ew.emit(StartEvent(
        step=step,
        plan=plan.name,
        plan_detail=plan.describe(),
        devices=sorted(pos.live),
        devices_per_host=rt.topology.devices_per_host,
        runtime=rt.kind,
        processes=sorted({rt.process_of(d) for d in pos.live}),
        compile_s=pos.exe.compile_s,
        n_params=n_params,
        optimizer=optimizer,
        deterministic=bool(cfg.deterministic),
        mode=mode,
        snapshot_bytes_per_step=pool.bytes_per_step,
        snapshot={"buddy": pool.cfg.buddy, "host": pool.cfg.host,
                  "copies": pool.cfg.copies, "auto": pool.given.auto,
                  "cost": pool.cost_line(cfg.hardware)},
        standby=standby,
        resumed_from_checkpoint=step if cfg.checkpoint.resume_step is not None else None,
        dropped_newer_checkpoints=list(s.dropped),
        faults=list(faults),
    ))
    if progress:
        print(mode)
        print(pool.cost_line(cfg.hardware))
        print(standby_line)
    risk = pool.risk()
    if risk is not None:
        ew.emit(WarningEvent("snapshot", risk))
        if rt.writer:
            warnings.warn(risk, UnprotectedStateWarning, stacklevel=3)


def conclude(ls: LoopState, ew: Emitter, cfg: Config, rt: Runtime, *, source: ExecutableSource,
             transitions, initial: Plan, run_s: float, out_dir: Path | None,
             progress: bool) -> RunSummary:
    """After the last reads: the failures' costs, the `end` event, the printed summary, the
    `RunSummary` (`transitions`: the `TransitionPlanner`, for what it prepared; `run_s`: the
    run's wall time so far)."""
    T, pos = cfg.train.steps, ls.pos
    sb = source.standby
    notes = ls.end_notes(None if sb is None or not sb.over_budget else (
        f"standby left {sb.over_budget} queued plan(s) unbuilt: the process reached "
        f"standby.map_budget = {cfg.standby.map_budget} of its memory-mapping limit "
        "(vm.max_map_count); recoveries to them compile"))
    costs, goodput = failure_costs(ls.timeline, initial.name, run_s)
    costs = [FailureCost(**c) for c in costs]
    for c in costs:
        ew.emit(c)
    shared = shared_cost(source.shared)
    standby = standby_cost(sb, source.worker, source.warmed_between_steps)
    ew.emit(EndEvent(
        goodput=goodput,
        step=pos.step,
        final_loss=ls.losses.get(T - 1),  # None: resumed at the run's end
        plan=pos.plan.name,
        # digest of every leaf's layout-independent checksum: equal digests = bitwise equal
        # final parameters and optimizer state
        state_digest=checksum.digest(ls.good),
        transfer_plans_prepared=transitions.done,
        transfer_plan_errors=transitions.errors[:5],
        standby_errors=source.errors[:5],
        cutover_pending=ls.cutover is not None,
        standby=standby,
        notes=notes,
        runtime=rt.kind,
        shared_compiles=shared,
        processes=sorted({rt.process_of(d) for d in pos.live}),
    ))
    if standby is not None:
        line = standby_cost_line(standby)
        rt.log(line)
        if progress:
            print(line)
    if shared is not None:
        rt.log(shared_cost_line(shared))
    for note in notes:
        rt.log(note)
    if progress:
        print_summary(ls.recoveries, ls.losses, ls.evals, pos.plan, out_dir, notes,
                      ls.growths, costs, goodput)
    return RunSummary(
        out_dir, ls.losses, ls.evals, ls.recoveries, ls.plans, pos.plan, ls.good,
        ls.digests, pos.state, ls.migrations, ls.transfer_logs, notes, ls.joins,
        ls.growths, costs, goodput,
    )
