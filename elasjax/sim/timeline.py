"""Goodput over time: a strategy replayed against a failure trace.

Between events a strategy trains at its steady post-change rate (`Outcome.tokens_per_s`). At a
failure it is down for `recovery_s` and loses work: the step in flight (half a step of the plan
that was running, expected) for the elastic strategies, everything since the last checkpoint for checkpoint-restart (whose
checkpoints, every Young interval of running time, also stall it for `ckpt_save_s` each). At a
repair the elastic strategies move to the better plan for `grow_s` of downtime; checkpoint-
restart restarts only when the survivors plus the repaired devices make more complete pipelines.
A failure during a recovery restarts the recovery.

Lost work is removed from the bins where it was earned, so a bin's goodput is the progress that
survives: tokens that end up in the model / (failure-free tokens/s * bin length). TorchFT's
shrunken batches count as processed tokens (its gradient scale changes; see strategies.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from .scenario import Outcome, Scenario
from .traces import TraceEvent


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Per-bin goodput of one strategy (fractions of the failure-free rate)."""

    strategy: str
    bin_edges_h: tuple[float, ...]
    goodput: tuple[float, ...]
    mean_goodput: float
    downtime_s: float
    lost_work_s: float
    transitions: int


def in_flight_s(o: Outcome) -> float:
    """The work an elastic strategy loses when its running plan fails: half a step of that plan
    in expectation (not the failure's `Outcome.lost_s`, which is the *new* plan's half step and
    zero for the failure-free plan)."""
    return 0.5 * o.step_s if o.tokens_per_s > 0 and np.isfinite(o.step_s) else 0.0


def resume_after(te: float, wait: float, kind: str, resume_at: float) -> tuple[float, float]:
    """(when training resumes, the downtime added) after an event of `kind` at `te` that stops
    training for `wait` seconds, training being due to resume at `resume_at`: a repair's growth
    never brings a pending resume forward; a failure restarts the wait."""
    new = te + wait
    idle = new - max(te, resume_at) if new > resume_at else 0.0
    return (max(resume_at, new) if kind == "repair" else new), idle


def _discard(segments: list[list[float]], t0: float, t1: float) -> float:
    """Zero the progress earned in (t0, t1]; returns the seconds of running time removed."""
    removed = 0.0
    out = []
    for a, b, r in segments:
        lo, hi = max(a, t0), min(b, t1)
        if r <= 0 or hi <= lo:
            out.append([a, b, r])
            continue
        removed += hi - lo
        if a < lo:
            out.append([a, lo, r])
        if hi < b:
            out.append([hi, b, r])
    segments[:] = out
    return removed


def simulate(
    sc: Scenario,
    name: str,
    fn: Callable[[Scenario, Sequence[int]], Outcome],
    trace: Sequence[TraceEvent],
    hours: float,
    bin_hours: float,
    reference_tokens_per_s: float,
    step_cost: float = 1.0,
) -> Timeline:
    """Replay `trace` for strategy `fn` and bin the surviving progress (see module docstring).
    `step_cost`: the strategy's fault-free step time over a plain loop's
    (`SimConfig.step_cost`): every rate is divided by it."""
    horizon = hours * 3600.0
    is_cr = name == "checkpoint_restart"
    interval = sc.ckpt_interval_s()
    period = interval + sc.recovery.ckpt_save_s
    down: set[int] = set()
    memo: dict[frozenset, Outcome] = {}

    def outcome(d: set[int]) -> Outcome:
        key = frozenset(d)
        if key not in memo:
            memo[key] = fn(sc, sorted(d))
        return memo[key]

    def rate(o: Outcome) -> float:
        return o.tokens_per_s * (interval / period if is_cr else 1.0) / step_cost

    current = outcome(down)
    segments: list[list[float]] = []
    seg_start, resume_at = 0.0, 0.0
    downtime = lost = 0.0
    transitions = 0
    for ev in trace:
        te = ev.time_s
        if te > horizon:
            break
        start = max(seg_start, resume_at)
        if te > start:
            segments.append([start, te, rate(current)])
        seg_start = te
        if ev.kind == "fail":
            down.update(ev.devices)
            new = outcome(down)
            if te > resume_at:  # running when it failed: lose work
                if is_cr:
                    last = resume_at + np.floor((te - resume_at) / period) * period
                    lost += _discard(segments, last, te)
                else:
                    lost += _discard(segments, te - in_flight_s(current), te)
            wait = new.recovery_s
        else:
            down.difference_update(ev.devices)
            new = outcome(down)
            if is_cr and new.tokens_per_s <= current.tokens_per_s * 1.001:
                continue  # no restart: the repaired devices wait for the next restart
            if new.plan == current.plan and new.tokens_per_s == current.tokens_per_s:
                current = new
                continue
            wait = new.grow_s
        transitions += 1
        resume_at, idle = resume_after(te, wait, ev.kind, resume_at)
        downtime += idle
        current = new
    start = max(seg_start, resume_at)
    if horizon > start:
        segments.append([start, horizon, rate(current)])
    edges, good, mean = bin_progress(segments, horizon, bin_hours, reference_tokens_per_s)
    return Timeline(
        strategy=name, bin_edges_h=edges, goodput=good, mean_goodput=mean,
        downtime_s=float(downtime), lost_work_s=float(lost), transitions=transitions,
    )


def bin_progress(segments: Sequence[Sequence[float]], horizon: float, bin_hours: float,
                 reference_tokens_per_s: float) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """(bin edges in hours, goodput per bin, mean goodput) of `[start_s, end_s, tokens/s]`
    segments, as fractions of `reference_tokens_per_s`."""
    edges = np.arange(0.0, horizon + 1e-9, bin_hours * 3600.0)
    if edges[-1] < horizon:
        edges = np.append(edges, horizon)
    tokens = np.zeros(len(edges) - 1)
    for a, b, r in segments:
        for i in range(len(edges) - 1):
            lo, hi = max(a, edges[i]), min(b, edges[i + 1])
            if hi > lo:
                tokens[i] += (hi - lo) * r
    good = tokens / (reference_tokens_per_s * np.diff(edges))
    return (tuple(float(e / 3600.0) for e in edges), tuple(float(g) for g in good),
            float(tokens.sum() / (reference_tokens_per_s * horizon)))


__all__ = ["Timeline", "bin_progress", "in_flight_s", "simulate"]
