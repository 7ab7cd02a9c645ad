"""JSON-lines writers for `metrics.jsonl` and `events.jsonl`, and readers for them.

One line per step in `metrics.jsonl`: `{"step", "loss", "global_batch", "tokens", "n_devices",
"plan", "step_time_s"}` plus optional fields (`eval_loss`, `batch_digest`, `redo`). One line per
event in `events.jsonl`; recovery events carry the MTTR breakdown (`RecoveryEvent`, whose phases,
`MTTR_PHASES`, sum to its `mttr_s`). Plots and `elasjax compare` read these files only.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

# The phases whose sum is a recovery's `mttr_s`, under every runtime.
MTTR_PHASES = (
    "detect_s",
    "retry_s",
    "plan_s",
    "compile_s",
    "transfer_s",
    "verify_s",
    "snapshot_s",
    "first_step_s",
)


@dataclasses.dataclass(kw_only=True)
class RecoveryRecord:
    """What every recovery reports, the loop's (`RecoveryEvent`) and the pieces'
    (`ElasticState.recover`'s `elastic.Recovery`), under the same names: the step whose state
    was recovered (continue with step + 1), the devices that failed, the most expensive source
    any slice came from (`rung`: `replica` for surviving copies only, `buddy` or `host` for a
    snapshot, `checkpoint` for the newest checkpoint, after which `steps_lost` steps run
    again), the bytes and copies moved, each phase's seconds, what the rebuilt state's
    checksums were compared with (`verify`: those of the state it replaces) and whether they
    were equal (`verified`, read off `verify`), whether the new layout's
    executable was ready when asked for (`standby_hit`; None: no standby), and the snapshot
    copies refused because they did not verify or were lost (only those the recovery
    needed)."""

    step: int
    failed_devices: list[int]
    rung: str
    bytes_moved: int
    transfers: int
    plan_s: float
    compile_s: float
    transfer_s: float
    verify_s: float
    # the comparison the rebuilt state passed (`transfer.verified.Comparison`): {"leaves" (leaf
    # checksums compared), "bytes" (the state's bytes they cover), "digest_before" (digest of
    # the checksums it had to have), "digest_after" (of those it has)}; a mismatch raises
    # `StateMismatchError` instead, so no event records one
    verify: dict = dataclasses.field(default_factory=dict)
    # read off `verify`: leaves > 0 and digest_before == digest_after
    verified: bool = False
    steps_lost: int = 0
    standby_hit: bool | None = None
    refused_snapshots: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class RecoveryEvent(RecoveryRecord):
    """One recovery of the loop: its failure, plans, rung, bytes and each MTTR phase
    (`events.jsonl`'s `recovery` record, `to_json`)."""

    type: ClassVar[str] = "recovery"
    fault: str
    from_plan: str
    to_plan: str
    max_transfers_per_device: int
    bytes_lost: int
    detect_s: float
    exe_cache_hit: bool
    runtime: str
    failure_simulation: str
    first_step_s: float = 0.0
    snapshot_s: float = 0.0
    retry_s: float = 0.0
    standby_wait_s: float = 0.0  # waited for a background compile already under way
    # where the new plan's executables came from (`Executables.origin`): "compiled" here,
    # "shared" (compiled once for the job by another process), "stored" (the program store),
    # "rebound" (loaded from a compile for other devices), "reloaded", "cached", "shipped"
    executable_origin: str = ""
    # the first step ran the new plan's executable for the first time, never warmed (XLA's
    # first run of a program is slower: its first step is then slow, and says why)
    first_step_first_run: bool = False
    attempts: int = 1
    resumed_at_step: int = 0
    bytes_kept_in_place: int = 0
    bytes_cross_process: int = 0
    bytes_sent: dict = dataclasses.field(default_factory=dict)  # this process, by peer
    bytes_received: dict = dataclasses.field(default_factory=dict)
    failed_processes: list[int] = dataclasses.field(default_factory=list)
    failed_phases: list[str] = dataclasses.field(default_factory=list)
    rungs: list[str] = dataclasses.field(default_factory=list)
    migration: str = "blocking"  # "blocking" | "async" (resumed on a fast path first)
    optimal_plan: str = ""
    strategy: str = "elastic"
    compiles: int = -1  # XLA compilations on the training thread from detection to first step
    transfer_plan_hit: bool = False  # the transition was planned before the failure
    transfer_plan_s: float = 0.0  # time spent planning it after the failure (0 on a hit)
    # hot spares (`parallel.spares`): the hosts (under launch: processes) whose spare devices
    # the new plan took into the lost ones' mesh positions, and the mesh size before and after
    spare_took_over: list[int] = dataclasses.field(default_factory=list)
    from_n_devices: int = 0
    to_n_devices: int = 0
    # a new CPU client with fresh gloo communicators was started (`elasjax.runtime.collectives`): its
    # time is in plan_s; executables of the old client are reloaded onto it when used
    collectives_renewed: bool = False
    # a renewal was asked for and not needed: every communicator of the client includes a dead
    # device (`collectives.reachable_cliques`); the client stayed, its transfer server renewed
    collectives_kept: bool = False
    renew_s: float = 0.0
    renew_reasons: str = ""  # which process asked, and why
    detail: dict = dataclasses.field(default_factory=dict)  # what the runtime knows of the cause

    @property
    def mttr_s(self) -> float:
        return sum(getattr(self, k) for k in MTTR_PHASES)

    # summed when a recovery continues one whose first step failed
    _ADDED = ("plan_s", "compile_s", "transfer_s", "verify_s", "snapshot_s", "standby_wait_s",
              "renew_s", "transfer_plan_s", "bytes_moved", "transfers", "bytes_lost",
              "bytes_kept_in_place", "bytes_cross_process", "attempts")

    def continued_by(self, later: RecoveryEvent, failed_step_s: float) -> RecoveryEvent:
        """One recovery of this event and `later`, the recovery of a failure in this one's first
        step (`failed_step_s` long): a recovery ends at its first good step, so its MTTR runs
        from this failure to the step after `later`. The failed step and `later`'s detection
        count as `retry_s`; the other phases add up; the failures are both listed."""
        merged = dataclasses.replace(
            later,
            step=self.step,
            failed_devices=sorted(set(self.failed_devices) | set(later.failed_devices)),
            failed_processes=sorted(set(self.failed_processes) | set(later.failed_processes)),
            fault=f"{self.fault}; then, in its first step: {later.fault}",
            from_plan=self.from_plan,
            from_n_devices=self.from_n_devices,
            detect_s=self.detect_s,
            retry_s=self.retry_s + failed_step_s + later.detect_s + later.retry_s,
            standby_hit=self.standby_hit and later.standby_hit,
            exe_cache_hit=self.exe_cache_hit and later.exe_cache_hit,
            # `verify` stays `later`'s: the comparison of the state the run went on with
            verified=self.verified and later.verified,
            steps_lost=self.steps_lost + later.steps_lost,
            failed_phases=self.failed_phases + later.failed_phases,
            rungs=self.rungs + later.rungs,
            refused_snapshots=self.refused_snapshots + later.refused_snapshots,
            collectives_renewed=self.collectives_renewed or later.collectives_renewed,
            collectives_kept=self.collectives_kept or later.collectives_kept,
            renew_reasons="; ".join(r for r in (self.renew_reasons, later.renew_reasons) if r),
            compiles=self.compiles,  # the count at this recovery's start
            detail={**later.detail, **self.detail, "first_step_failure": later.fault},
        )
        for k in self._ADDED:
            setattr(merged, k, getattr(self, k) + getattr(later, k))
        return merged

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        detail = d.pop("detail")
        return {"type": "recovery", **d, **detail, "mttr_s": self.mttr_s}


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crashed run keeps what it logged.

    `writes` (a callable; None: always) says whether this process writes the file now: under
    `elasjax launch` the lowest live process does, and when it dies the next one takes over.
    Every process then keeps its last `KEPT` lines, and a process that becomes the writer
    appends those the file lacks (it counts the file's complete lines; a line the dead writer
    left half-written is cut off first). Every process emits the same records in the same order,
    so the counts agree; records of a type in `local_types` are the exception (what one process
    alone knows, at a time of its own: its standby was built, `events.StandbyReady`): only the
    process writing the file at the time writes one, and none is counted, kept or matched at a
    take-over. Counted among the others, one written by a writer that then died would make
    its successor skip the record it owes the file (tests/test_writer_takeover.py)."""

    KEPT = 1024  # a writer's death costs at most a step's lines; this is many steps' worth

    def __init__(self, path: str | Path | None, writes: Callable[[], bool] | None = None,
                 local_types: frozenset[str] = frozenset()):
        self.path = Path(path) if path is not None else None
        self.writes, self.local_types = writes, local_types
        self._f = None
        self._count = 0  # lines this process has emitted
        self._kept: collections.deque[str] = collections.deque(maxlen=self.KEPT)
        if self.path is not None and (writes is None or writes()):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self.path.open("w")

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._f is not None and self.writes is not None and not self.writes():
            # no longer the writer: a process declared dead while stopped, which resumed after
            # another took the file over, wrote its error line over the new writer's lines
            # (experiments/RESULTS.md, "The MTTR fuzz"); it writes nothing more
            self.close()
        line = json.dumps(record, default=_default) + "\n"
        if self.writes is not None and record.get("type") in self.local_types:
            if self._f is None and self.writes():
                self._take_over()
            if self._f is not None:
                self._f.write(line)
                self._f.flush()
            return
        self._count += 1
        if self.writes is not None:
            self._kept.append(line)
            if self._f is None:
                if self.writes():
                    self._take_over()
                return
        if self._f is not None:
            self._f.write(line)
            self._f.flush()

    @property
    def lines(self) -> int:
        """Lines this process has emitted (every process emits the same ones)."""
        return self._count

    def continue_at(self, lines: int) -> None:
        """A process that joins a running job: the writers' files hold `lines` lines already
        (`admission`), so its count, and a later take-over's, start there."""
        self._count = lines

    def _take_over(self) -> None:
        """Become the writer: append the kept lines the file lacks, this record's included."""
        text = self.path.read_text() if self.path.exists() else ""
        whole = text[: text.rfind("\n") + 1]
        if whole != text:  # the last writer died in the middle of a line
            self.path.write_text(whole)
        written = whole.count("\n")
        if self.local_types:
            written -= sum(json.loads(ln).get("type") in self.local_types
                           for ln in whole.splitlines() if ln.strip())
        missing = self._count - written
        self._f = self.path.open("a")
        if missing > len(self._kept):
            self._f.write(json.dumps({"type": "gap", "lines_lost": missing - len(self._kept)})
                          + "\n")
        for line in list(self._kept)[max(0, len(self._kept) - missing):]:
            self._f.write(line)
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _default(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def losses_by_step(run_dir: str | Path, key: str = "loss") -> dict[int, float]:
    """The last logged value of `key` per step (a redone step's final value wins)."""
    out: dict[int, float] = {}
    for r in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        if key in r and r[key] is not None:
            out[int(r["step"])] = float(r[key])
    return out


def deviation(a: dict[int, float], ref: dict[int, float], steps=None) -> dict[str, float]:
    """Relative deviation of run `a` from reference `ref` over common (or given) steps:
    max and mean of |a - ref| / |ref|."""
    common = sorted(set(a) & set(ref) if steps is None else set(steps) & set(a) & set(ref))
    if not common:
        return {"steps": 0, "max_rel": math.nan, "mean_rel": math.nan}
    rel = [abs(a[s] - ref[s]) / max(abs(ref[s]), 1e-30) for s in common]
    return {"steps": len(common), "max_rel": max(rel), "mean_rel": sum(rel) / len(rel)}


class StepClock:
    """When each dispatched step finished: a thread waits, in dispatch order, for one small
    output of each (`watch`) and notes the time. The loop reads a step's metrics steps later
    (`stepping.READ_BEHIND`), and dispatch itself can wait for the step before (XLA:CPU runs one
    execution of a multi-device program at a time: a step's call returns before the step ends,
    the next call only once that step is done), so neither the read nor the call says when a
    step ended."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._done: dict[int, float | None] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, seq: int, x) -> None:
        """Note when `x` (an output of the step numbered `seq`, increasing) is ready."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="elasjax-step-clock",
                                            daemon=True)
            self._thread.start()
        self._q.put((seq, x))

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            seq, x = item
            try:
                x.block_until_ready()
                t = time.perf_counter()
            except RuntimeError:  # its devices failed (a deleted buffer): the step never finished
                t = None
            with self._cv:
                self._done[seq] = t
                self._cv.notify_all()

    def finished(self, seq: int, wait_s: float = 0.05) -> float | None:
        """When step `seq` finished, for a step whose result the caller has just read (so the
        thread sees it ready at once); None if the thread has not noted it within `wait_s` (it
        waits on an earlier step that will not finish). Forgets the steps up to `seq`."""
        with self._cv:
            self._cv.wait_for(lambda: seq in self._done, timeout=wait_s)
            t = self._done.get(seq)
            for k in [k for k in self._done if k <= seq]:
                del self._done[k]
        return t

    def close(self) -> None:
        """End the thread once it has noted the steps queued. Joined: a daemon thread still
        inside `block_until_ready` when the interpreter exits aborts the process on Python 3.12
        with JAX 0.12 ("terminate called ... exception not rethrown"; examples/classifier_loop.py
        showed it, experiments/RESULTS.md, "The newest JAX")."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=60)
            self._thread = None


# -- the whole cost of failures: time lost per failure, and the run's goodput -------------------

# A step slower than this times its plan's pace is slow (first steps after a change)
SLOW = 1.1


@dataclasses.dataclass
class Timeline:
    """What the loop did, in order, for `failure_costs`: ("step", plan, seconds, redo),
    ("recovery", RecoveryEvent), ("cutover", plan it installed, stall seconds), ("pause",
    seconds: the loop waited for the standby)."""

    items: list = dataclasses.field(default_factory=list)
    startup_s: float = 0.0  # from the run's start to its first step's dispatch

    def step(self, plan: str, dt: float, redo: bool) -> None:
        self.items.append(("step", plan, dt, redo))

    def recovery(self, ev: RecoveryEvent) -> None:
        self.items.append(("recovery", ev))

    def cutover(self, plan: str, stall_s: float) -> None:
        self.items.append(("cutover", plan, stall_s))

    def pause(self, wait_s: float) -> None:
        self.items.append(("pause", wait_s))


def paces(timeline: Timeline) -> dict[str, float]:
    """Each plan's fault-free pace: the median step time of its settled steps (not the first
    after a start, recovery or cut-over, not redone); all its steps where it has no settled
    one."""
    settled: dict[str, list[float]] = {}
    every: dict[str, list[float]] = {}
    fresh = True
    for it in timeline.items:
        if it[0] != "step":
            fresh = it[0] in ("recovery", "cutover") or fresh
            continue
        _, plan, dt, redo = it
        every.setdefault(plan, []).append(dt)
        if redo:
            continue
        if not fresh:
            settled.setdefault(plan, []).append(dt)
        fresh = False
    return {p: _median(settled.get(p) or v) for p, v in every.items()}


def _median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def failure_costs(timeline: Timeline, initial_plan: str, wall_s: float
                  ) -> tuple[list[dict], dict]:
    """(the time lost to each recovery, the run's goodput).

    A failure's time lost runs from the failure until the run is back at the fault-free pace
    of the plan it recovered to (after the cut-over, with an asynchronous migration): the
    recovery's phases before its first step, the first steps' time beyond that plan's pace,
    the fast-path steps' time beyond the pace of the plan it cuts over to, the pauses for the
    standby and the cut-over's stall, and the steps redone from a checkpoint. A plan's pace is
    `paces`; after its first step at pace, later slow steps are not charged to the failure.

    Goodput = useful steps x the initial plan's pace / wall time. Badput by cause, each
    measured one >= 0: start-up (to the first step), compile and recovery (the recoveries'
    phases before their first steps), pauses, redone steps, slow steps (beyond their plan's
    pace, net of the steps below it; 0 where those outweigh, their gain then netted into the
    rest), capacity (a plan's pace beyond the initial one's, per step), and the rest
    (`other_s`: host work between steps, evaluation, checkpoints, step-time jitter). Time a
    run gained is not a negative badput: a step on a plan faster than the initial one (a
    smaller plan can run faster where the devices share cores: the demo on 2 cores), and steps
    faster than their plan's median where those outweigh the slow ones, are reported apart,
    `gained_s`. So `good_s + sum(badput) - gained_s == wall_s`, every badput >= 0
    (tests/test_costs.py)."""
    pace = paces(timeline)
    # which plan each recovery ends on: the plan a later cut-over (before the next recovery)
    # installs, else its own
    targets, cur = [], None
    for it in timeline.items:
        if it[0] == "recovery":
            targets.append(it[1].to_plan)
            cur = len(targets) - 1
        elif it[0] == "cutover" and cur is not None:
            targets[cur] = it[1]
    costs: list[dict] = []
    open_: dict | None = None
    good_steps = 0
    bad = dict(startup_s=timeline.startup_s, compile_s=0.0, recovery_s=0.0, pauses_s=0.0,
               redone_s=0.0, slow_steps_s=0.0, capacity_s=0.0)
    gained = 0.0  # steps faster than the pace they are held to: time gained, not badput
    s_ff = pace.get(initial_plan)
    for it in timeline.items:
        kind = it[0]
        if kind == "recovery":
            ev = it[1]
            before = ev.mttr_s - ev.first_step_s
            bad["compile_s"] += ev.compile_s
            bad["recovery_s"] += before - ev.compile_s
            open_ = {"step": ev.step, "failed_devices": ev.failed_devices, "to_plan": ev.to_plan,
                     "first_step_first_run": ev.first_step_first_run,
                     "target_plan": targets[len(costs)], "phases_s": before, "slow_steps_s": 0.0,
                     "fast_path_s": 0.0, "pauses_s": 0.0, "redone_s": 0.0, "at_pace": False,
                     "steps_to_pace": 0}
            costs.append(open_)
        elif kind == "cutover":
            bad["pauses_s"] += it[2]
            if open_ is not None:
                open_["pauses_s"] += it[2]
                open_["at_pace"] = False
        elif kind == "pause":
            bad["pauses_s"] += it[1]
            if open_ is not None:
                open_["pauses_s"] += it[1]
        else:
            _, plan, dt, redo = it
            p = pace[plan]
            if redo:
                bad["redone_s"] += dt
                if open_ is not None:
                    open_["redone_s"] += dt
                continue
            good_steps += 1
            bad["slow_steps_s"] += dt - p  # signed: steps faster than the median net out
            if s_ff is not None:  # each step apart: a faster plan offsets no slower one
                bad["capacity_s"] += max(0.0, p - s_ff)
                gained += max(0.0, s_ff - p)
            if open_ is None or open_["at_pace"]:
                continue
            target = pace.get(open_["target_plan"])
            open_["steps_to_pace"] += 1
            if plan != open_["target_plan"] and target is not None:  # a fast-path step
                open_["fast_path_s"] += max(0.0, dt - target)
            elif dt > SLOW * p:
                open_["slow_steps_s"] += dt - p
            else:
                open_["at_pace"] = True
    for c, ev in zip(costs, [it[1] for it in timeline.items if it[0] == "recovery"]):
        c["time_lost_s"] = (c["phases_s"] + c["slow_steps_s"] + c["fast_path_s"]
                            + c["pauses_s"] + c["redone_s"])
        p = pace.get(ev.to_plan)
        c["first_step_x"] = ev.first_step_s / p if p else None  # x its plan's pace
        if c["first_step_x"] is not None and c["first_step_x"] > SLOW:
            if not ev.first_step_first_run:
                why = "not known: its executable had run before"
            elif ev.standby_hit:
                why = ("the first run of the new plan's executable, built by the standby while "
                       "training ran and not warmed")
            else:
                why = ("the first run of the new plan's executable, compiled in the recovery "
                       "and not warmed (warm it ahead with standby)")
            c["first_step_why"] = why
        if not c["at_pace"]:
            c["note"] = "the run ended (or failed again) before it was back at pace"
        del c["at_pace"]
    # steps faster than their plan's median, on balance, are no negative badput either
    gained += max(0.0, -bad["slow_steps_s"])
    bad["slow_steps_s"] = max(0.0, bad["slow_steps_s"])
    good = good_steps * s_ff if s_ff is not None else None
    out = {"wall_s": wall_s, "useful_steps": good_steps, "pace_s": s_ff, "good_s": good,
           "goodput": good / wall_s if good is not None and wall_s > 0 else None,
           "badput": bad, "gained_s": gained, "paces": pace}
    if good is not None:  # wall = good + badput - gained; what is left, where it is left
        rest = wall_s - good - sum(bad.values()) + gained
        out["badput"]["other_s"] = max(0.0, rest)
        out["gained_s"] = gained + max(0.0, -rest)
    return costs, out
