"""Prepared for the likely next failures (`Preparations`): their plans built in the background
(the standby: `compilation.source.ExecutableSource`) and their transitions planned with the
snapshot pool's copies as sources (`recovery.TransitionPlanner`), set going at the start and
again after every change of plan; waited for where the config asks (`standby.wait_at_start`,
`standby.wait_after_recovery`), and announced when ready (the `standby_ready` event).

It keeps nothing of the run: the loop gives it the position and pool to prepare for, and keeps
whether a standby is still building in its own state (`LoopState.standby_building`).
"""

from __future__ import annotations

import time

from ..compilation.source import ExecutableSource
from ..config import Config
from ..observe.events import Emitter, StandbyReady
from ..observe.report import standby_line, standby_ready_line
from ..plan.contingencies import Contingencies
from ..runtime.base import Runtime
from ..transfer.snapshot import SnapshotPool
from .recovery import Position, TransitionPlanner


class Preparations:
    """See the module docstring. `on`: the standby is on (`config.standby_on`); `no_worker`: why
    a compile worker cannot build the plans, if it cannot; `progress`: print the lines too."""

    def __init__(self, cfg: Config, rt: Runtime, source: ExecutableSource,
                 contingencies: Contingencies, transitions: TransitionPlanner, *, on: bool,
                 no_worker: str | None, progress: bool):
        self.cfg, self.rt, self.source = cfg, rt, source
        self.contingencies, self.transitions = contingencies, transitions
        self.on, self.no_worker, self.progress = on, no_worker, progress

    def start(self, pos: Position, pool: SnapshotPool) -> tuple[int, int, str]:
        """Set the preparations of the start's position going; returns how many plans the
        standby builds (`standby.max_plans` may leave some out, and warns), how many programs
        they need (`ExecutableSource.programs`) and its start line."""
        plan, live = pos.plan, set(pos.live)
        ahead = self.contingencies.standby_plans(plan, live | set(plan.spare_ids))
        kept = self.source.refresh(plan, ahead) if self.source.standby is not None else ahead
        n_programs = self.source.programs(kept)
        line = standby_line(self.cfg, self.on, self.no_worker, self.source.worker,
                            self.source.shares, len(kept), n_programs)
        self.rt.log(line)
        self.transitions.for_failures(pos, pool)
        return len(kept), n_programs, line

    def protect(self, pos: Position, pool: SnapshotPool) -> None:
        """Prepare for the likely next failures of a new position: their plans built in the
        background and their transitions planned (with `pool`'s snapshots as sources)."""
        self.source.refresh(pos.plan, self.contingencies.standby_plans(pos.plan, set(pos.live)))
        self.transitions.for_failures(pos, pool)

    def wait(self, ew: Emitter, step: int | None) -> float:
        """Block until the standby of the current plan is built and its transitions planned
        (`standby.wait_at_start` before step 0, `step` None; `standby.wait_after_recovery` after
        a recovery's first good step); warm what was built (one process). Logged and written as
        a `standby_ready` event: the training pause it costs is its `wait_s` (after a
        recovery, a pause the failure's time lost counts). Returns the seconds it paused (the
        loop puts a recovery's in its timeline)."""
        t_all = time.perf_counter()
        if self.source.standby is not None:
            compile_s, warm_s = self.source.wait_all(self.cfg.standby.warm)
            head = (f"standby ready in {compile_s + warm_s:.1f}s" if step is None else
                    f"step {step}: training paused {compile_s + warm_s:.1f}s until the standby "
                    "of the new plan was ready")
            self.ready(ew, step, compile_s + warm_s, warm_s, head)
        self.transitions.wait_idle()  # the likely transitions are planned too
        return time.perf_counter() - t_all

    def ready(self, ew: Emitter, step: int | None, wait_s: float, warm_s: float,
              head: str) -> None:
        """The `standby_ready` event and its line: the standby set is built, after `wait_s` of
        paused training (0: built in the background while training went on)."""
        sb = self.source.standby
        ew.emit(StandbyReady(step, sb.compiled + sb.rebound + sb.loaded, sb.compiled, sb.rebound,
                             wait_s, sb.compile_s, sb.rebind_s, warm_s, sb.over_budget,
                             sb.loaded, sb.load_s, self.rt.me))
        line = standby_ready_line(head, sb, wait_s, warm_s, self.cfg.standby.map_budget)
        self.rt.log(line)
        if self.progress:
            print(line)
