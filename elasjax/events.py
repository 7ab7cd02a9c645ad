"""What the loop tells the world, and the user's hooks.

Every event the loop records goes through one `Emitter`: it is written to `events.jsonl`, its
one-line summary goes to the progress display and the runtime's log, and every hook is called
with it. A hook is any callable taking one argument; it is called, in this process, with

- a `StepInfo` after each step's metrics are read (in step order; a step redone after a
  checkpoint restore comes again, with `redo` true), and
- an `Event` for each record of `events.jsonl` (`start`, `recovery`, `join`, `migration`,
  `growth`, `cutover_abandoned`, `standby_ready`, `failure_cost`, `end`): its `type`, its
  fields as written, and the typed record where the loop has one (`RecoveryEvent`).

Under `elasjax launch` every process calls its own hooks (`StepInfo.process`; events are those
its process writes or would write). A hook that raises stops the run with that error.

    def count(x):
        if isinstance(x, elasjax.StepInfo):
            ...
    elasjax.run(cfg, hooks=[count])          # or: elasjax train CFG --hook mymodule:count
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .config import ConfigError


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One step, as its `metrics.jsonl` row says (`step` counts from 0)."""

    step: int
    loss: float
    plan: str
    n_devices: int
    step_time_s: float
    grad_norm: float
    eval_loss: float | None
    redo: bool
    process: int


@dataclasses.dataclass(frozen=True)
class Event:
    """One record of `events.jsonl`: `type`, the `fields` as written (`type` included) and the
    typed record where there is one (a `RecoveryEvent` for `recovery`)."""

    type: str
    fields: dict
    record: Any = None


Hook = Callable[[Any], None]


class Emitter:
    """The one way out for the loop's events: the events file, the display, the log, hooks."""

    def __init__(self, writer, display=None, log: Callable[[str], None] | None = None,
                 hooks: Sequence[Hook] = (), process: int = 0):
        self.writer, self.display, self._log = writer, display, log
        self.hooks, self.process = list(hooks), process

    def event(self, fields: dict, line: str | None = None, record: Any = None) -> None:
        """Write `fields` (a dict with `type`), show and log `line`, call the hooks."""
        if self.writer is not None:
            self.writer.write(fields)
        if line is not None:
            if self.display is not None:
                self.display.log(line)
            if self._log is not None:
                self._log(line)
        if self.hooks:
            ev = Event(fields["type"], fields, record)
            for h in self.hooks:
                h(ev)

    def write(self, fields: dict) -> None:
        """An event with no line for the display (the writer's interface)."""
        self.event(fields)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def step(self, row: dict) -> None:
        """Call the hooks with the `StepInfo` of a `metrics.jsonl` row."""
        if not self.hooks:
            return
        info = StepInfo(
            row["step"], row["loss"], row["plan"], row["n_devices"], row["step_time_s"],
            row["grad_norm"], row.get("eval_loss"), bool(row.get("redo", False)), self.process,
        )
        for h in self.hooks:
            h(info)


def load_hooks(specs: Sequence[str]) -> list[Hook]:
    """`MODULE:FUNCTION` names (`--hook`) -> the callables. The module is imported as with
    `--import` (on `sys.path`; the current directory is on it for `python -m`)."""
    out = []
    for spec in specs:
        mod, sep, name = spec.partition(":")
        if not sep or not mod or not name:
            raise ConfigError(f"--hook {spec!r}: expected MODULE:FUNCTION, e.g. mymodule:on_event")
        try:
            fn = getattr(import_user_module(mod, "--hook"), name)
        except AttributeError:
            raise ConfigError(f"--hook {spec}: module {mod!r} has no {name!r}") from None
        if not callable(fn):
            raise ConfigError(f"--hook {spec}: {mod}.{name} is not callable")
        out.append(fn)
    return out


def import_user_module(name: str, flag: str = "--import"):
    """Import a user's module named on the command line (`--import`, `--hook`), looking in the
    current directory first, as `python -m` does (the `elasjax` command's own directory is on
    `sys.path`, the user's is not). An error says where it looked."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(
            f"{flag} {name}: {e} (looked in the current directory {cwd} and on sys.path; set "
            "PYTHONPATH to the module's directory, or run from it)"
        ) from None
