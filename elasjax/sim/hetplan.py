"""Heterogeneous re-planning after a failure (ElasWave-style), with a time budget. Pure numpy.

Input: the broken tensor groups `[data, stage]`. Output: a `HetPlan`, i.e. groups of pipelines
with their own stage counts, layer partitions and micro-batch counts, plus optional clocks.

Candidates, in the order they are evaluated (digest section 2.8):

1. **repartition**: every broken pipeline keeps its surviving stages and re-splits its layers
   over them with the minimax DP (`elasjax.core.partition`), preferring the split that moves the
   fewest bytes (a surviving stage keeps the layers it has where that costs no step time);
   healthy pipelines keep their partition; micro-batches are spread by greedy min-max so the
   global batch is unchanged.
2. **drop the k slowest broken pipelines** (k = 1 .. all), their micro-batches spread over the
   rest: better when a pipeline lost so many stages that it drags the step.
3. **reroute** (ReCycle-like): keep every partition and send the lost stages' micro-batches
   to same-stage peers (see `reroute_step`).

The fastest predicted step wins (ties: the earlier candidate), then DVFS (`dvfs.balance`) is
applied to it, alternating with a re-spread of micro-batches for DVFS-adjusted stage times.
Candidates after the first are skipped once `budget_s` is spent, so the result depends on the
budget only when it binds (it does not at 10^5 devices with a 1 s budget; see the experiment).

Pipelines are handled in classes (same set of lost stages => same partition), so the cost is
O(distinct failure patterns * DP) + O(broken pipelines) spreads, not O(devices).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..core.partition import partition_with_moves, stage_of_layers
from .cluster import PipeGroup, StepTime, assign, make_group, step_time
from .dvfs import balance, step_energy_j


@dataclasses.dataclass(frozen=True)
class Reshape:
    """How one class of broken pipelines (same lost stages) is re-split."""

    lost: tuple[int, ...]
    count: int
    group: PipeGroup | None  # None: nothing survives or nothing fits memory
    moved_bytes: float  # per pipeline, all tensor shards together
    blocking_bytes: float  # per pipeline: items that lived on lost stages
    max_in_bytes: float  # per pipeline: most bytes any one new stage receives


@dataclasses.dataclass(frozen=True)
class HetPlan:
    """A heterogeneous plan: groups of pipelines with their micro-batch counts (and clocks)."""

    groups: tuple[PipeGroup, ...]
    step: StepTime
    choice: str
    dropped: int
    moved_bytes: float
    blocking_bytes_max: float  # per tensor group, largest blocking transfer
    in_bytes_max: float  # per tensor group, largest total transfer (blocking + async)
    evaluated: int
    dvfs_used: bool
    energy_j: float
    latency_s: float = dataclasses.field(default=0.0, compare=False)

    def describe(self) -> str:
        parts = [f"{g.count}x[{g.n_stages} st, m={g.micro}]" for g in self.groups if g.count]
        if len(parts) > 4:
            parts = parts[:4] + [f"... {len(parts) - 4} more"]
        return " + ".join(parts)


def broken_classes(broken: np.ndarray) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
    """(healthy pipelines, [(lost stages, pipelines)]) of a `[data, stage]` broken mask."""
    rows = broken[broken.any(axis=1)]
    healthy = int(broken.shape[0] - rows.shape[0])
    if rows.shape[0] == 0:
        return healthy, []
    uniq, counts = np.unique(rows, axis=0, return_counts=True)
    out = [(tuple(int(s) for s in np.flatnonzero(u)), int(c)) for u, c in zip(uniq, counts)]
    return healthy, sorted(out)


def reshape_class(sc, lost: tuple[int, ...], count: int) -> Reshape:
    """Minimax re-split of a pipeline that lost `lost` stages over its survivors."""

    def build() -> Reshape:
        S, D = sc.layout.stage, sc.layout.data
        survivors = [s for s in range(S) if s not in lost]
        if not survivors:
            return Reshape(lost, count, None, 0.0, 0.0, 0.0)
        w = sc.workload()
        base = sc.partition(S)
        owner = stage_of_layers(base.sizes)
        mb = w.move_bytes(D)
        sig = np.asarray(survivors)
        move = np.where(sig[:, None] == owner[None, :], 0.0, mb[None, :])
        mem = w.layer_mem(D, len(survivors))
        cap = sc.mem_cap() if np.isfinite(sc.mem_cap()) else None
        try:
            part = partition_with_moves(
                w.cost(), len(survivors), move_bytes=move,
                layer_mem=mem if cap else None, stage_mem_cap=cap,
            )
        except ValueError:
            return Reshape(lost, count, None, 0.0, 0.0, 0.0)
        new_owner = stage_of_layers(part.sizes)
        got = move[new_owner, np.arange(w.n_items)]
        blocking = float(mb[np.isin(owner, lost)].sum())
        per_stage = np.bincount(new_owner, weights=got, minlength=len(survivors))
        group = make_group(w, part.sizes, count, label=f"lost {list(lost)}")
        return Reshape(lost, count, group, part.moved_bytes, blocking, float(per_stage.max()))

    r = sc.memo(("reshape", lost), build)
    return dataclasses.replace(r, count=count, group=None if r.group is None else
                               dataclasses.replace(r.group, count=count))


@dataclasses.dataclass(frozen=True)
class RerouteResult:
    step: StepTime
    busy_device_s: float
    devices: int
    rerouted_per_peer: tuple[int, ...]


def reroute_step(sc, broken: np.ndarray) -> RerouteResult | None:
    """ReCycle-like step: partitions unchanged; a lost stage's micro-batches run on the same
    stage of peer pipelines, absorbed by their 1F1B bubbles.

    Stage s of the most loaded peer runs `r_s = ceil(m * f_s / (D - f_s))` extra micro-batches
    (f_s pipelines lost stage s). ReCycle's decoupled backprop and staggered optimizer let that
    work fill the stage's idle time `idle_s = T_pipe - m * t_s`; only the part that does not fit
    (`r_s * t_s - fill * idle_s`) lengthens the step. `fill = 1` (the default) is the
    optimistic reading that every idle second absorbs a rerouted second. Returns None when some
    stage has no surviving peer (ReCycle cannot continue without a restart).
    """
    D, S, m = sc.layout.data, sc.layout.stage, sc.microbatches
    f = broken.sum(axis=0)
    if np.any(f >= D):
        return None
    w = sc.workload()
    g = make_group(w, sc.partition(S).sizes, D)
    t = g.stage_times()
    pipe0 = float(t.sum() + (m - 1) * t.max())
    idle = pipe0 - m * t
    r = np.ceil(m * f / (D - f)).astype(np.int64)
    extra = np.maximum(0.0, r * t - sc.recycle_bubble_fill * idle)
    sync = max(w.dp_sync_s(gb, int(D - fs)) for gb, fs in zip(g.grad_bytes, f))
    busy = float(D * m * t.sum()) * sc.layout.tensor
    devices = int((D - f).sum()) * sc.layout.tensor
    return RerouteResult(StepTime(pipe0 + float(extra.max()), sync, int(D - f.max())), busy,
                         devices, tuple(int(x) for x in r))


def plan_heterogeneous(
    sc,
    broken: np.ndarray,
    *,
    dvfs: bool | None = None,
    budget_s: float | None = None,
    reroute: bool = True,
    live_devices: int | None = None,
) -> HetPlan:
    """The ElasWave-style plan for a broken mask (see the module docstring).

    Args:
        sc: the `Scenario`.
        broken: `[data, stage]` bool, True where the tensor group has a failed device.
        dvfs: apply the DVFS policy (default: `sc.dvfs`).
        budget_s: planning time budget (default: `sc.planner_budget_s`); the first candidate
            is always completed.
        reroute: also consider the reroute-only (ReCycle-like) candidate.
        live_devices: live devices (for idle energy); default: devices outside broken groups.

    Raises:
        ValueError: when no pipeline can run (every pipeline lost every stage or memory).
    """
    t0 = time.perf_counter()
    dvfs = sc.dvfs if dvfs is None else dvfs
    budget = sc.planner_budget_s if budget_s is None else budget_s
    S, T, M = sc.layout.stage, sc.layout.tensor, sc.total_micro
    w = sc.workload()
    healthy, classes = broken_classes(broken)
    reshapes = [reshape_class(sc, lost, n) for lost, n in classes]
    base = make_group(w, sc.partition(S).sizes, healthy, label="healthy")
    usable = [r for r in reshapes if r.group is not None]
    # Broken pipelines, slowest first: the order in which candidate 2 drops them.
    order = sorted(usable, key=lambda r: (-r.group.fill_and_tau()[1], r.lost))
    n_broken = sum(r.count for r in order)

    def candidate(drop: int):
        groups = [base] if healthy else []
        left = drop
        for r in order:
            k = min(left, r.count)
            left -= k
            if r.count - k:
                groups.append(dataclasses.replace(r.group, count=r.count - k))
        if not groups:
            return None
        g = assign(groups, M)
        return g, step_time(g, w)

    best = None
    evaluated = 0
    for drop in range(n_broken + 1):
        if evaluated and time.perf_counter() - t0 > budget:
            break
        c = candidate(drop)
        evaluated += 1
        if c is not None and (best is None or c[1].total_s < best[2].total_s * (1 - 1e-12)):
            best = ("repartition" if drop == 0 else f"repartition, drop {drop}", c[0], c[1], drop)
    if best is None:
        raise ValueError("no pipeline survives: every pipeline lost all stages or memory")
    choice, groups, st, dropped = best
    dvfs_used = False
    if dvfs:
        options = []
        g2, used = balance(groups, T, sc.power)
        if used:
            options.append(g2)
            # re-spread for the DVFS-adjusted stage times, then balance again from f0
            g3 = assign([dataclasses.replace(g, micro=0) for g in g2], M)
            g4, used4 = balance([dataclasses.replace(g, freq=None) for g in g3], T, sc.power)
            if used4:
                options.append(g4)
        for opt in options:
            st2 = step_time(opt, w)
            if st2.total_s < st.total_s * (1 - 1e-12):
                groups, st, dvfs_used = opt, st2, True
    working = sum(g.count * g.n_stages for g in groups if g.micro > 0) * T
    live = sc.layout.n_devices - int(broken.sum()) * T if live_devices is None else live_devices
    energy = step_energy_j(groups, T, st.total_s, sc.power, max(0, live - working))
    plan = HetPlan(
        groups=tuple(groups), step=st, choice=choice, dropped=dropped,
        moved_bytes=float(sum(r.moved_bytes * r.count for r in usable)),
        blocking_bytes_max=max([r.blocking_bytes for r in usable] or [0.0]) / T,
        in_bytes_max=max([r.max_in_bytes for r in usable] or [0.0]) / T,
        evaluated=evaluated, dvfs_used=dvfs_used, energy_j=energy,
    )
    if reroute and time.perf_counter() - t0 <= budget:
        rr = reroute_step(sc, broken)
        if rr is not None and rr.step.total_s < plan.step.total_s * (1 - 1e-12):
            e = (rr.busy_device_s * sc.power.p_nominal_w
                 + (rr.devices * rr.step.total_s - rr.busy_device_s) * sc.power.p_static_w
                 + max(0, live - rr.devices) * rr.step.total_s * sc.power.p_static_w)
            plan = dataclasses.replace(
                plan, groups=(), step=rr.step, choice="reroute", dropped=0, moved_bytes=0.0,
                blocking_bytes_max=0.0, in_bytes_max=0.0, evaluated=evaluated + 1,
                dvfs_used=False, energy_j=e,
            )
        else:
            plan = dataclasses.replace(plan, evaluated=evaluated + 1)
    return dataclasses.replace(plan, latency_s=time.perf_counter() - t0)


__all__ = [
    "Reshape",
    "HetPlan",
    "RerouteResult",
    "broken_classes",
    "reshape_class",
    "reroute_step",
    "plan_heterogeneous",
]
