"""How the multi-controller runtime describes a death it found at a barrier: which detector saw
it, its account in words, and the timings from the kill (`FailureReport`; docs/launch-internals.md,
"Detecting a death"). Nothing here changes the runtime's state; `MultiControllerRuntime._failure`
updates the live set and calls `describe`."""

from __future__ import annotations

import dataclasses

from .inprocess import FailureReport
from .verdict import Verdict


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
            f"{fmt_s(report.kill_to_silent_s)}, kill -> error {fmt_s(report.kill_to_error_s)}"
            + (f"; error: {cause[:160]}" if cause else ""))


def victims(procs, killed: bool) -> str:
    """'process 3 killed (SIGKILL)', or 'failed' where no kill was posted."""
    return ", ".join(f"process {p} " + ("killed (SIGKILL)" if killed else "failed")
                     for p in procs)
