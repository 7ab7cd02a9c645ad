"""What the loop tells the world, and the user's hooks.

Every event the loop records goes through one `Emitter`: it is written to `events.jsonl`, its
one-line summary goes to the progress display and the runtime's log, and every hook is called
with it. A hook is any callable taking one argument; it is called, in this process, with

- a `StepInfo` after each step's metrics are read (in step order; a step redone after a
  checkpoint restore comes again, with `redo` true), and
- an `Event` for each record of `events.jsonl` (`start`, `recovery`, `join`, `migration`,
  `growth`, `cutover_abandoned`, `standby_ready`, `failure_cost`, `warning`, `end`): its
  `type`, its fields as written, and its typed record (`StartEvent`, `RecoveryEvent`,
  `JoinEvent`, `CutoverEvent`, ...: dataclasses, each also readable as a mapping of its
  written fields).

Under `elasjax launch` every process calls its own hooks (`StepInfo.process`; events are those
its process writes or would write). A hook that raises stops the run with that error; under
`elasjax launch` it stops its own process, which the others survive as any other death.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from ..config import ConfigError


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
    """One record of `events.jsonl`, as a hook gets it: `type`, the `fields` as written (`type`
    included) and the typed `record` (e.g. a `RecoveryEvent` for `recovery`)."""

    type: str
    fields: dict
    record: Any = None


Hook = Callable[[Any], None]

# field metadata: left out of the written record when None / merged into it (a dict)
OMIT_NONE = {"omit_none": True}
FLATTEN = {"flatten": True}


class Record(Mapping):
    """Base of the loop's typed events: a dataclass whose fields are what `events.jsonl` records
    (`to_json`), also readable as a mapping of those fields (`ev["step"]`)."""

    type: ClassVar[str] = ""

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.metadata.get("flatten"):
                out.update(v)
            elif not (v is None and f.metadata.get("omit_none")) and not f.metadata.get("hidden"):
                out[f.name] = v
        return out

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


@dataclasses.dataclass(eq=False)
class StartEvent(Record):
    """The run started (or resumed from a checkpoint) on `plan`."""

    type: ClassVar[str] = "start"
    step: int
    plan: str
    plan_detail: dict
    devices: list[int]
    devices_per_host: int
    runtime: str
    processes: list[int]
    compile_s: float
    n_params: int
    optimizer: str  # "builtin adamw", "MODULE:ATTR" (train.optimizer), or the object passed
    deterministic: bool  # the mode in force (`Config.deterministic`; "auto": decided by it)
    mode: str  # which mode, and why where the default decided it (`config.mode_line`)
    snapshot_bytes_per_step: int
    snapshot: dict  # the snapshot copies taken: {"buddy", "host", "copies", "auto", "cost"}
    # the standby: {"on", "enabled" (as configured), "plans" (submitted at the start),
    # "programs" (what those plans need built: one per program where a program is loaded for
    # the other device sets of its shape), "compiler" ("process", "thread", or null when off)}
    standby: dict
    resumed_from_checkpoint: int | None
    dropped_newer_checkpoints: list[int]
    faults: list[str]


@dataclasses.dataclass(eq=False)
class FailureBeforeStart(Record):
    """Devices failed while the run started; it started on the survivors."""

    type: ClassVar[str] = "failure_before_start"
    devices: list[int]
    phase: str
    cause: str
    detail: dict = dataclasses.field(default_factory=dict, metadata=FLATTEN)


@dataclasses.dataclass(eq=False)
class WarningEvent(Record):
    """Something about the run's settings a user should know (`field`: the config field)."""

    type: ClassVar[str] = "warning"
    field: str
    message: str


@dataclasses.dataclass(eq=False)
class StandbyReady(Record):
    """The standby set was built: while training waited (`standby.wait_at_start`: `step` None;
    after a recovery with `standby.wait_after_recovery`: the step it paused at, for `wait_s`),
    or in the background while training went on (`wait_s` 0: the step at which it was seen
    built). `unbuilt`: queued plans dropped without being built because the process reached
    `standby.map_budget` of its memory-mapping limit (a recovery to them compiles)."""

    type: ClassVar[str] = "standby_ready"
    step: int | None
    plans: int
    compiled: int
    rebound: int
    wait_s: float
    compile_s: float
    rebind_s: float
    warm_s: float
    unbuilt: int = 0
    # plans loaded from a compile elsewhere: another process's (`standby.share_compiles`, under
    # launch; the seconds are then mostly the wait for it) or an earlier run's
    # (`standby.programs_dir`)
    loaded: int = 0
    load_s: float = 0.0
    # whose standby: under launch each process builds or loads its own and sees it built at a
    # step of its own, so the file holds the one of the process writing it at the time
    # (`LOCAL_TYPES`); after a writer's death its successor writes its own
    process: int = 0


@dataclasses.dataclass(eq=False)
class JoinEvent(Record):
    """Devices returned at the boundary before `step`; `grow`: the planner's best plan over the
    bigger set (`best_plan`) is worth moving to (a pending cut-over), else they stay spare."""

    type: ClassVar[str] = "join"
    step: int
    devices: list[int]
    spec: str
    n_live: int
    plan: str
    best_plan: str
    predicted_step_s: float
    best_predicted_step_s: float
    predicted_gain: float
    grow: bool
    reason: str
    replaces_pending: str | None = None  # a pending cut-over's plan this growth replaces
    plan_s: float = 0.0
    # a plan the run stood on before, compiled, cut over to at once before the best one
    interim_plan: str | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    # restarted processes admitted under launch (`admission`): processes, the new client's
    # generation, and the seconds of the admission, the shipping of executables and the move of
    # the state onto the new client
    rejoined: dict | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    # an admission: the comparison the state moved onto the new client passed (as a `recovery`'s
    # `verify`: {"leaves", "bytes", "digest_before", "digest_after"})
    verify: dict | None = dataclasses.field(default=None, metadata=OMIT_NONE)


@dataclasses.dataclass(eq=False)
class CutoverEvent(Record):
    """A cut-over at a step boundary: to the optimal plan after an async recovery
    (`kind` "migration", written as type `migration`) or to a bigger plan after devices
    returned ("growth"). `stall_s`: the training time it took."""

    kind: str = dataclasses.field(metadata={"hidden": True})
    step: int
    from_plan: str
    to_plan: str
    bytes_moved: int
    bytes_cross_process: int
    transfers: int
    transfer_s: float
    verify_s: float
    compile_wait_s: float  # waited for the plan's compile (`recovery.max_fast_path_steps`)
    stall_s: float
    transfer_plan_hit: bool
    transfer_plan_s: float
    steps_on_fast_path: int
    time_to_optimal_s: float
    # read off `verify`: leaves > 0 and digest_before == digest_after
    verified: bool
    # the comparison the moved state passed (`transfer.verified.Comparison`): {"leaves" (leaf
    # checksums compared), "bytes" (the state's bytes they cover), "digest_before" (digest of
    # the state's checksums before the cut-over), "digest_after" (of the moved state's)}
    verify: dict
    failure_step: int | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    # growth only
    join_step: int | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    joined_devices: list[int] | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    n_devices: int | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    from_n_devices: int | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    predicted_gain: float | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    sources: list[int] | None = dataclasses.field(default=None, metadata=OMIT_NONE)

    @property
    def type(self) -> str:  # type: ignore[override]
        return self.kind


@dataclasses.dataclass(eq=False)
class CutoverAbandoned(Record):
    """A pending cut-over's background compile failed (`errors`: process -> message): the run
    stays on its plan."""

    type: ClassVar[str] = "cutover_abandoned"
    kind: str
    step: int
    optimal_plan: str
    errors: dict
    stays_on: str


@dataclasses.dataclass(eq=False)
class FailureCost(Record):
    """The time one failure cost until the run was back at pace (`metrics.failure_costs`)."""

    type: ClassVar[str] = "failure_cost"
    step: int
    failed_devices: list[int]
    to_plan: str
    first_step_first_run: bool
    target_plan: str
    phases_s: float
    slow_steps_s: float
    fast_path_s: float
    pauses_s: float
    redone_s: float
    steps_to_pace: int
    time_lost_s: float
    first_step_x: float | None
    first_step_why: str | None = dataclasses.field(default=None, metadata=OMIT_NONE)
    note: str | None = dataclasses.field(default=None, metadata=OMIT_NONE)


@dataclasses.dataclass(eq=False)
class EndEvent(Record):
    """The run ended: its last step, final loss and plan, the final state's digest (equal
    digests: bitwise equal parameters and optimizer state), goodput, and `notes` on what it
    did not do that it was asked or expected to."""

    type: ClassVar[str] = "end"
    goodput: dict
    step: int
    final_loss: float | None  # None: no step was left to train (a resume from the last step)
    plan: str
    state_digest: str
    transfer_plans_prepared: int
    transfer_plan_errors: list[str]
    standby_errors: list[str]
    cutover_pending: bool
    # what the background builds cost: {"compiled", "rebound", "loaded" (compiled by another
    # process or an earlier run), "compile_s" (wall seconds of the
    # builds), "worker_cpu_s" (the compile worker process's CPU seconds; null where builds ran on
    # a thread of the training process, whose CPU time is not told apart; the compiles it
    # finished), "worker_paced_s" (seconds `standby.worker_share` held the worker stopped;
    # null without a worker), "warmed" (executables built in the background and run once on zeros between
    # steps, `standby.warm`)}; null: nothing was built in the background
    standby: dict | None
    notes: list[str]
    runtime: str
    # the writer's programs compiled once per job (`standby.share_compiles`, under launch):
    # {"published" (compiled here, loaded by the others), "loaded" (compiled by another
    # process), "compiled_alone" (could not be shared), "waited_s"}; null in one process
    shared_compiles: dict | None
    processes: list[int]


@dataclasses.dataclass(eq=False)
class ErrorEvent(Record):
    """The run stopped with an error (written to the events file only: the error reaches the
    caller, and a hook may be what raised it)."""

    type: ClassVar[str] = "error"
    error: str
    message: str
    process: int


# Records one process alone emits, at a time of its own (`metrics.JsonlWriter`'s `local_types`):
# its standby seen built, its own error (a hook that raised in it alone). Only the process
# writing the file at the time writes one.
LOCAL_TYPES = frozenset({StandbyReady.type, ErrorEvent.type})


class Emitter:
    """The one way out for the loop's events: the events file, the display, the log, hooks."""

    def __init__(self, writer, display=None, log: Callable[[str], None] | None = None,
                 hooks: Sequence[Hook] = (), process: int = 0):
        self.writer, self.display, self._log = writer, display, log
        self.hooks, self.process = list(hooks), process

    def emit(self, record, line: str | None = None) -> None:
        """Write `record` (a typed event: `type`, `to_json()`), show and log `line`, call the
        hooks."""
        fields = record.to_json()
        if self.writer is not None:
            self.writer.write(fields)
        if line is not None:
            if self.display is not None:
                self.display.log(line)
            if self._log is not None:
                self._log(line)
        if self.hooks:
            ev = Event(record.type, fields, record)
            for h in self.hooks:
                h(ev)

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
