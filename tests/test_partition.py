"""The minimax layer partition against exhaustive search, and its error messages."""

import numpy as np
import pytest

from elasjax.core.partition import (
    MAKESPAN_RTOL,
    Partition,
    brute_force_partition,
    minimax_partition,
    partition_with_moves,
)


def _random_case(rng, trial):
    L = int(rng.integers(1, 10))
    S = int(rng.integers(1, L + 1))
    costs = rng.integers(1, 5, L).astype(float) if trial % 2 else rng.random(L)
    kw = {}
    if trial % 3 == 0:
        kw["stage_speed"] = rng.uniform(0.5, 2.0, S)
    if trial % 4 != 0:
        s0 = int(rng.integers(1, L + 1))
        cuts = sorted(rng.choice(np.arange(1, L), s0 - 1, replace=False)) if s0 > 1 else []
        bounds = (0, *cuts, L)
        kw["current"] = [int(b - a) for a, b in zip(bounds[:-1], bounds[1:])]
        kw["layer_bytes"] = rng.integers(1, 4, L).astype(float)
    if trial % 5 == 0:
        kw["layer_mem"] = rng.random(L)
        kw["stage_mem_cap"] = float(rng.uniform(0.5, 3.0))
    return costs, S, kw


def _solve(fn, costs, S, kw):
    try:
        return fn(costs, S, **kw)
    except ValueError as e:
        return str(e)


def test_matches_brute_force_on_random_cases():
    rng = np.random.default_rng(0)
    for trial in range(300):
        costs, S, kw = _random_case(rng, trial)
        a = _solve(minimax_partition, costs, S, kw)
        b = _solve(brute_force_partition, costs, S, kw)
        assert isinstance(a, str) == isinstance(b, str), (trial, a, b)
        if isinstance(a, str):
            continue
        assert sum(a.sizes) == len(costs) and min(a.sizes) >= 1 and len(a.sizes) == S
        assert a.makespan == pytest.approx(b.makespan, rel=1e-9), (trial, a, b)
        assert a.moved_bytes == pytest.approx(b.moved_bytes, abs=1e-9), (trial, a, b)


def test_even_costs_split_evenly():
    p = minimax_partition([1.0] * 12, 4)
    assert p == Partition((3, 3, 3, 3), 3.0, 0.0)
    assert max(minimax_partition([1.0] * 13, 3).sizes) == 5


def test_prefers_fewest_moved_bytes_among_optimal():
    # 6 unit layers on 3 stages: every optimal split is 2/2/2 except via the current layout.
    costs = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    p = minimax_partition(costs, 2, current=[3, 3], layer_bytes=[1.0] * 6)
    assert p.sizes == (3, 3) and p.moved_bytes == 0.0
    # Makespan comes first: a cheaper move that is slower is not taken.
    p = minimax_partition([1.0, 1.0, 1.0, 1.0], 2, current=[1, 3], layer_bytes=[1.0] * 4)
    assert p.sizes == (2, 2) and p.makespan == 2.0 and p.moved_bytes == 1.0


def test_ties_within_tolerance_pick_fewer_bytes():
    costs = [1.0, 1.0 + MAKESPAN_RTOL / 10, 1.0, 1.0]
    p = minimax_partition(costs, 2, current=[2, 2], layer_bytes=[5.0] * 4)
    assert p.sizes == (2, 2) and p.moved_bytes == 0.0


def test_current_with_different_stage_count_and_speeds():
    # Shrinking 4 stages to 3: layers of old stage 3 must move; the rest need not.
    p = minimax_partition([1.0] * 8, 3, current=[2, 2, 2, 2], layer_bytes=[1.0] * 8)
    q = brute_force_partition([1.0] * 8, 3, current=[2, 2, 2, 2], layer_bytes=[1.0] * 8)
    assert (p.makespan, p.moved_bytes) == (q.makespan, q.moved_bytes)
    fast = minimax_partition([1.0] * 9, 2, stage_speed=[2.0, 1.0])
    assert fast.sizes == (6, 3) and fast.makespan == 3.0


def test_memory_cap_makes_stages_infeasible():
    free = minimax_partition([1.0] * 4, 2)
    capped = minimax_partition([1.0] * 4, 2, layer_mem=[3, 1, 1, 1], stage_mem_cap=3.0)
    assert free.sizes == (2, 2) and capped.sizes == (1, 3) and capped.makespan == 3.0
    with pytest.raises(ValueError, match="stage_mem_cap"):
        minimax_partition([1.0] * 4, 2, layer_mem=[3, 3, 3, 3], stage_mem_cap=5.0)


def test_explicit_move_matrix():
    move = np.array([[0.0, 0.0, 9.0, 9.0], [9.0, 9.0, 0.0, 0.0]])
    p = partition_with_moves([1.0, 1.0, 1.0, 1.0], 2, move_bytes=move)
    assert p.sizes == (2, 2) and p.moved_bytes == 0.0


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([1.0, 1.0], 3), {}, "exceeds the 2 layers"),
        (([1.0, 1.0], 0), {}, "allowed values: 1 .. 2"),
        (([], 1), {}, "non-empty"),
        (([1.0, -1.0], 1), {}, "layer_costs must be >= 0"),
        (([1.0, 1.0], 2), {"stage_speed": [1.0]}, "stage_speed must have 2 entries"),
        (([1.0, 1.0], 2), {"stage_speed": [1.0, 0.0]}, "stage_speed must be > 0"),
        (([1.0, 1.0], 1), {"current": [1, 2]}, "current sums to 3"),
        (([1.0, 1.0], 1), {"stage_mem_cap": 1.0}, "together"),
        (([1.0, 1.0], 1.5), {}, "must be an integer"),
    ],
)
def test_impossible_input_raises(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        minimax_partition(*args, **kwargs)
