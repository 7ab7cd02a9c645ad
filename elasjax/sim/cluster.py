"""Cluster layout, groups of identical pipelines, micro-batch spreading and the step time.

A job runs `data` pipelines of `stage` stages; each stage is a tensor-parallel group of `tensor`
devices. Device ids follow Megatron's default order (tensor fastest, then data, then stage):
`id = (stage * data + replica) * tensor + t`, and a host is `devices_per_host` consecutive ids,
so with `tensor < devices_per_host` a host holds the same stage of neighbouring replicas. A
failed device breaks its whole tensor group (no strategy here changes the tensor degree of a
running group; `elasjax_spmd` may regroup survivors at a re-plan).

Pipelines are simulated in *groups* of identical pipelines (same stage times, same micro-batch
count): at 10^5 devices there are ~10^3 pipelines but only a handful of distinct shapes, which
is what keeps the planner under a second. The invariant every strategy relies on:

    step = max over pipelines of 1F1B(stage times, micro-batches) + max data-parallel sync

(`costmodel.pipeline_step_cost`), with the sync an all-reduce of each stage's gradients over
the pipelines that run micro-batches.

`spread_microbatches` hands out the global batch's micro-batches so the slowest pipeline
finishes first (greedy min-max, computed exactly by water-filling over groups rather than one
micro-batch at a time, which would cost O(M log P) Python steps at 10^5 devices).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from ..models.costmodel import pipeline_step_cost


@dataclasses.dataclass(frozen=True)
class Layout:
    """`data` pipelines x `stage` stages x `tensor` devices, `devices_per_host` per host."""

    data: int
    stage: int
    tensor: int
    devices_per_host: int

    def __post_init__(self) -> None:
        for name in ("data", "stage", "tensor", "devices_per_host"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def n_devices(self) -> int:
        return self.data * self.stage * self.tensor

    @property
    def n_groups(self) -> int:
        return self.data * self.stage

    def group_of(self, device_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Tensor-group index `stage * data + replica` of each device."""
        return np.asarray(device_ids, dtype=np.int64) // self.tensor

    def broken(self, failed: Sequence[int] | np.ndarray) -> np.ndarray:
        """[data, stage] bool: the tensor group (replica, stage) has a failed device."""
        out = np.zeros((self.stage, self.data), dtype=bool)
        g = np.unique(self.group_of(failed))
        g = g[g < self.n_groups]
        out.reshape(-1)[g] = True
        return out.T.copy()

    def host_devices(self, host: int, n_devices: int) -> np.ndarray:
        k = self.devices_per_host
        return np.arange(host * k, min((host + 1) * k, n_devices))


@dataclasses.dataclass(frozen=True)
class PipeGroup:
    """`count` identical pipelines. Stage arrays are per stage; `freq` is the clock / f0."""

    count: int
    sizes: tuple[int, ...]  # items per stage
    tc: tuple[float, ...]
    tm: tuple[float, ...]
    grad_bytes: tuple[float, ...]  # per device, per stage
    micro: int = 0
    freq: tuple[float, ...] | None = None
    label: str = ""

    @property
    def n_stages(self) -> int:
        return len(self.sizes)

    def stage_times(self) -> np.ndarray:
        f = np.ones(len(self.tc)) if self.freq is None else np.asarray(self.freq)
        return np.asarray(self.tc) / f + np.asarray(self.tm)

    def fill_and_tau(self) -> tuple[float, float]:
        """Pipeline time is `fill + m * tau` for m >= 1 micro-batches (0 when idle)."""
        t = self.stage_times()
        return float(t.sum() - t.max()), float(t.max())

    def pipe_s(self) -> float:
        return pipeline_step_cost(self.stage_times(), self.micro).pipeline_s


def make_group(workload, sizes: Sequence[int], count: int, label: str = "") -> PipeGroup:
    tc, tm, gb = workload.stage_sums(list(sizes))
    return PipeGroup(
        count=int(count), sizes=tuple(int(s) for s in sizes), tc=tuple(map(float, tc)),
        tm=tuple(map(float, tm)), grad_bytes=tuple(map(float, gb)), label=label,
    )


def spread_microbatches(
    fill: Sequence[float], tau: Sequence[float], counts: Sequence[int], total: int
) -> list[tuple[int, int, int]]:
    """Min-max spread of `total` micro-batches over groups of identical pipelines.

    Group g has `counts[g]` pipelines, each taking `fill[g] + m * tau[g]` for m >= 1 micro-
    batches (0 when m = 0). Returns `(group, n_pipelines, m)` triples covering every pipeline,
    with `sum(n * m) == total` and the largest pipeline time as small as possible (the result
    of the one-at-a-time greedy: give the next micro-batch to the pipeline that would finish
    it first; see `greedy_spread_reference`).
    """
    a = np.asarray(fill, dtype=np.float64)
    t = np.asarray(tau, dtype=np.float64)
    k = np.asarray(counts, dtype=np.int64)
    if total < 0:
        raise ValueError(f"total micro-batches must be >= 0, got {total}")
    if np.any(t <= 0) or np.any(k < 0):
        raise ValueError("tau must be > 0 and counts >= 0")
    if total == 0 or k.sum() == 0:
        if total > 0:
            raise ValueError("no pipeline left to run the micro-batches")
        return [(g, int(k[g]), 0) for g in range(len(k)) if k[g] > 0]
    eps = 1e-12

    def per_pipe(T: float) -> np.ndarray:
        return np.maximum(0, np.floor((T - a) / t + eps)).astype(np.int64)

    live = k > 0
    hi = float(np.min(np.where(live, a + np.ceil(total / np.maximum(k, 1)) * t, np.inf)))
    lo = 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if int((per_pipe(mid) * k).sum()) >= total:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-13 * max(hi, 1e-30):
            break
    m = per_pipe(hi) * (k > 0)
    # `hi` may allocate a few more than `total`; remove them from the pipelines that finish
    # last (ties at the top level), so the makespan never grows.
    hi_n = k.copy()  # pipelines of group g at m[g]; the rest (k - hi_n) are at m[g] - 1
    excess = int((m * k).sum()) - total
    while excess > 0:
        level = np.where((m > 0) & (hi_n > 0), a + m * t, -np.inf)
        top = level.max()
        for g in np.flatnonzero(level >= top - 1e-12 * max(abs(top), 1e-30)):
            take = min(excess, int(hi_n[g]))
            hi_n[g] -= take
            excess -= take
            if hi_n[g] == 0:  # the whole group moved down one level
                m[g] -= 1
                hi_n[g] = k[g]
            if excess == 0:
                break
    out = []
    for g in range(len(k)):
        if k[g] == 0:
            continue
        if hi_n[g] > 0:
            out.append((g, int(hi_n[g]), int(m[g])))
        if k[g] - hi_n[g] > 0:
            out.append((g, int(k[g] - hi_n[g]), int(m[g] - 1)))
    return out


def greedy_spread_reference(
    fill: Sequence[float], tau: Sequence[float], total: int
) -> list[int]:
    """One-at-a-time greedy over single pipelines (reference for tests)."""
    m = [0] * len(fill)
    heap = [(fill[p] + tau[p], p) for p in range(len(fill))]
    heapq.heapify(heap)
    for _ in range(total):
        _, p = heapq.heappop(heap)
        m[p] += 1
        heapq.heappush(heap, (fill[p] + (m[p] + 1) * tau[p], p))
    return m


def assign(groups: Sequence[PipeGroup], total: int) -> tuple[PipeGroup, ...]:
    """Spread `total` micro-batches over `groups` (split where a group gets two counts)."""
    fills, taus = zip(*(g.fill_and_tau() for g in groups)) if groups else ((), ())
    out = []
    for gi, n, m in spread_microbatches(fills, taus, [g.count for g in groups], total):
        out.append(dataclasses.replace(groups[gi], count=n, micro=m))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StepTime:
    pipe_s: float
    dp_sync_s: float
    participants: int

    @property
    def total_s(self) -> float:
        return self.pipe_s + self.dp_sync_s


def step_time(groups: Sequence[PipeGroup], workload) -> StepTime:
    """Slowest pipeline + slowest stage's gradient all-reduce over the working pipelines."""
    working = [g for g in groups if g.micro > 0 and g.count > 0]
    if not working:
        return StepTime(float("inf"), 0.0, 0)
    n = sum(g.count for g in working)
    pipe = max(g.pipe_s() for g in working)
    sync = max(workload.dp_sync_s(max(g.grad_bytes), n) for g in working)
    return StepTime(pipe, sync, n)


def busy_device_seconds(groups: Sequence[PipeGroup], tensor: int) -> tuple[float, float]:
    """(busy device-seconds, devices) of the working pipelines in one step."""
    busy = sum(g.count * tensor * g.micro * float(g.stage_times().sum()) for g in groups)
    devs = sum(g.count * tensor * g.n_stages for g in groups if g.micro > 0)
    return busy, devs


__all__ = [
    "Layout",
    "PipeGroup",
    "make_group",
    "spread_microbatches",
    "greedy_spread_reference",
    "assign",
    "StepTime",
    "step_time",
    "busy_device_seconds",
]
