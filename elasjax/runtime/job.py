"""The job a user's script runs in under `elasjax launch SCRIPT.py` (`launch.script`): this
process's runtime and the kills scheduled for it, which `ElasticState` takes up when it is made.

The worker that runs the script sets it before the script starts (`set_current`), so the script
needs no start-up call of its own: run alone it is a one-process program, under launch a process
of the job. The commits are counted here (`committed`), so that the worker can refuse, after the
script returned, a `--kill` step the script never committed and a script that never committed.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class ScriptJob:
    """This process's part of a launched script's job.

    Attributes:
      runtime: the `MultiControllerRuntime` every `ElasticState` of the script runs on.
      kills: step -> phase -> processes (`--kill`): phase "step", right after dispatching that
        step's commit; "recovery/plan", "recovery/transfer", "recovery/verify" as that phase of
        the recovery the step's kill started begins; "recovery/first_step" right after the
        redone step's commit is dispatched; "admission" as the first admission at the start of
        a step from that one on moves the state (`kill_at_admission`).
      last_commit: the last step committed in this process (None: none yet).
      states: `ElasticState`s made so far (one engine per runtime: a second one is refused).
    """

    runtime: Any
    kills: dict[int, dict[str, tuple[int, ...]]]
    last_commit: int | None = None
    states: int = 0

    def committed(self, step: int) -> None:
        self.last_commit = step if self.last_commit is None else max(self.last_commit, step)

    def unmet_kills(self) -> list[tuple[int, tuple[int, ...]]]:
        """The scheduled kills (after a step's dispatch) whose step the script never
        committed."""
        last = -1 if self.last_commit is None else self.last_commit
        return sorted((s, ph["step"]) for s, ph in self.kills.items()
                      if s > last and "step" in ph)

    def unmet_admission_kills(self, rt) -> list[int]:
        """The steps of `--kill S:PROCESS:admission` entries naming this process that never
        fired: no restarted process was admitted from S on while it lived (the restart came
        too late, or none was made). Only the process the job started with can tell: it is the
        one such a kill would have ended."""
        if rt.admission is not None:
            return []
        return sorted(s for s, ph in self.kills.items() if rt.me in ph.get("admission", ()))

    def kill(self, rt, step: int, phase: str, point: str) -> None:
        """SIGKILL this process if `--kill` scheduled it at `step` in `phase` (`rt.inject` at
        `point`: "after_dispatch", "plan", "transfer", "verify")."""
        from .faults import FaultEvent

        if rt.me in self.kills.get(step, {}).get(phase, ()):
            tail = "" if phase == "step" else ":" + phase.split("/", 1)[1]
            rt.inject([FaultEvent(step, (), "process", f"--kill {step}:{rt.me}{tail}",
                                  phase=phase, hosts=(rt.me,))], point)

    def kill_at_admission(self, rt, step: int) -> None:
        """SIGKILL this process if `--kill S:PROCESS:admission` names it with S <= `step` (the
        step at whose start restarted processes are admitted), as the state's move begins. Only
        the process the job started with: a restarted one (`rt.admission`) never takes it, so
        a restart of the victim, or the victim's id restarted earlier, is not killed again."""
        from .faults import FaultEvent

        if rt.admission is not None:
            return
        for s, phases in sorted(self.kills.items()):
            if s <= step and rt.me in phases.get("admission", ()):
                rt.inject([FaultEvent(step, (), "process", f"--kill {s}:{rt.me}:admission",
                                      phase="admission", hosts=(rt.me,))], "admission")


_current: ScriptJob | None = None


def set_current(job: ScriptJob | None) -> None:
    global _current
    _current = job


def current() -> ScriptJob | None:
    """The launched script's job in this process, or None (not under `elasjax launch SCRIPT`)."""
    return _current
