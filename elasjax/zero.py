"""ZeRO as a transform of the storage layout: piece partitions, tiers, and the codec.

ZeRO-1/2/3 keep some state (optimizer moments; for ZeRO-3 also parameters) *partitioned* over
the `data` axis: each data rank stores a disjoint part. Partitions must work for any data degree,
including the uneven survivor counts of an elastic run (7, 5, 3 ...), which a plain
`PartitionSpec` over a parameter dimension cannot do (64 rows do not split over 7 ranks). So the
partitioned state lives in a *storage layout* of its own:

- A **unit** is what gets partitioned on its own. `interleaved`: every parameter leaf is a unit
  (a stacked-layer leaf is partitioned per layer, so ZeRO-3 can gather one layer at a time).
  `contiguous` (the Megatron/DeepSpeed distributed-optimizer layout): all tensor-sharded leaves
  form one flat buffer and all other leaves another.
- A unit's elements in *canonical order* (the tensor-sharded dimension moved first, then
  row-major) form `rows` rows (one per tensor rank; 1 for units replicated over `tensor`). Each
  row is cut into `K` equal **pieces** (the last padded with zeros).
- The **tiers** say which piece each data rank stores in each slot: storage tier `i` of a unit
  is an array `[*layers, data, slots_i, rows, piece]` sharded over `data` (and `tensor` on the
  rows). A table entry of -1 is an empty slot (zeros).

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
losing one at a time re-lay out every third or fourth loss; see tests/test_zero.py). With
`contiguous`, a unit is cut into one piece per rank; losing a rank shifts every boundary, so
almost all bytes move (an all-to-all), which is what the benchmark contrasts. A change of tensor
degree, a new device in a group, or a rebuild re-lays out everything: all bytes are
re-partitioned.

Pieces are padded and empty slots are zero. Adam keeps zeros zero (zero gradient, zero moment,
zero update, and weight decay of zero is zero), so padding never leaks into real values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import reduce
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .mesh import DATA, TENSOR, LOGICAL_RULES
from .sharding import path_str

PyTree = Any
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


# ---------------------------------------------------------------------------------------------
# Units and the codec.


@dataclasses.dataclass(frozen=True)
class Member:
    """A parameter leaf inside a unit."""

    path: str
    shape: tuple[int, ...]
    tdim: int | None  # dimension sharded over `tensor` (full-leaf index), if any
    stacked: bool  # leading `layers` axis partitioned per layer (interleaved units only)
    row_offset: int  # where the member starts inside a unit row
    full_offset: int  # where the member starts in the unit's canonical order (all rows)

    @property
    def inner_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape

    @property
    def size(self) -> int:
        return math.prod(self.inner_shape)


@dataclasses.dataclass(frozen=True)
class Unit:
    name: str
    members: tuple[Member, ...]
    rows: int
    tensor_sharded: bool
    layers: int  # 0 = no per-layer batch axis
    row_len: int  # real elements per row
    piece: int  # elements per piece
    rotation: int  # piece offset (interleaved: rotating start rank)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return (self.layers,) if self.layers else ()


class ZeroCodec:
    """Converts parameter-shaped trees to and from storage tiers for one plan."""

    def __init__(
        self,
        abstract_params: PyTree,
        logical: PyTree,
        layout: ZeroLayout,
        tensor: int,
        layer_ids: np.ndarray | None = None,
        layer_axis: str | None = None,
    ):
        """`layer_ids` (pipelines): the global layer id of each index of the stacked `layers`
        axis (-1 = an empty slot), when that axis holds pipeline slots `[S * Lmax]` rather than
        layers in order; `layer_axis` is the mesh axis it is sharded over (`stage`)."""
        self.layout, self.tensor = layout, tensor
        self.layer_ids, self.layer_axis = layer_ids, layer_axis
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
        specs = self.treedef.flatten_up_to(logical)
        K = layout.n_pieces
        infos = []
        for (path, x), spec in zip(flat, specs):
            names = tuple(spec) + (None,) * (len(x.shape) - len(spec))
            tdims = [i for i, n in enumerate(names) if n and LOGICAL_RULES.get(n) == TENSOR]
            if len(tdims) > 1:
                raise ValueError(f"parameter '{path_str(path)}' is sharded over tensor twice")
            stacked = bool(names) and names[0] == "layers"
            infos.append((path_str(path), tuple(x.shape), tdims[0] if tdims else None, stacked))
        self.paths = [i[0] for i in infos]
        units = []
        if layout.kind == "interleaved":
            for idx, (p, shape, tdim, stacked) in enumerate(infos):
                rows = tensor if tdim is not None else 1
                m = Member(p, shape, tdim, stacked, 0, 0)
                row_len = m.size // rows
                # Rotate each leaf's start so that its padded last piece, and the leaves' first
                # pieces, spread over the ranks. Independent of the data degree, so a rank keeps
                # the same pieces across plans.
                rot = (idx * K // len(infos)) % K
                units.append(
                    Unit(p, (m,), rows, tdim is not None, shape[0] if stacked else 0, row_len,
                         -(-row_len // K), rot)
                )
        else:
            for sharded in (True, False):
                group = [i for i in infos if (i[2] is not None) == sharded]
                if not group:
                    continue
                rows = tensor if sharded else 1
                members, roff, foff = [], 0, 0
                for p, shape, tdim, _ in group:
                    m = Member(p, shape, tdim, False, roff, foff)
                    members.append(m)
                    roff += m.size // rows
                    foff += m.size
                name = "buffer:tensor" if sharded else "buffer:replicated"
                units.append(Unit(name, tuple(members), rows, sharded, 0, roff, -(-roff // K), 0))
        self.units = units
        self._member_unit = {m.path: u for u in units for m in u.members}
        self.tables = [
            np.asarray(t, dtype=np.int32).reshape(layout.data, -1) for t in layout.tiers
        ]

    # -- canonical piece view -----------------------------------------------------------------

    def _member_rows(self, m: Member, x: jax.Array, rows: int) -> jax.Array:
        """[*layers, rows, size/rows] in canonical order."""
        lead = 1 if m.stacked else 0
        if m.tdim is not None:
            x = jnp.moveaxis(x, m.tdim, lead)
        return x.reshape(x.shape[:lead] + (rows, m.size // rows))

    def _canon(self, u: Unit, leaves: dict[str, jax.Array]) -> jax.Array:
        """[*layers, K + 1, rows, piece]: the unit cut into pieces, plus one zero piece (the
        source of empty slots)."""
        parts = [self._member_rows(m, leaves[m.path], u.rows) for m in u.members]
        row = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        K = self.layout.n_pieces
        pad = (K + 1) * u.piece - u.row_len
        row = jnp.pad(row, [(0, 0)] * (row.ndim - 1) + [(0, pad)])
        b = len(u.batch_shape)
        row = row.reshape(row.shape[:-1] + (K + 1, u.piece))  # [*b, rows, K+1, piece]
        return jnp.moveaxis(row, b, b + 1)  # [*b, K+1, rows, piece]

    def _uncanon(self, u: Unit, canon: jax.Array) -> dict[str, jax.Array]:
        b = len(u.batch_shape)
        row = jnp.moveaxis(canon, b + 1, b)  # [*b, rows, K, piece]
        row = row.reshape(row.shape[: b + 1] + (-1,))[..., : u.row_len]
        out = {}
        for m in u.members:
            seg = row[..., m.row_offset : m.row_offset + m.size // u.rows]
            lead = 1 if m.stacked else 0
            inner = list(m.inner_shape)
            if m.tdim is not None:
                td = m.tdim - lead
                moved = [inner[td]] + inner[:td] + inner[td + 1 :]
                x = seg.reshape(seg.shape[:lead] + tuple(moved))
                x = jnp.moveaxis(x, lead, m.tdim)
            else:
                x = seg.reshape(seg.shape[:lead] + tuple(inner))
            out[m.path] = x
        return out

    def _rotated(self, u: Unit, tier: int) -> np.ndarray:
        t = self.tables[tier]
        K = self.layout.n_pieces
        return np.where(t >= 0, (t + u.rotation) % K, K).astype(np.int32)

    # -- tree <-> storage -----------------------------------------------------------------------

    def to_storage(self, params: PyTree) -> dict[str, tuple[jax.Array, ...]]:
        """Parameter-shaped tree -> storage tiers: one static gather per tier (XLA compiled this
        about 2x faster than the equivalent runs of slices, measured on the CPU backend)."""
        leaves = dict(zip(self.paths, self.treedef.flatten_up_to(params)))
        out = {}
        for u in self.units:
            canon = self._canon(u, leaves)
            b = len(u.batch_shape)
            out[u.name] = tuple(
                jnp.take(canon, jnp.asarray(self._rotated(u, i)), axis=b)
                for i in range(len(self.tables))
            )
        return out

    def unit_from_storage(self, u: Unit, tiers: Sequence[jax.Array]) -> dict[str, jax.Array]:
        """Full member leaves of one unit from its storage tiers (tiers may lack the layer axis
        when called per layer): all slots side by side, then one static gather in piece order."""
        b = tiers[0].ndim - 4
        K = self.layout.n_pieces
        widths = [t.shape[1] for t in self.tables]
        width, offs = sum(widths), np.cumsum([0] + widths)
        pos = np.zeros(K, np.int32)
        for i in range(len(self.tables)):
            r, sl = np.nonzero(self.tables[i] >= 0)
            pos[self._rotated(u, i)[r, sl]] = r * width + offs[i] + sl
        allslots = jnp.concatenate(tiers, axis=b + 1) if len(tiers) > 1 else tiers[0]
        flat = allslots.reshape(allslots.shape[:b] + (-1,) + allslots.shape[b + 2 :])
        canon = jnp.take(flat, jnp.asarray(pos), axis=b)
        if b == 0 and u.layers:  # per-layer call on a stacked unit
            u = dataclasses.replace(u, layers=0, members=tuple(
                dataclasses.replace(m, stacked=False, shape=m.inner_shape,
                                    tdim=None if m.tdim is None else m.tdim - 1)
                for m in u.members))
        zero = jnp.zeros(canon.shape[:b] + (1,) + canon.shape[b + 1 :], canon.dtype)
        return self._uncanon(u, jnp.concatenate([canon, zero], axis=b))

    def from_storage(self, storage: dict[str, Sequence[jax.Array]]) -> PyTree:
        leaves = {}
        for u in self.units:
            leaves.update(self.unit_from_storage(u, storage[u.name]))
        return jax.tree_util.tree_unflatten(self.treedef, [leaves[p] for p in self.paths])

    def zero3_inputs(self, storage: dict) -> tuple[PyTree, Any]:
        """ZeRO-3 forward inputs: (parameters with every non-layer leaf gathered and `layers`
        left as the stacked storage of the per-layer units, a per-layer gather function for the
        model's layer loop). With the contiguous layout layers are not separable, so the whole
        model is gathered at once and the gather function is None."""
        stacked = [u for u in self.units if u.layers]
        if not stacked:
            return self.from_storage(storage), None
        leaves = {}
        for u in self.units:
            if not u.layers:
                leaves.update(self.unit_from_storage(u, storage[u.name]))
        params = _nest(leaves)
        params["layers"] = {u.name: tuple(storage[u.name]) for u in stacked}

        def gather_layer(layer_storage: dict) -> PyTree:
            out = {}
            for u in stacked:
                out.update(self.unit_from_storage(u, layer_storage[u.name]))
            return _nest({p.split("/", 1)[1]: x for p, x in out.items()})

        return params, gather_layer

    # -- abstract storage and shardings ---------------------------------------------------------

    def abstract_storage(self, dtype=jnp.float32) -> dict[str, tuple[jax.ShapeDtypeStruct, ...]]:
        return {
            u.name: tuple(
                jax.ShapeDtypeStruct(
                    u.batch_shape + (self.layout.data, t.shape[1], u.rows, u.piece), dtype
                )
                for t in self.tables
            )
            for u in self.units
        }

    def storage_spec(self, u: Unit) -> PartitionSpec:
        lead = [self.layer_axis] if u.batch_shape else []
        return PartitionSpec(*lead, DATA, None, TENSOR if u.tensor_sharded else None, None)

    def storage_shardings(self, mesh: Mesh) -> dict[str, tuple[NamedSharding, ...]]:
        return {
            u.name: tuple(NamedSharding(mesh, self.storage_spec(u)) for _ in self.tables)
            for u in self.units
        }

    def stacked_layer_ids(self, u: Unit) -> np.ndarray:
        """Global layer id of each index of a stacked unit's layer axis (-1 = empty slot)."""
        return self.layer_ids if self.layer_ids is not None else np.arange(u.layers)

    def unit(self, name: str) -> Unit:
        return next(u for u in self.units if u.name == name)

    # -- canonical checksums ---------------------------------------------------------------------

    def canonical_index(self, u: Unit, tier: int) -> tuple[jax.Array, jax.Array]:
        """(uint32 canonical index, valid mask) of every element of a storage tier, computed
        with iota arithmetic (no big constants): layout-independent element identities."""
        rot = jnp.asarray(self._rotated(u, tier))  # [D, S]
        D, S = self.tables[tier].shape
        valid_slot = jnp.asarray(self.tables[tier] >= 0)
        shape = u.batch_shape + (D, S, u.rows, u.piece)
        b = len(u.batch_shape)
        k = jnp.broadcast_to(rot.reshape((1,) * b + (D, S, 1, 1)), shape).astype(jnp.uint32)
        ok = jnp.broadcast_to(valid_slot.reshape((1,) * b + (D, S, 1, 1)), shape)
        r = jax.lax.broadcasted_iota(jnp.uint32, shape, b + 2)
        j = jax.lax.broadcasted_iota(jnp.uint32, shape, b + 3)
        pos = k * jnp.uint32(u.piece) + j  # position inside the row
        ok = ok & (pos < jnp.uint32(u.row_len))
        total_rows = jnp.uint32(u.rows * u.row_len)
        if len(u.members) == 1:
            g = r * jnp.uint32(u.row_len) + pos
        else:
            starts = np.array([m.row_offset for m in u.members], np.uint32)
            m_idx = jnp.searchsorted(jnp.asarray(starts), pos, side="right") - 1
            sizes = np.array([m.size // u.rows for m in u.members], np.uint32)
            full = np.array([m.full_offset for m in u.members], np.uint32)
            g = (
                jnp.asarray(full)[m_idx]
                + r * jnp.asarray(sizes)[m_idx]
                + (pos - jnp.asarray(starts)[m_idx])
            )
        if b:
            layer = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
            if self.layer_ids is not None:  # pipeline slots: the layer each slot holds
                layer = jnp.take(jnp.asarray(self.layer_ids, jnp.int32), layer)
                ok = ok & (layer >= 0)
            g = g + layer.astype(jnp.uint32) * total_rows
        return g, ok


def _nest(flat: dict[str, Any]) -> dict:
    """{'a/b': x} -> {'a': {'b': x}}."""
    out: dict = {}
    for path, x in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = x
    return out


def kept_ranks(old_groups: Sequence[tuple[int, ...]], new_groups: Sequence[tuple[int, ...]]):
    """new rank -> old rank for tensor groups that are unchanged."""
    index = {g: i for i, g in enumerate(old_groups)}
    return {j: index[g] for j, g in enumerate(new_groups) if g in index}
