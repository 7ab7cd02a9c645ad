"""A recovery's attempts, one rule for the loop (`loop.recovery.Recoverer`) and the pieces
(`elastic.state.ElasticState`): a process that dies during a recovery raises `DeviceFailure` on
every survivor, in the guard of the phase it interrupted; the recovery folds that death into
what is left (more dead devices, fewer surviving shards) and starts another attempt, planned
over the remaining devices, until one succeeds or one cannot be done (which raises by name,
`UnrecoverableStateError`). In one process no failure interrupts a recovery: one attempt.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

from .inprocess import DeviceFailure

T = TypeVar("T")


@dataclasses.dataclass
class Attempts:
    """A recovery's attempts so far: the failures (the first started the recovery, where there
    is one; each later one interrupted an attempt), how many attempts began, and when the last
    one began."""

    failures: list[DeviceFailure]
    count: int = 0
    t_last: float = 0.0

    @property
    def first(self) -> bool:
        return self.count == 1


def until_recovered(failures: list[DeviceFailure], attempt: Callable[[Attempts], T],
                    fold: Callable[[DeviceFailure], None]) -> tuple[T, Attempts]:
    """Run `attempt` until one returns; a `DeviceFailure` it raises is a death during the
    recovery: `fold(f)` takes it into what is left, then the next attempt begins (with `f`
    last in `Attempts.failures`). Returns the successful attempt's result and the account."""
    run = Attempts(list(failures))
    while True:
        run.count += 1
        run.t_last = time.perf_counter()
        try:
            return attempt(run), run
        except DeviceFailure as f:
            run.failures.append(f)
            fold(f)
