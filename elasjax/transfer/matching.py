"""Matching a transition's destination shards to their sources, leaf by leaf
(`reshard.plan_transition` calls it for every leaf of the new layout).

A regular array is matched by *box*: each destination box is covered by the boxes of the old
shards and the extra sources (snapshots, a checkpoint), cut into cells where no single source
covers it (`plan_box_leaf`); where pipeline slots moved, layer by layer (`plan_layered_leaf`). A
ZeRO storage leaf (`elasjax.layout.storage`) is matched by *element identities*: a rank that keeps
its pieces of a tier in place reuses its buffer, the others take element ranges from the old
storage, indexed once per family of leaves, in row identities where both plans hold the same rows
(`plan_storage_shard`) or in the full leaves' (`plan_storage_shard_leaf`). Every piece gets
exactly one source, the cheapest rung first (`Picker`); a piece no source holds raises
`UnrecoverableStateError` naming the leaf and the slice.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .copies import Copy, DstShard
from .shards import (
    RUNG_ORDER,
    Box,
    Shard,
    ShardStore,
    TransferLog,
    UnrecoverableStateError,
    box_size,
    cells,
    contains,
    index_to_box,
)

PyTree = Any


class Picker:
    """Chooses one source per piece: the destination itself, else the cheapest rung, then a
    source in the destination's process (`where`: device -> process), then the least-loaded
    sender. Deterministic, so every process picks the same sources."""

    def __init__(self, where: Callable[[Any], int] | None = None):
        self.load: dict = defaultdict(int)
        self.where = where or (lambda _: 0)

    def pick(self, holders: Sequence[Shard], dst: int, nbytes: int) -> Shard:
        for s in holders:
            if s.device == dst:
                return s
        home = self.where(dst)
        best = min(
            holders,
            key=lambda s: (
                RUNG_ORDER[s.rung], self.where(s.device) != home, self.load[s.device], str(s.device)
            ),
        )
        self.load[best.device] += nbytes
        return best


def _rel(cell: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(c0 - o0, c1 - o0) for (c0, c1), (o0, _) in zip(cell, origin))


def plan_box_leaf(
    path: str, itemsize: int, sources: list[Shard], dst: DstShard, box: Box, picker: Picker
) -> None:
    """Cover destination `box` with source boxes (one source per cell)."""
    whole = [s for s in sources if contains(s.box, box)]
    if whole:
        s = picker.pick(whole, dst.device, box_size(box) * itemsize)
        if s.device == dst.device and s.box == box and s.rung in ("replica", "live"):
            dst.reuse = s.data
        dst.copies.append(
            Copy(s, _rel(box, s.box), _rel(box, box), box_size(box) * itemsize, False)
        )
        return
    for cell in cells(box, sources):
        holders = [s for s in sources if contains(s.box, cell)]
        if not holders:
            raise UnrecoverableStateError(path, cell, "every device holding it has failed")
        s = picker.pick(holders, dst.device, box_size(cell) * itemsize)
        dst.copies.append(Copy(s, _rel(cell, s.box), _rel(cell, box), box_size(cell) * itemsize, False))


# Pipeline slot leaves: the same layer sits at a different (stage, slot) on another partition.


def _layer_entries(box: Box, table: np.ndarray | None):
    """(layer, index prefix inside the shard, rest box) of a shard of a layered leaf: canonical
    `[L, *rest]` (`table` None) or slots `[S, Lmax, *rest]`."""
    if table is None:
        (l0, l1), rest = box[0], box[1:]
        return [(l, (l - l0,), rest) for l in range(l0, l1)]
    (s0, s1), (j0, j1), rest = box[0], box[1], box[2:]
    return [
        (int(table[s, j]), (s - s0, j - j0), rest)
        for s in range(s0, s1)
        for j in range(j0, j1)
        if table[s, j] >= 0
    ]


def plan_layered_leaf(
    path: str, itemsize: int, sources: list[Shard], dst: DstShard, box: Box, old_table,
    new_table, picker: Picker,
) -> None:
    """Cover each layer of a destination shard from the shards holding that layer (any slot)."""
    by_layer: dict[int, list[tuple[Shard, tuple]]] = defaultdict(list)
    for src in sources:
        for lid, prefix, rest in _layer_entries(src.box, old_table):
            by_layer[lid].append((dataclasses.replace(src, box=rest), prefix))
    for lid, dprefix, drest in _layer_entries(box, new_table):
        holders = by_layer.get(lid, [])
        nbytes = box_size(drest) * itemsize
        whole = [(h, pre) for h, pre in holders if contains(h.box, drest)]
        if whole:
            h = picker.pick([h for h, _ in whole], dst.device, nbytes)
            pre = next(p for x, p in whole if x is h)
            dst.copies.append(
                Copy(h, pre + _rel(drest, h.box), dprefix + _rel(drest, drest), nbytes, False)
            )
            continue
        for cell in cells(drest, [h for h, _ in holders]):
            cands = [(h, pre) for h, pre in holders if contains(h.box, cell)]
            if not cands:
                raise UnrecoverableStateError(path, ((lid, lid + 1),) + cell, "layer has no live copy")
            h = picker.pick([c for c, _ in cands], dst.device, box_size(cell) * itemsize)
            pre = next(p for x, p in cands if x is h)
            dst.copies.append(
                Copy(h, pre + _rel(cell, h.box), dprefix + _rel(cell, drest), box_size(cell) * itemsize, False)
            )


# ZeRO storage: canonical element ranges of shards.


def _shard_segments(
    codec, unit, tier: int, rank: int, row: int, natural: bool, cache: dict | None = None
) -> list[tuple[int, int, int]]:
    """(identity start, end, local flat offset) segments held by one storage shard (one rank,
    one row, one tier): `ZeroCodec.segments`. `cache` memoises them within a transition (Adam's
    two moments share every segment)."""
    if cache is None:
        return codec.segments(unit, tier, rank, row, natural)
    key = (id(codec), unit.name, tier, rank, row, natural)
    if key not in cache:
        cache[key] = codec.segments(unit, tier, rank, row, natural)
    return cache[key]


def _natural(old_layout, new_layout) -> bool:
    """Must storage be matched by element identities in the full leaves (`ZeroCodec.segments`)?
    Only when the tensor degree changes: otherwise rows mean the same on both plans, and row
    positions give far fewer, longer runs."""
    if old_layout is None or old_layout.codec is None or new_layout is None:
        return True
    return old_layout.codec.tensor != new_layout.codec.tensor


def storage_rank_row(box, batch: int) -> tuple[int, int]:
    """(data rank, tensor row) of a storage shard's box ([*layers, data, rows, width])."""
    return box[batch][0], box[batch + 1][0]


class _SegmentIndex:
    """Sorted canonical segments of the sources of one storage family."""

    def __init__(self):
        # (canonical start, end, local flat offset, source, stacked index in the source)
        self.items: list[tuple[int, int, int, Shard, int]] = []

    def add(self, g0: int, g1: int, off: int, src: Shard, pos: int = 0) -> None:
        self.items.append((g0, g1, off, src, pos))

    def freeze(self) -> None:
        self.items.sort(key=lambda t: (t[0], RUNG_ORDER[t[3].rung]))
        self.starts = [t[0] for t in self.items]
        self.max_len = max((t[1] - t[0] for t in self.items), default=0)

    def covering(self, g0: int, g1: int) -> list[tuple[int, int, int, Shard, int]]:
        lo = bisect.bisect_left(self.starts, g0 - self.max_len)
        hi = bisect.bisect_left(self.starts, g1)
        return [t for t in self.items[lo:hi] if t[1] > g0 and t[0] < g1]


def _cover(family: str, index: _SegmentIndex, g: int, end: int, dst: DstShard, picker: Picker):
    """The indexed source entry that holds element `g` and its source shard, picked among all
    holders (the destination first, then the cheapest rung), and where its run ends (at most
    `end`). Raises when no live device or snapshot holds `g`."""
    cands = index.covering(g, g + 1)
    if not cands:
        raise UnrecoverableStateError(
            family, ((g, end),), "no live device or snapshot holds these elements"
        )
    chosen = picker.pick([c[3] for c in cands], dst.device, 0)
    c = next(c for c in cands if c[3] is chosen)
    return c, chosen, min(c[1], end)


def plan_storage_shard(
    family: str, itemsize: int, batch: int, index: _SegmentIndex, segments, dst: DstShard,
    picker: Picker,
) -> None:
    """Fill a destination storage shard's canonical segments from the indexed sources."""
    for g0, g1, doff in segments:
        g = g0
        while g < g1:
            c, chosen, e = _cover(family, index, g, g1, dst, picker)
            n = e - g
            nbytes = n * itemsize * max(batch, 1)
            if chosen.device != dst.device:
                picker.load[chosen.device] += nbytes
            s0 = c[2] + (g - c[0])
            d0 = doff + (g - g0)
            dst.copies.append(
                Copy(chosen, (Ellipsis, slice(s0, s0 + n)), (Ellipsis, slice(d0, d0 + n)), nbytes, True)
            )
            g = e


def _layers_of(codec, unit) -> int:
    """Layers of the model a stacked unit holds (its slots may be more, some empty)."""
    return int(np.max(codec.stacked_layer_ids(unit))) + 1


def _leaf_space(unit, lid: int, g: int, natural: bool, layers: int) -> int:
    """A stacked unit's segment start `g` (one layer's identities, `ZeroCodec.segments`) as
    the identity of the same element in the whole leaf [layers, ...], which an unstacked unit
    of that leaf uses: natural identities offset by the layer; row positions placed inside the
    tensor row of all layers."""
    if natural:
        return lid * unit.total + g
    row, p = divmod(g, unit.row_len)
    return (row * layers + lid) * unit.row_len + p


def _index_family_leaf(store, old_layout, leaf_ids, old_tags, extra, natural: bool,
                       seg_cache=None) -> _SegmentIndex:
    """`_index_family` in whole-leaf identities (`_leaf_space`): the sources of a stacked
    family per layer (entry position: the source's stacked index), of an unstacked one as
    they are (position None)."""
    codec = old_layout.codec
    index = _SegmentIndex()
    for oi in leaf_ids:
        tag = old_tags[oi]
        unit = codec.unit(tag.unit)
        batch = len(unit.batch_shape)
        ids = codec.stacked_layer_ids(unit) if batch else None
        L = _layers_of(codec, unit) if batch else 0
        for s in store.shards[oi] + extra.get(store.paths[oi], []):
            rank, row = storage_rank_row(s.box, batch)
            segs = _shard_segments(codec, unit, tag.tier, rank, row, natural, seg_cache)
            if not batch:
                for g0, g1, off in segs:
                    index.add(g0, g1, off, s, None)
                continue
            p0, p1 = s.box[0]
            for pos in range(p0, p1):
                if ids[pos] < 0:
                    continue
                for g0, g1, off in segs:
                    x0 = _leaf_space(unit, int(ids[pos]), g0, natural, L)
                    index.add(x0, x0 + g1 - g0, off, s, pos - p0)
    index.freeze()
    return index


def plan_storage_shard_leaf(
    family: str, itemsize: int, index: _SegmentIndex, segments, dst: DstShard, picker: Picker,
) -> None:
    """Fill a destination storage shard from a whole-leaf index (`_index_family_leaf`):
    `segments` are (leaf-space start, end, storage offset, stacked index or None). A copy
    indexes its source and destination as flat views [*dst.batch, -1]: with no batch, a
    stacked source's element (position, offset) is at position * width + offset."""
    for x0, x1, doff, dpos in segments:
        g = x0
        while g < x1:
            c, chosen, e = _cover(family, index, g, x1, dst, picker)
            n = e - g
            if chosen.device != dst.device:
                picker.load[chosen.device] += n * itemsize
            s0, d0 = c[2] + (g - c[0]), doff + (g - x0)
            spos = c[4] or 0
            if dst.batch == 0:
                width = chosen.box[-1][1] - chosen.box[-1][0]
                src_idx = (Ellipsis, slice(spos * width + s0, spos * width + s0 + n))
                dst_idx = (Ellipsis, slice(d0, d0 + n))
            else:
                src_idx, dst_idx = (spos, slice(s0, s0 + n)), (dpos, slice(d0, d0 + n))
            dst.copies.append(Copy(chosen, src_idx, dst_idx, n * itemsize, True))
            g = e


# ---------------------------------------------------------------------------------------------
# One leaf of a transition: how it is stored, and its destination shards.


@dataclasses.dataclass(frozen=True)
class LeafTag:
    """How a leaf is stored: `unit` is None for a regular array, else the ZeRO storage unit and
    tier of family `key`."""

    key: str
    unit: str | None = None
    tier: int = 0


@dataclasses.dataclass
class Planning:
    """What the leaves of one transition share while they are planned: the sources (the store,
    extra sources by leaf key), both layouts and their tags, and the indexes of old storage
    built once per family of leaves."""

    store: ShardStore
    extra: dict[str, list[Shard]]
    picker: Picker
    log: TransferLog
    old_layout: Any
    new_layout: Any
    old_tags: list[LeafTag]
    families: dict[str, list[int]]  # leaf key -> its storage leaves in the old layout, by tier
    old_tables: Any
    new_tables: Any
    indexes: dict[str, _SegmentIndex] = dataclasses.field(default_factory=dict)
    leaf_indexes: dict[str, _SegmentIndex] = dataclasses.field(default_factory=dict)
    seg_cache: dict = dataclasses.field(default_factory=dict)


def plan_array_leaf(pl: Planning, li: int, tag: LeafTag, oi: int, sh, shape,
                     dtype) -> list[DstShard]:
    """A regular array's destination shards (every process's: the plan is global), each from
    the boxes of its old shards and extra sources, layer by layer where pipeline slots moved."""
    itemsize = np.dtype(dtype).itemsize
    sources = pl.store.shards[oi] + pl.extra.get(tag.key, [])
    layered = "layers" in tag.key.split("/") and _differ(pl.old_tables, pl.new_tables)
    out = []
    for d, idx in sh.devices_indices_map(shape).items():
        box = index_to_box(idx, shape)
        ds = DstShard(li, d.id, tuple(sh.shard_shape(shape)), dtype, 0, box)
        if layered:
            plan_layered_leaf(
                tag.key, itemsize, sources, ds, box, pl.old_tables, pl.new_tables, pl.picker
            )
            ds.box = ()  # layer-level copies: logged by their own index
        else:
            plan_box_leaf(tag.key, itemsize, sources, ds, box, pl.picker)
        out.append(ds)
    return out


def plan_storage_leaf(pl: Planning, li: int, tag: LeafTag, sh, shape,
                       dtype) -> list[DstShard]:
    """A ZeRO storage leaf's destination shards: a rank that keeps its pieces of this tier in
    place reuses its buffer; the others are matched in row identities (every layer at once
    where both plans hold the same rows) or in the full leaves' identities."""
    old_layout, new_layout = pl.old_layout, pl.new_layout
    itemsize = np.dtype(dtype).itemsize
    codec, unit = new_layout.codec, new_layout.codec.unit(tag.unit)
    batch = len(unit.batch_shape)
    old_unit = old_layout.codec.unit(tag.unit) if old_layout.codec is not None else None
    old_batch = len(old_unit.batch_shape) if old_unit is not None else 0
    new_ids = codec.stacked_layer_ids(unit) if batch else None
    # the same rows on both plans: unstacked both, or stacked with the same layer in every
    # position (ZeRO-3, a pipeline keeping its partition); otherwise a layer may sit in
    # another slot (or stage), or in a unit of the whole leaf: matched in leaf identities
    same_rows = old_batch == batch and (batch == 0 or np.array_equal(
        old_layout.codec.stacked_layer_ids(old_unit), new_ids))
    # every layer at once where every shard holds every layer (a pipeline's shards hold
    # their stage's: their row identities alone do not say which layer)
    all_layers = same_rows and (batch == 0 or (
        codec.layer_axis is None and old_layout.codec.layer_axis is None))
    same_pieces = _same_pieces(old_layout, new_layout)
    natural = _natural(old_layout, new_layout)
    L = _layers_of(codec, unit) if batch else 0
    family = pl.families[tag.key]
    old_tier = family[tag.tier] if tag.tier < len(family) else None
    held = {s.device: s for s in pl.store.shards[old_tier]} if old_tier is not None else {}
    out = []
    for d, idx in sh.devices_indices_map(shape).items():
        box = index_to_box(idx, shape)
        rank, row = storage_rank_row(box, batch)
        ds = DstShard(li, d.id, tuple(sh.shard_shape(shape)), dtype, batch)
        out.append(ds)
        old = held.get(d.id)
        if (
            same_pieces
            and same_rows
            and old is not None
            and tuple(b - a for a, b in old.box) == ds.shape
            # the same tensor row: a device can change its tensor rank in a new group
            and storage_rank_row(old.box, batch)[1] == row
            and tuple(old_layout.codec.tables[tag.tier][storage_rank_row(old.box, batch)[0]])
            == tuple(codec.tables[tag.tier][rank])
            and old.box[:batch] == box[:batch]
        ):
            ds.reuse = old.data  # this rank keeps this tier in place: no copy
            pl.log.kept_bytes += math.prod(ds.shape) * itemsize
            continue
        segs = _shard_segments(codec, unit, tag.tier, rank, row, natural, pl.seg_cache)
        if all_layers:
            if tag.key not in pl.indexes:
                pl.indexes[tag.key] = _index_family(
                    pl.store, old_layout, family, pl.old_tags, pl.extra, natural, pl.seg_cache
                )
            plan_storage_shard(tag.key, itemsize, unit.layers, pl.indexes[tag.key], segs, ds,
                               pl.picker)
            continue
        if tag.key not in pl.leaf_indexes:
            pl.leaf_indexes[tag.key] = _index_family_leaf(
                pl.store, old_layout, family, pl.old_tags, pl.extra, natural, pl.seg_cache
            )
        if batch:
            (b0, b1) = box[0]
            want = [
                (x0, x0 + g1 - g0, off, pos - b0)
                for pos in range(b0, b1) if new_ids[pos] >= 0
                for g0, g1, off in segs
                for x0 in [_leaf_space(unit, int(new_ids[pos]), g0, natural, L)]
            ]
        else:
            want = [(g0, g1, off, None) for g0, g1, off in segs]
        plan_storage_shard_leaf(tag.key, itemsize, pl.leaf_indexes[tag.key], want, ds,
                                pl.picker)
    return out


def _differ(a, b) -> bool:
    if a is None or b is None:
        return (a is None) != (b is None)
    return a.shape != b.shape or not np.array_equal(a, b)


def slot_table(layout):
    """The (stage, slot) -> layer table of a pipelined layout; None for canonical [L, ...]."""
    if layout is None or getattr(layout, "stage_layout", None) is None:
        return None
    return layout.stage_layout.slot_layer()


def _same_pieces(old_layout, new_layout) -> bool:
    """Do both layouts cut every unit into the same pieces (so a slot means the same thing)?"""
    if old_layout is None or old_layout.codec is None:
        return False
    a, b = old_layout.codec, new_layout.codec
    return (
        a.layout.kind == b.layout.kind
        and a.layout.n_pieces == b.layout.n_pieces
        and a.tensor == b.tensor
        and [(u.name, u.row_len, u.rows, u.layers) for u in a.units]
        == [(u.name, u.row_len, u.rows, u.layers) for u in b.units]
    )


def _index_family(store, old_layout, leaf_ids, old_tags, extra, natural: bool,
                  seg_cache=None) -> _SegmentIndex:
    """Canonical segments of every source (live shards and snapshots) of one storage family."""
    codec = old_layout.codec
    index = _SegmentIndex()
    for oi in leaf_ids:
        tag = old_tags[oi]
        unit = codec.unit(tag.unit)
        batch = len(unit.batch_shape)
        for s in store.shards[oi] + extra.get(store.paths[oi], []):
            rank, row = storage_rank_row(s.box, batch)
            assert s.box[batch + 1][1] - row == 1, "one storage row per device"
            for g0, g1, off in _shard_segments(codec, unit, tag.tier, rank, row, natural,
                                               seg_cache):
                index.add(g0, g1, off, s)
    index.freeze()
    return index
