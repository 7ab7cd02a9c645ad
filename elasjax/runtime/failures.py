"""What a guard's verdict means for this process, in the multi-controller runtime: a death it
found at a barrier described (which detector saw it, its account in words, the timings from the
kill: `FailureReport`; docs/launch-internals.md, "Detecting a death"), this process fenced off
(`fenced`), or a failure among live processes, retried (`collective_retry`) or ending the job
(`peer_error`). Nothing here changes the runtime's state; `MultiControllerRuntime` updates the
live set and its counters and raises what these return."""

from __future__ import annotations

import dataclasses

from .inprocess import DeviceFailure, FailureReport
from .verdict import Verdict

# consecutive collective failures among live processes retried before the job stops
MAX_COLLECTIVE_RETRIES = 3


class DeclaredDeadError(RuntimeError):
    """This process was declared dead (a heartbeat silence) while alive: it must leave."""


class PeerError(RuntimeError):
    """Another live process failed inside a guard while no process died: every live process
    stops with it (a guard is atomic), none is declared dead."""


@dataclasses.dataclass(frozen=True)
class Clocks:
    """When (`time.time()`) the parts of a failed block happened, as this process saw them; the
    kill times are the victims' own posts (`elasjax/kill/<p>`), the silences the heartbeat's."""

    t_block: float  # the block (its entry barrier) began
    t_known: float  # the verdict was read
    t_err: float | None = None  # the block raised (None: it completed)
    t_body: float | None = None  # the block's body began (after its entry barrier)
    t_kill: float | None = None  # the earliest victim's kill
    t_silent: float | None = None  # the earliest victim's heartbeat went silent
    t_exit: float | None = None  # this process's exit watch saw the earliest victim's exit


def since(t: float | None, t0: float | None) -> float | None:
    return t - t0 if t is not None and t0 is not None else None


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}s"


def describe(verdict: Verdict, procs: list[int], phase: str, err: BaseException | None,
             clocks: Clocks, *, aborted: str | None, drain_s: float | None, incident: int,
             collective_timeout_s: float, heartbeat_timeout_s: float) -> FailureReport:
    """The report of `procs`' death, declared by `verdict` at the `phase` guard's barrier;
    `err`: this process's block's error (None: it completed); `aborted`: how this process shut
    its collectives down (`aborts.CollectiveAborts.abort`), if it did."""
    c = clocks
    cause = (str(err).splitlines() or [""])[0] if err is not None else ""
    if err is None:
        released = "this process was not blocked (its block completed)"
    elif "Gloo" in cause or "collective" in cause.lower():
        released = (f"its collective failed after {c.t_err - c.t_block:.2f}s (the gloo collective "
                    f"timeout is {collective_timeout_s}s)")
    else:
        released = f"its block raised {type(err).__name__} after {c.t_err - c.t_block:.2f}s"
    if aborted is not None:
        released += f"; {aborted}"
    where = f"the {phase} {verdict.where} barrier"
    if set(procs) <= set(verdict.exited):  # the kernel said so (here, or on its host)
        how = verdict.exit_how
        noticed = all("notice" in how.get(p, "") for p in procs)
        detector = "death notice" if noticed else "process exit"
        detected_by = (f"{detector}: " + ", ".join(
            f"process {p} exited ({how.get(p, 'pidfd on this host')})" for p in procs)
            + f" and was absent from {where}; {released}")
    else:
        detector = "heartbeat"
        silent = ", ".join(f"process {p} silent {verdict.silent_s[p]:.2f}s" for p in procs)
        detected_by = (f"heartbeat: {silent} and absent from {where} "
                       f"(liveness timeout {verdict.timeout_s:g}s); {released}")
    return FailureReport(
        failed_processes=tuple(procs),
        detected_by=detected_by,
        detector=detector,
        kill_to_detect_s=since(c.t_known, c.t_kill),
        kill_to_silent_s=since(c.t_silent, c.t_kill),
        kill_to_exit_s=since(c.t_exit, c.t_kill),
        kill_to_error_s=since(c.t_err, c.t_kill),
        block_to_error_s=since(c.t_err, c.t_block),
        body_to_error_s=since(c.t_err, c.t_body),
        block_to_detect_s=c.t_known - c.t_block,
        error_cause=cause[:300],
        interrupted=cause[:160] if err is not None else None,
        drain_s=drain_s,
        incident=incident,
        collective_timeout_s=collective_timeout_s,
        liveness_timeout_s=verdict.timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )


def log_line(report: FailureReport, phase: str, devices: list[int], killed: bool) -> str:
    """The survivor's log line for `report` (the victims, how they were found, the timings);
    `killed`: the victims posted a kill (a fault schedule's SIGKILL)."""
    what = victims(report.failed_processes, killed)
    cause = report.error_cause or ""
    return (f"{phase}: {what} (devices {devices}) detected by {report.detected_by}; kill -> "
            f"detected {fmt_s(report.kill_to_detect_s)}, kill -> silent "
            f"{fmt_s(report.kill_to_silent_s)}, kill -> exit seen {fmt_s(report.kill_to_exit_s)}, "
            f"kill -> error {fmt_s(report.kill_to_error_s)}"
            + (f"; error: {cause[:160]}" if cause else ""))


def victims(procs, killed: bool) -> str:
    """'process 3 killed (SIGKILL)', or 'failed' where no kill was posted."""
    return ", ".join(f"process {p} " + ("killed (SIGKILL)" if killed else "failed")
                     for p in procs)


def arrival_note(arrivals: dict[int, float]) -> str:
    """Who arrived last at an entry barrier (`arrivals`: each process's arrival, in seconds
    after the first), and how long after the first."""
    if len(arrivals) < 2:
        return "one process at the entry barrier"
    late = max(arrivals, key=arrivals.get)
    order = ", ".join(f"p{p} +{t:.2f}s" for p, t in sorted(arrivals.items(), key=lambda kv: kv[1]))
    return (f"arrivals at the entry barrier: {order}; process {late} last, "
            f"{arrivals[late]:.2f}s after the first")


def fenced(verdict: Verdict, me: int, phase: str) -> DeclaredDeadError | None:
    """The error that makes this process leave where `verdict` declared it dead (its
    heartbeat was silent too long while it was alive: the survivors go on without it)."""
    if me not in verdict.failed:
        return None
    return DeclaredDeadError(
        f"{phase}: process {me} was declared dead by the arbiter (its heartbeat "
        f"was silent {verdict.silent_s[me]:.2f}s > liveness timeout "
        f"{verdict.timeout_s:g}s and it had not reached the barrier); the "
        "survivors go on without it. Raise --liveness-timeout on a loaded machine")


def retryable(verdict: Verdict, platform: str, renew: str, retries: int) -> bool:
    """Can a block whose collectives failed while every process was alive be retried (a gloo
    wait for a slow peer ran into the collective timeout and closed its pair)? Not off CPU,
    under `renew_collectives: never`, for an error that is not a collective's, or after
    `MAX_COLLECTIVE_RETRIES` in a row without a good step."""
    collective = all("Gloo" in m or "Timed out" in m or "collective" in m.lower()
                     for m in verdict.errors.values())
    return (platform == "cpu" and renew != "never" and collective
            and retries < MAX_COLLECTIVE_RETRIES)


def collective_retry(verdict: Verdict, phase: str, retry: int, c: Clocks, *,
                     drain_s: float | None, collective_timeout_s: float) -> DeviceFailure:
    """The retry (number `retry`) of a block whose collectives failed among live processes: a
    `DeviceFailure` of no device, whose recovery renews every process's client and redoes the
    block from the state before it (nothing was lost)."""
    msgs = list(verdict.errors.values())
    why = (f"a collective failed on process(es) {sorted(verdict.errors)} while every process "
           f"was alive (retry {retry} of {MAX_COLLECTIVE_RETRIES})")
    return DeviceFailure(
        set(), phase, detect_s=c.t_known - c.t_block, cause=why,
        report=FailureReport(
            detected_by=f"collective error, no process died: {why}",
            detector="collective error (no process died)",
            renew=why,
            block_to_error_s=since(c.t_err, c.t_block),
            body_to_error_s=since(c.t_err, c.t_body),
            error_cause=msgs[0][:300],
            interrupted=why,
            drain_s=drain_s,
            collective_timeout_s=collective_timeout_s,
        ),
    )


def peer_error(verdict: Verdict, phase: str, arrivals: str, collective_timeout_s: float
               ) -> PeerError:
    """A block that failed on live processes, none dead, and cannot be retried: the job stops
    on every process (`arrivals`: the entry barrier's `arrival_note`)."""
    msg = verdict.errors_line(300)
    hint = (
        f" A gloo collective that waits longer than the collective timeout "
        f"({collective_timeout_s}s) for a live peer fails and closes its "
        "communicator for good: raise --collective-timeout above the skew between "
        "processes." if "Gloo" in msg or "Timed out" in msg else ""
    )
    return PeerError(
        f"{phase}: failed on process(es) {sorted(verdict.errors)} while every process was alive "
        f"({msg}); no process is declared dead, the job stops ({arrivals}).{hint}")
