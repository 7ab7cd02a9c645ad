"""ZeRO's partition over `data`: which pieces of a row each data rank stores, tier by tier, and
how that layout evolves when ranks leave. The storage the layout describes, and the codec between
a parameter-shaped tree and it, are `elasjax.layout.storage`.

ZeRO-1/2/3 keep some state (optimizer moments; for ZeRO-3 also parameters) *partitioned* over
the `data` axis: each data rank stores a disjoint part. Partitions must work for any data degree,
including the uneven survivor counts of an elastic run (7, 5, 3 ...), which a plain
`PartitionSpec` over a parameter dimension cannot do (64 rows do not split over 7 ranks). So the
partitioned state lives in a *storage layout* of its own:

Elastic transitions (see `evolve`): with `interleaved`, `K = lcm(1..D0)` pieces per row for
D0 <= 10, so any data degree up to the initial one divides the pieces evenly, and `K = 64 * D0`
beyond, so that a rank's share is at most one piece (1/64) over the ideal. When ranks leave and
the others keep their tensor groups, every surviving rank keeps all of its tiers *in place* (the
new global arrays are assembled from the very same buffers) and the departed ranks' pieces,
restored from the snapshot pool, are dealt out in contiguous runs to the survivors in one new
tier, as narrow as the orphans allow. Recovery is then a set of disjoint rank-to-rank copies of
exactly the lost bytes. Every rank allocates every slot of every tier, so each in-place shrink
costs up to one extra slot per rank: when that would put a rank over `MAX_STORAGE_RATIO` (1.05)
times the ideal `total / D`, or the tiers are used up, the layout is rebuilt instead (1024 ranks
losing one at a time re-lay out every third or fourth loss; see tests/test_zero.py). An evolved
layout's row is reassembled from its runs after the gather (one more copy of the row per step
until a re-layout). With `contiguous`, a unit is cut into one piece per rank; losing a rank
shifts every boundary, so almost all bytes move (an all-to-all), which is what the benchmark
contrasts. A change of tensor degree, a new device in a group, or a rebuild re-lays out
everything: all bytes are re-partitioned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import reduce

MAX_TIERS = 4
MAX_PIECES = 2520  # lcm(1..10)
PIECES_PER_RANK = 64  # beyond lcm(1..d0) <= MAX_PIECES: K = 64 * d0
# An in-place evolution whose ranks would allocate more than this times the ideal share
# (`n_pieces / data` pieces) re-lays out instead (all bytes move, overhead <= 1 + 1/64).
MAX_STORAGE_RATIO = 1.05


def piece_count(d0: int) -> int:
    """Pieces per row for an initial data degree `d0`: lcm(1..d0) while that is at most
    `MAX_PIECES` (every smaller data degree divides it: shrinks stay exactly balanced), else
    `PIECES_PER_RANK * d0`, fine enough that a rank's share after any shrink is within
    1 + 1/64 of the ideal before the tiers' rounding (see `MAX_STORAGE_RATIO`)."""
    k = reduce(math.lcm, range(1, min(d0, 11) + 1), 1)
    return k if k <= MAX_PIECES else PIECES_PER_RANK * d0


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    """Which base piece each data rank stores, tier by tier. Hashable: part of a `Plan`."""

    kind: str  # "interleaved" | "contiguous"
    stage: int  # 1, 2, 3
    n_pieces: int  # K
    tiers: tuple[tuple[tuple[int, ...], ...], ...]  # tier -> rank -> slot -> base piece (-1 empty)

    @property
    def data(self) -> int:
        return len(self.tiers[0])

    def rank_pieces(self, rank: int) -> list[int]:
        return [k for t in self.tiers for k in t[rank] if k >= 0]

    def check(self) -> None:
        seen = sorted(k for r in range(self.data) for k in self.rank_pieces(r))
        if seen != list(range(self.n_pieces)):
            raise AssertionError("zero layout does not hold every piece exactly once")
        for t in self.tiers:
            if len({len(slots) for slots in t}) != 1:
                raise AssertionError("a tier must have the same slot count on every rank")


def fresh_layout(kind: str, stage: int, data: int, n_pieces: int | None = None) -> ZeroLayout:
    """Balanced single-tier layout: rank r holds a contiguous run of pieces."""
    k = data if kind == "contiguous" else (n_pieces or piece_count(data))
    per = -(-k // data)
    tier = tuple(tuple(p if p < k else -1 for p in range(r * per, (r + 1) * per)) for r in range(data))
    lay = ZeroLayout(kind, stage, k, (tier,))
    lay.check()
    return lay


def evolve(old: ZeroLayout, kept: dict[int, int], new_data: int) -> tuple[ZeroLayout, bool]:
    """The layout after a membership change.

    `kept` maps new rank -> old rank for ranks whose devices (tensor group) are unchanged. When
    every new rank is kept (a pure shrink), their tiers stay in place and the pieces of departed
    ranks are dealt out, in contiguous runs, to balance the ranks in one new tier. Otherwise the
    layout is rebuilt from scratch, as it is when the tiers are used up or the in-place layout
    would allocate more than `MAX_STORAGE_RATIO` times the ideal share. Returns
    (layout, in_place).
    """
    if old.kind == "contiguous" or len(kept) != new_data or len(old.tiers) >= MAX_TIERS:
        return fresh_layout(old.kind, old.stage, new_data, old.n_pieces), False
    keep_old = set(kept.values())
    orphans = [k for r in range(old.data) if r not in keep_old for k in old.rank_pieces(r)]
    counts = [len(old.rank_pieces(kept[j])) for j in range(new_data)]
    # Every rank allocates every slot of every tier, so the new tier is as narrow as the orphans
    # allow (ceil(orphans / ranks)); within it, the ranks holding the fewest pieces fill first.
    width = -(-len(orphans) // new_data)
    quota = _water_fill(counts, len(orphans), width)
    new_tier, pos = [], 0
    for j in range(new_data):
        take = orphans[pos : pos + quota[j]]
        pos += len(take)
        new_tier.append(tuple(take) + (-1,) * (width - len(take)))
    assert pos == len(orphans), "orphan pieces left over"
    tiers = tuple(tuple(t[kept[j]] for j in range(new_data)) for t in old.tiers)
    if width:
        tiers = tiers + (tuple(new_tier),)
    lay = ZeroLayout(old.kind, old.stage, old.n_pieces, tiers)
    lay.check()
    if storage_ratio(lay) > MAX_STORAGE_RATIO:
        return fresh_layout(old.kind, old.stage, new_data, old.n_pieces), False
    return lay, True


def _water_fill(counts: Sequence[int], n: int, cap: int) -> list[int]:
    """Quotas q (0 <= q_j <= cap, sum n) that raise the lowest counts first."""
    lo, hi = min(counts), max(counts) + cap
    while lo < hi:  # the lowest level L at which clamp(L - c, 0, cap) holds n pieces
        mid = (lo + hi) // 2
        if sum(min(cap, max(0, mid - c)) for c in counts) >= n:
            hi = mid
        else:
            lo = mid + 1
    q = [min(cap, max(0, lo - c)) for c in counts]
    extra = sum(q) - n
    for j in range(len(q)):  # ranks at the level give one back until the total is exact
        if extra == 0:
            break
        if q[j] and counts[j] + q[j] == lo:
            q[j] -= 1
            extra -= 1
    return q


def storage_ratio(layout: ZeroLayout) -> float:
    """Slots every rank allocates over the ideal share `n_pieces / data` (1.0 = no overhead)."""
    return sum(len(t[0]) for t in layout.tiers) * layout.data / layout.n_pieces


def kept_ranks(old_groups: Sequence[tuple[int, ...]], new_groups: Sequence[tuple[int, ...]]):
    """new rank -> old rank for tensor groups that are unchanged."""
    index = {g: i for i, g in enumerate(old_groups)}
    return {j: index[g] for j, g in enumerate(new_groups) if g in index}
