"""Supervision of a local `elasjax launch` (`--max-restarts N`, `--restart-backoff S`).

When a launched job cannot continue (the coordination process, which hosts JAX's coordination
service, is lost; the survivors stop with `UnrecoverableStateError`; any other error that ends
every process), the launcher reaps every process and starts the whole job again as a new job: a fresh
coordinator port, so a fresh coordination service and fresh gloo rendezvous keys, with every
process resuming from the newest committed checkpoint of `checkpoint.dir`
(`checkpoint.resume_step: -1`). Restarts are bounded by the budget, spaced by a doubling
backoff, said on the console and recorded, one JSON line each, in `supervisor.jsonl`.

Why a whole new job: without the coordination service, or with state no snapshot covers, there
is no running job a replacement could rejoin (a single dead worker is restarted in place and
rejoins instead: `--worker-restarts N`, `elasjax.loop.admission`). Checkpoint resume is the one path
by which every process enters the same state at the same step.

This module holds the launcher-side rules, pure and testable without processes: the policy and
its checks, which checkpoint a restart resumes from (read from the directory names Orbax commits,
so the launcher needs no JAX backend), which fault-schedule entries the restarted job keeps (an
entry that fired does not fire again), and the record. `launcher.launch_local` runs the attempts.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..config import Config, ConfigError, FaultConfig, to_dict
from ..observe.metrics import read_jsonl

SUPERVISOR_LOG = "supervisor.jsonl"

# Outcomes of one attempt (`launcher._monitor`) after which the job cannot go on by itself.
RESTARTABLE = ("coordinator_lost", "failed")

# A worker's exit code for a config or usage error (`launch.main`): the same config fails the
# same way again, so restarting it only spends the budget.
USAGE_ERROR = 2


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """`max_restarts`: how many times the whole job may be started again (0: never, the launch
    ends with the job as without supervision). `backoff_s`: the wait before the first restart,
    doubled before each next one (a cause that persists, e.g. a host that keeps crashing, is not
    hammered)."""

    max_restarts: int = 0
    backoff_s: float = 2.0

    def __post_init__(self):
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(
                f"--max-restarts {self.max_restarts!r}: allowed values: an integer >= 0 "
                "(0: no restart)"
            )
        if not self.backoff_s >= 0:  # also refuses NaN
            raise ConfigError(
                f"--restart-backoff {self.backoff_s!r}: allowed values: seconds >= 0 (the wait "
                "before the first restart, doubled before each next one)"
            )

    @property
    def enabled(self) -> bool:
        return self.max_restarts > 0

    def delay(self, restart: int) -> float:
        """Seconds to wait before restart number `restart` (1-based)."""
        return self.backoff_s * 2 ** (restart - 1)


def check_supervisable(cfg: Config, policy: RestartPolicy) -> None:
    """Refuse, before any process starts, a supervised launch that could not resume: no
    `checkpoint.dir`, or one already holding checkpoints of another run while the job starts
    from step 0 (a restart would resume from those)."""
    if not policy.enabled:
        return
    ck = cfg.checkpoint
    if ck.dir is None:
        raise ConfigError(
            f"--max-restarts {policy.max_restarts} restarts the job from its newest checkpoint, "
            "and config 'checkpoint.dir' is not set: set checkpoint.dir (and checkpoint.every, "
            "the steps between checkpoints), or leave --max-restarts at 0"
        )
    old = committed_checkpoints(ck.dir)
    if old and ck.resume_step is None:
        raise ConfigError(
            f"config 'checkpoint.dir' = {ck.dir} already holds checkpoints (steps {old}) while "
            f"the job starts from step 0; under --max-restarts {policy.max_restarts} a restart "
            "would resume from them: empty the directory, use another one, or resume from them "
            "(--set checkpoint.resume_step=-1)"
        )


def check_out(out: Path, policy: RestartPolicy) -> None:
    """Refuse an output directory that holds an earlier supervised launch's attempt
    directories: this launch's attempts go there, and nothing is overwritten."""
    if not policy.enabled or not out.is_dir():
        return
    old = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name.startswith("attempt"))
    if old:
        raise ConfigError(
            f"--out {out} holds {', '.join(old)} of an earlier supervised launch, where this "
            "launch would set its ended attempts aside: use another --out, or move them away"
        )


COMMIT_MARKER = "commit_success.txt"


def committed_checkpoints(directory: str | Path) -> list[int]:
    """The steps of the checkpoints committed in `directory`, ascending: a directory named by
    the bare step number holding Orbax's commit marker. Orbax writes a step into a temporary
    directory, writes the marker when every process has written its part, then renames it to
    the step number (on a file system without atomic rename the marker alone says it), so a
    save that a death interrupted is never listed."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir()
                  if p.is_dir() and p.name.isdigit() and (p / COMMIT_MARKER).is_file())


def newest_checkpoint(directory: str | Path) -> int | None:
    steps = committed_checkpoints(directory)
    return steps[-1] if steps else None


def reached_step(metrics: Path, fired_kill_steps: Iterable[int] = ()) -> int:
    """The step the ended job had reached: the first step with no logged metrics row, or a
    scheduled kill's step where the launcher saw that kill happen (a kill fires after its step
    was dispatched, before its row is logged)."""
    rows = read_jsonl(metrics) if metrics.exists() else []
    logged = max((int(r["step"]) + 1 for r in rows if "step" in r), default=0)
    return max([logged, *fired_kill_steps])


def _is_failure(f: FaultConfig) -> bool:
    return f.kill_process >= 0 or bool(f.hosts)


def _processes(f: FaultConfig) -> set[int]:
    return {f.kill_process} if f.kill_process >= 0 else set(f.hosts)


def describe_fault(f: FaultConfig) -> str:
    if f.stall_process >= 0:
        what = f"stall process {f.stall_process} for {f.stall_s:g}s"
    elif _is_failure(f):
        what = "kill process " + ", ".join(str(p) for p in sorted(_processes(f)))
    else:
        what = "fault"
    return f"step {f.at_step}: {what}" + (f" (phase {f.phase})" if f.phase != "step" else "")


def remaining_faults(
    faults: Sequence[FaultConfig], reached: int, killed: set[int]
) -> tuple[tuple[FaultConfig, ...], tuple[tuple[FaultConfig, str], ...]]:
    """Split the ended job's fault schedule into the entries the restarted job keeps and the
    ones it drops, each with why. An entry fired if its step is before `reached` (the job went
    past it), or if it kills a process in `killed` (the launcher saw it die as scheduled). A
    fired entry does not fire again: the restart resumes from a checkpoint at or before the
    failure and redoes those steps, and a kill that fired once is one failure, not one per
    attempt. A `phase: recovery` entry whose step's failure is dropped goes too (it needs a
    failure at its step to act in), and a `phase: admission` entry with no process kill left at
    or before its step (it needs a restarted process to admit)."""
    kept: list[FaultConfig] = []
    dropped: list[tuple[FaultConfig, str]] = []
    for f in faults:
        if f.at_step < reached:
            dropped.append((f, f"fired: the job went past step {f.at_step} before it ended"))
        elif _is_failure(f) and _processes(f) <= killed:
            dropped.append((f, "fired: the launcher saw the process killed as scheduled"))
        else:
            kept.append(f)
    steps_with_failure = {f.at_step for f in kept if _is_failure(f) and f.phase == "step"}
    out: list[FaultConfig] = []
    for f in kept:
        if f.phase.startswith("recovery") and f.at_step not in steps_with_failure:
            dropped.append((f, f"the failure at step {f.at_step} that its recovery needs fired"))
        elif f.phase == "admission" and not any(
                g.kill_process >= 0 and g.phase == "step" and g.at_step <= f.at_step for g in kept):
            dropped.append((f, f"no process is killed at or before step {f.at_step} any more: "
                            "nobody restarts to be admitted"))
        else:
            out.append(f)
    return tuple(out), tuple(dropped)


def faults_override(faults: Sequence[FaultConfig]) -> str:
    """The `--set` override that gives a worker exactly `faults` as its schedule."""
    return "faults=" + json.dumps([to_dict(f) for f in faults])


def stop_reason(
    outcome: str, returncode: int | None, restarts_done: int, policy: RestartPolicy
) -> str | None:
    """Why the job is not restarted after an attempt that ended with `outcome` (`returncode`:
    `USAGE_ERROR` when a worker exited with it); None: restart."""
    if outcome == "finished":
        return "the job finished"
    if outcome == "timeout":
        return "the launch timeout (--timeout) ran out; it bounds all attempts together"
    if outcome not in RESTARTABLE:
        return f"the attempt ended with {outcome}"
    if returncode == USAGE_ERROR:
        return (
            f"a process exited with code {USAGE_ERROR} (a config or usage error): a restart "
            "would fail the same way"
        )
    if restarts_done >= policy.max_restarts:
        return (
            f"the restart budget is spent ({restarts_done} of --max-restarts "
            f"{policy.max_restarts} used)"
        )
    return None


class SupervisorLog:
    """`supervisor.jsonl` in the launch's output directory: one line per restart (`restart`),
    one per attempt that was not restarted (`stop`), and the launch's end (`end`)."""

    def __init__(self, out: Path, t_start: float):
        self.path = out / SUPERVISOR_LOG
        self.t_start = t_start
        self.records: list[dict] = []
        self.path.write_text("")

    def write(self, kind: str, **fields) -> dict:
        now = time.time()
        rec = {
            "type": kind,
            **fields,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "elapsed_s": round(now - self.t_start, 3),
        }
        self.records.append(rec)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    @property
    def restarts(self) -> list[dict]:
        return [r for r in self.records if r["type"] == "restart"]


def set_aside(out: Path, attempt: int) -> Path:
    """Move the ended attempt's files (metrics, events, config, worker logs, pids) into
    `out/attempt<attempt>/`, so the next attempt's writers, which truncate, lose nothing.
    Directories stay where they are (a checkpoint directory may live under `out`)."""
    dest = out / f"attempt{attempt}"
    dest.mkdir(exist_ok=False)
    for p in sorted(out.iterdir()):
        if p.is_file() and p.name != SUPERVISOR_LOG:
            shutil.move(str(p), dest / p.name)
    return dest


@dataclasses.dataclass(frozen=True)
class Restart:
    """What the next attempt runs (`overrides`), its `supervisor.jsonl` record and its line."""

    overrides: tuple[str, ...]
    record: dict
    line: str


def plan_restart(
    out: Path,
    attempt: int,
    outcome: str,
    message: str,
    faults: Sequence[FaultConfig],
    killed: set[int],
    kill_steps: dict[int, int],
    checkpoint_dir: str | Path,
    overrides: Sequence[str],
    restart: int,
    policy: RestartPolicy,
) -> Restart:
    """Restart number `restart` after attempt `attempt` ended with `outcome`: the launch's own
    `overrides`, then the fault schedule less what fired, then a resume from the newest
    committed checkpoint (from step 0 when none was committed yet: the job died before its
    first save). Reads the ended attempt's metrics, then sets its files aside. `killed`: the
    processes the launcher saw killed as scheduled; `kill_steps`: each scheduled kill's step."""
    reached = reached_step(out / "metrics.jsonl", [kill_steps[p] for p in killed])
    kept, dropped = remaining_faults(faults, reached, killed)
    from_step = newest_checkpoint(checkpoint_dir)
    moved = set_aside(out, attempt)
    run = [*overrides, faults_override(kept)]
    if from_step is not None:
        run.append("checkpoint.resume_step=-1")
    delay = policy.delay(restart)
    record = {
        "restart": restart,
        "max_restarts": policy.max_restarts,
        "reason": outcome,
        "message": message,
        "attempt": attempt + 1,
        "from_step": 0 if from_step is None else from_step,
        "resumed_from_checkpoint": from_step is not None,
        "checkpoint_dir": str(checkpoint_dir),
        "reached_step": reached,
        "backoff_s": delay,
        "ended_attempt_files": str(moved),
        "dropped_faults": [{"fault": describe_fault(f), "why": why} for f, why in dropped],
        "kept_faults": [describe_fault(f) for f in kept],
    }
    start = (f"resuming from checkpoint step {from_step} in {checkpoint_dir}"
             if from_step is not None
             else f"from step 0 (no checkpoint was committed in {checkpoint_dir} yet)")
    gone = "; ".join(f"{describe_fault(f)} ({why})" for f, why in dropped)
    line = (
        f"elasjax launch: restart {restart} of {policy.max_restarts} in {delay:g}s: {outcome}; "
        f"every process reaped; a new job (fresh coordinator port) {start}; the ended "
        f"attempt's files: {moved}" + (f"; faults that fired and will not fire again: {gone}"
                                       if gone else "")
    )
    return Restart(tuple(run), record, line)


def restarts_line(restarts: Sequence[dict]) -> str:
    return f"{len(restarts)} restart(s): " + "; ".join(
        f"{r['reason']} (the job had reached step {r['reached_step']}), resumed from step "
        f"{r['from_step']}"
        for r in restarts
    )
