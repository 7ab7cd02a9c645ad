"""Minimax contiguous layer partition that prefers the fewest migrated bytes. Pure numpy.

Pipeline stages own contiguous runs of layers. After a membership change a pipeline may have a
different number of stages (or stages of different speeds), and its layers must be split again.
The step time of a pipeline is set by its slowest stage, so the split minimises

    makespan = max_s  (sum of layer costs on stage s) / stage_speed[s]

subject to every stage holding at least one layer and, optionally, a per-stage memory cap.
Among the makespan-optimal splits (within the relative tolerance `MAKESPAN_RTOL`, which only
absorbs floating-point rounding) it returns one that moves the fewest bytes relative to the
current placement; among those, the one with the smallest makespan.

Algorithm: two dynamic programmes over (stage, prefix of layers), each `O(S * L^2)` and
vectorised over the split point with numpy, so `L = 200, S = 64` takes milliseconds:

1. `F[s][j] = min_i max(F[s-1][i], C_s(i, j))` gives the optimal makespan `M*`;
2. with segments restricted to `C_s(i, j) <= M* (1 + MAKESPAN_RTOL)`, a second DP minimises the
   lexicographic pair (moved bytes, makespan). Moved bytes are additive over stages and the
   makespan composes by `max`, both monotone, so the lexicographic minimum of every prefix is
   a prefix of an optimal solution (the principle of optimality holds for this pair).

The rejected alternative, one DP over the weighted sum `makespan + lambda * bytes`, needs a
tuning constant and can trade step time for bytes; ElasWave-style re-planning must not make
the new pipeline slower to save a copy, so makespan is strictly first.

"A layer moves" when the index of the stage that holds it changes (`current` gives the old
layer counts per stage; it may have a different number of stages). When stage indices do not
identify devices (a pipeline that lost its stage 2 keeps old stages 0, 1, 3, ...),
`partition_with_moves` takes the per-(stage, layer) move cost directly.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

MAKESPAN_RTOL = 1e-9  # relative tolerance for "makespan-optimal"; only absorbs float rounding
_BYTES_RTOL = 1e-12  # relative tolerance when comparing moved bytes (prefix-sum rounding)


@dataclasses.dataclass(frozen=True)
class Partition:
    """A contiguous split of layers over stages.

    Attributes:
        sizes: layers per stage, in stage order; every entry >= 1.
        makespan: the slowest stage's time (sum of its layer costs / its speed).
        moved_bytes: bytes of the layers whose stage changes relative to the current placement
            (0 when no current placement was given).
    """

    sizes: tuple[int, ...]
    makespan: float
    moved_bytes: float

    @property
    def n_stages(self) -> int:
        return len(self.sizes)

    def stage_of_layer(self) -> np.ndarray:
        """[n_layers] stage index of every layer."""
        return stage_of_layers(self.sizes)


def stage_of_layers(sizes: Sequence[int]) -> np.ndarray:
    """Stage index of every layer for per-stage layer counts `sizes`."""
    return np.repeat(np.arange(len(sizes)), np.asarray(sizes, dtype=np.int64))


def _as_vector(name: str, values: Sequence[float] | None, n: int, *, positive: bool = False):
    if values is None:
        return None
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got shape {v.shape}")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{name} must be finite")
    if positive and np.any(v <= 0):
        raise ValueError(f"{name} must be > 0 everywhere")
    if not positive and np.any(v < 0):
        raise ValueError(f"{name} must be >= 0 everywhere")
    return v


def _check_common(layer_costs, n_stages, stage_speed, layer_mem, stage_mem_cap):
    costs = np.asarray(layer_costs, dtype=np.float64)
    if costs.ndim != 1 or costs.size == 0:
        raise ValueError("layer_costs must be a non-empty 1-D sequence")
    n = costs.size
    costs = _as_vector("layer_costs", costs, n)
    if not isinstance(n_stages, (int, np.integer)) or isinstance(n_stages, bool):
        raise ValueError(f"n_stages must be an integer, got {n_stages!r}")
    if n_stages < 1:
        raise ValueError(f"n_stages = {n_stages}; allowed values: 1 .. {n} (the layer count)")
    if n_stages > n:
        raise ValueError(
            f"n_stages = {n_stages} exceeds the {n} layers; every stage needs at least one "
            f"layer (allowed values: 1 .. {n})"
        )
    speed = _as_vector("stage_speed", stage_speed, n_stages, positive=True)
    if speed is None:
        speed = np.ones(n_stages)
    mem = _as_vector("layer_mem", layer_mem, n)
    if (mem is None) != (stage_mem_cap is None):
        raise ValueError("layer_mem and stage_mem_cap must be given together")
    if stage_mem_cap is not None and not stage_mem_cap > 0:
        raise ValueError(f"stage_mem_cap must be > 0, got {stage_mem_cap!r}")
    return costs, int(n_stages), speed, mem


def current_move_bytes(
    current: Sequence[int], layer_bytes: Sequence[float] | None, n_stages: int
) -> np.ndarray:
    """[n_stages, n_layers] bytes moved if layer l goes to stage j, given the current layer
    counts per stage `current` (a layer moves when its stage index changes)."""
    cur = np.asarray(current, dtype=np.int64)
    if cur.ndim != 1 or cur.size == 0 or np.any(cur < 0):
        raise ValueError(f"current must be non-negative layer counts per stage, got {current!r}")
    n = int(cur.sum())
    nbytes = np.ones(n) if layer_bytes is None else np.asarray(layer_bytes, dtype=np.float64)
    if nbytes.shape != (n,):
        raise ValueError(f"layer_bytes must have {n} entries (sum of current), got {nbytes.shape}")
    owner = stage_of_layers(cur)
    return np.where(owner[None, :] == np.arange(n_stages)[:, None], 0.0, nbytes[None, :])


def minimax_partition(
    layer_costs: Sequence[float],
    n_stages: int,
    *,
    stage_speed: Sequence[float] | None = None,
    layer_bytes: Sequence[float] | None = None,
    current: Sequence[int] | None = None,
    layer_mem: Sequence[float] | None = None,
    stage_mem_cap: float | None = None,
) -> Partition:
    """Split layers contiguously over `n_stages` stages minimising the slowest stage's time.

    Args:
        layer_costs: time of each layer on a stage of speed 1 (e.g. fwd+bwd per micro-batch).
        n_stages: number of stages, 1 .. len(layer_costs).
        stage_speed: relative speed of each stage (time = cost / speed); default all 1.
        layer_bytes: bytes that move with each layer (parameters + optimizer state); default 1
            per layer, so moved_bytes counts moved layers.
        current: current layer counts per stage (any number of stages, summing to the layer
            count); when given, ties in makespan are broken by the fewest moved bytes.
        layer_mem: memory each layer needs on its stage; with `stage_mem_cap`, a stage whose
            layers exceed the cap is infeasible.
        stage_mem_cap: per-stage memory capacity (same units as `layer_mem`).

    Returns:
        The `Partition`: sizes, makespan and moved bytes (0 without `current`).

    Raises:
        ValueError: for impossible input (n_stages < 1 or > layers, mismatched lengths,
            negative costs, non-positive speeds, `current` not summing to the layer count) or
            when no split satisfies the memory cap.
    """
    costs, s, _, _ = _check_common(layer_costs, n_stages, stage_speed, layer_mem, stage_mem_cap)
    move = None
    if current is not None:
        if int(np.sum(current)) != costs.size:
            raise ValueError(
                f"current sums to {int(np.sum(current))} layers but layer_costs has {costs.size}"
            )
        move = current_move_bytes(current, layer_bytes, s)
    elif layer_bytes is not None:
        _as_vector("layer_bytes", layer_bytes, costs.size)
    return partition_with_moves(
        costs, s, stage_speed=stage_speed, move_bytes=move, layer_mem=layer_mem,
        stage_mem_cap=stage_mem_cap,
    )


def partition_with_moves(
    layer_costs: Sequence[float],
    n_stages: int,
    *,
    stage_speed: Sequence[float] | None = None,
    move_bytes: np.ndarray | None = None,
    layer_mem: Sequence[float] | None = None,
    stage_mem_cap: float | None = None,
) -> Partition:
    """`minimax_partition` with an explicit move cost: `move_bytes[j, l]` is what it costs to
    put layer l on new stage j (0 if it is already there). Same semantics otherwise."""
    costs, S, speed, mem = _check_common(layer_costs, n_stages, stage_speed, layer_mem,
                                         stage_mem_cap)
    L = costs.size
    if move_bytes is None:
        move_bytes = np.zeros((S, L))
    move_bytes = np.asarray(move_bytes, dtype=np.float64)
    if move_bytes.shape != (S, L):
        raise ValueError(f"move_bytes must have shape {(S, L)}, got {move_bytes.shape}")
    pc = np.concatenate([[0.0], np.cumsum(costs)])
    seg = pc[None, :] - pc[:, None]  # seg[i, j] = cost of layers i .. j-1
    valid = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)  # i < j: at least one layer
    if mem is not None:
        pm = np.concatenate([[0.0], np.cumsum(mem)])
        valid &= (pm[None, :] - pm[:, None]) <= stage_mem_cap * (1 + 1e-12)
    inf = np.inf

    # Phase 1: optimal makespan.
    f = np.full(L + 1, inf)
    f[0] = 0.0
    for j in range(S):
        c = np.where(valid, seg / speed[j], inf)
        f = np.min(np.maximum(f[:, None], c), axis=0)
    best = f[L]
    if not np.isfinite(best):
        raise ValueError(
            f"no split of {L} layers over {S} stages satisfies stage_mem_cap = {stage_mem_cap} "
            f"(largest single layer needs {float(np.max(mem)) if mem is not None else 0.0})"
        )
    thr = best * (1 + MAKESPAN_RTOL) + 1e-300

    # Phase 2: fewest moved bytes, then smallest makespan, among segments within the bound.
    total_bytes = float(np.abs(move_bytes).sum()) or 1.0
    gb = np.full(L + 1, inf)
    gm = np.full(L + 1, inf)
    gb[0], gm[0] = 0.0, 0.0
    back = np.zeros((S, L + 1), dtype=np.int64)
    for j in range(S):
        c = seg / speed[j]
        ok = valid & (c <= thr)
        pb = np.concatenate([[0.0], np.cumsum(move_bytes[j])])
        bmat = np.where(ok, gb[:, None] + (pb[None, :] - pb[:, None]), inf)
        bmin = np.min(bmat, axis=0)
        near = bmat <= bmin[None, :] + _BYTES_RTOL * total_bytes
        mmat = np.where(near & ok, np.maximum(gm[:, None], c), inf)
        arg = np.argmin(mmat, axis=0)
        back[j] = arg
        cols = np.arange(L + 1)
        gb = bmat[arg, cols]
        gm = mmat[arg, cols]
    sizes = []
    end = L
    for j in range(S - 1, -1, -1):
        start = int(back[j, end])
        sizes.append(end - start)
        end = start
    sizes = tuple(reversed(sizes))
    return _evaluate(costs, speed, move_bytes, sizes)


def _evaluate(costs, speed, move_bytes, sizes) -> Partition:
    owner = stage_of_layers(sizes)
    times = np.bincount(owner, weights=costs, minlength=len(sizes)) / speed
    moved = float(move_bytes[owner, np.arange(costs.size)].sum())
    return Partition(tuple(int(x) for x in sizes), float(times.max()), moved)


def brute_force_partition(
    layer_costs: Sequence[float],
    n_stages: int,
    *,
    stage_speed: Sequence[float] | None = None,
    layer_bytes: Sequence[float] | None = None,
    current: Sequence[int] | None = None,
    layer_mem: Sequence[float] | None = None,
    stage_mem_cap: float | None = None,
) -> Partition:
    """Exhaustive reference for `minimax_partition` (same arguments and selection rule); for
    tests on small inputs only (it enumerates all C(L-1, S-1) splits)."""
    costs, S, speed, mem = _check_common(layer_costs, n_stages, stage_speed, layer_mem,
                                         stage_mem_cap)
    L = costs.size
    if current is not None:
        if int(np.sum(current)) != L:
            raise ValueError(f"current sums to {int(np.sum(current))} layers but there are {L}")
        move = current_move_bytes(current, layer_bytes, S)
    else:
        move = np.zeros((S, L))
    options = []
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        sizes = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        if mem is not None:
            owner = stage_of_layers(sizes)
            if np.any(np.bincount(owner, weights=mem, minlength=S) > stage_mem_cap * (1 + 1e-12)):
                continue
        options.append(_evaluate(costs, speed, move, sizes))
    if not options:
        raise ValueError(f"no split of {L} layers over {S} stages satisfies stage_mem_cap")
    best = min(p.makespan for p in options)
    thr = best * (1 + MAKESPAN_RTOL) + 1e-300
    near = [p for p in options if p.makespan <= thr]
    fewest = min(p.moved_bytes for p in near)
    total = float(np.abs(move).sum()) or 1.0
    near = [p for p in near if p.moved_bytes <= fewest + _BYTES_RTOL * total]
    return min(near, key=lambda p: p.makespan)


__all__ = [
    "MAKESPAN_RTOL",
    "Partition",
    "minimax_partition",
    "partition_with_moves",
    "brute_force_partition",
    "current_move_bytes",
    "stage_of_layers",
]
