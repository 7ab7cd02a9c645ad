"""Transitions: move what survives of a state onto a new plan's layout, from live sources only.

After a failure the old global arrays are unusable (their buffers on the failed devices are gone,
and `jax.device_put` of such an array could read a replica on a dead device). What the job still
has is a `ShardStore` (per leaf, the single-device buffers on live devices) and the snapshot
pool's copies (`Shard`s on buddy devices or in host memory). A transition

1. *plans* copies. Leaves whose meaning does not change with the plan (parameters, scalars) are
   matched by *box* (a hyper-rectangle of the global array): each destination box is covered by
   source boxes, cut into cells where no single source covers it. ZeRO storage leaves
   (`elasjax.zero`) are matched by *canonical element ranges*, because the same element sits at a
   different storage position on a different plan. Each needed piece gets exactly one source, the
   cheapest rung first: the destination itself, a live device, a buddy snapshot, a host snapshot;
   ties go to the least-loaded sender;
2. *executes* them: ranks whose ZeRO tiers stay in place keep their very buffers (no copy); on
   the CPU backend every other destination shard is assembled with numpy, from zero-copy views
   of the sources, in a 64-byte-aligned host buffer that JAX adopts as the device buffer (the
   shards are split over one thread per core; numpy copies release the GIL); on other backends
   pieces are sliced on their devices and moved with `device_put`;
3. *logs* every piece as a `Transfer(leaf, box, src, dst, nbytes, rung)`.

Planning reads shard *descriptions* only: a copy names its source by `SourceRef`
(leaf path, device, rung, box), never by buffer. So a `TransitionPlan` can be made before a
failure, from `describe_state` and the snapshot pool's `describe_sources`, kept in a
`TransitionPlanCache` under everything it depends on, and run on the buffers present after the
failure, provided they are exactly the described ones (otherwise `transition` plans anew).

A piece that no source holds raises `UnrecoverableStateError` naming the leaf and the slice;
callers may then fall back to a checkpoint, never to re-initialised or partly stale values.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import itertools
import math
import os
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .sharding import path_str

PyTree = Any
Box = tuple[tuple[int, int], ...]
RUNG_ORDER = {"local": 0, "replica": 1, "live": 1, "buddy": 2, "host": 3, "checkpoint": 4}


class UnrecoverableStateError(RuntimeError):
    """A slice of state has no live copy on any rung; the message names the leaf and slice."""

    def __init__(self, leaf: str, box: Box, detail: str = ""):
        self.leaf, self.box = leaf, box
        super().__init__(
            f"state leaf '{leaf}' slice {box_str(box)} has no live copy"
            + (f" ({detail})" if detail else "")
        )


def index_to_box(index: tuple, shape: tuple[int, ...]) -> Box:
    out = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        assert step == 1
        out.append((start, stop))
    return tuple(out)


def box_str(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def _contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _size(box: Box) -> int:
    return math.prod(b - a for a, b in box)


@dataclasses.dataclass(frozen=True)
class Shard:
    """A copy of `box` of a leaf: on device `device` (an int id), or in host memory
    (`device` = "host:<h>", `data` a numpy array). `rung` says where it comes from."""

    device: int | str
    box: Box
    data: Any
    rung: str = "replica"


@dataclasses.dataclass
class ShardStore:
    """What the job holds of a state, leaf by leaf, as per-device buffers."""

    treedef: Any
    paths: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[Any]
    shards: list[list[Shard]]

    @classmethod
    def capture(cls, tree: PyTree) -> "ShardStore":
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths, shapes, dtypes, shards = [], [], [], []
        for path, x in flat:
            paths.append(path_str(path))
            shapes.append(tuple(x.shape))
            dtypes.append(x.dtype)
            shards.append(
                [Shard(s.device.id, index_to_box(s.index, x.shape), s.data) for s in x.addressable_shards]
            )
        return cls(treedef, paths, shapes, dtypes, shards)

    def fail(self, device_ids: Iterable[int]) -> int:
        """Delete every buffer on the given devices (their memory is gone). Returns bytes lost."""
        dead = set(device_ids)
        lost = 0
        for i, leaf in enumerate(self.shards):
            keep = []
            for s in leaf:
                if s.device in dead:
                    lost += s.data.nbytes
                    if not s.data.is_deleted():
                        s.data.delete()
                else:
                    keep.append(s)
            self.shards[i] = keep
        return lost

    def dead_devices(self) -> set[int]:
        """Devices whose buffers are gone (deleted behind the store's back)."""
        return {s.device for leaf in self.shards for s in leaf if s.data.is_deleted()}

    def devices(self) -> set[int]:
        return {s.device for leaf in self.shards for s in leaf}


@dataclasses.dataclass(frozen=True)
class Transfer:
    leaf: str
    box: Box  # destination slice (global box; for ZeRO storage, the element range in the shard)
    src: int | str  # device id, "host:<h>" or "checkpoint"
    dst: int
    nbytes: int
    rung: str = "replica"

    @property
    def local(self) -> bool:
        return self.src == self.dst

    def to_json(self) -> dict:
        return {
            "leaf": self.leaf,
            "slice": box_str(self.box),
            "src": self.src,
            "dst": self.dst,
            "bytes": self.nbytes,
            "rung": self.rung,
        }


@dataclasses.dataclass
class TransferLog:
    entries: list[Transfer] = dataclasses.field(default_factory=list)
    kept_bytes: int = 0  # bytes that stayed in place (buffers reused without a copy)

    @property
    def moved(self) -> list[Transfer]:
        return [t for t in self.entries if not t.local]

    @property
    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.moved)

    @property
    def transfers(self) -> int:
        return len(self.moved)

    def sources(self) -> set:
        return {t.src for t in self.entries}

    def max_per_device(self) -> int:
        """Largest number of transfers any one device sends or receives."""
        count: dict = defaultdict(int)
        for t in self.moved:
            count[("s", t.src)] += 1
            count[("r", t.dst)] += 1
        return max(count.values(), default=0)

    def rungs(self) -> set[str]:
        return {t.rung for t in self.entries}

    def worst_rung(self) -> str:
        rungs = {t.rung for t in self.moved} or {"replica"}
        return max(rungs, key=lambda r: RUNG_ORDER[r])


# ---------------------------------------------------------------------------------------------
# Copy plans. A copy moves `src.data[src_idx]` into destination shard `dst` at `dst_idx`; flat
# copies index arrays viewed as [*batch, -1] (all layers of a ZeRO storage shard at once).


@dataclasses.dataclass(frozen=True)
class _Copy:
    src: Shard
    src_idx: tuple
    dst_idx: tuple
    nbytes: int
    flat: bool  # index the [*batch, -1] view


@dataclasses.dataclass
class _DstShard:
    leaf: int  # index into the target leaves
    device: int
    shape: tuple[int, ...]
    dtype: Any
    batch: int  # leading axes kept when viewed flat
    box: Box = ()  # global box of a regular leaf's shard (for the log)
    copies: list[_Copy] = dataclasses.field(default_factory=list)
    reuse: Any = None  # the source (its `SourceRef`) that is exactly this shard: kept as is
    covered: bool = False  # the copies write every element (no zero fill needed)
    gaps: list[tuple] | None = None  # else, when known: the [*batch, -1] slices no copy writes


class _Picker:
    def __init__(self):
        self.load: dict = defaultdict(int)

    def pick(self, holders: Sequence[Shard], dst: int, nbytes: int) -> Shard:
        for s in holders:
            if s.device == dst:
                return s
        best = min(holders, key=lambda s: (RUNG_ORDER[s.rung], self.load[s.device], str(s.device)))
        self.load[best.device] += nbytes
        return best


def _cells(dst: Box, sources: list[Shard]) -> list[Box]:
    """Cut `dst` along every source boundary inside it."""
    axes = []
    for d, (lo, hi) in enumerate(dst):
        cuts = {lo, hi}
        for s in sources:
            a, b = s.box[d]
            cuts.update(c for c in (a, b) if lo < c < hi)
        pts = sorted(cuts)
        axes.append(list(zip(pts[:-1], pts[1:])))
    return [tuple(c) for c in itertools.product(*axes)]


def _rel(cell: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(c0 - o0, c1 - o0) for (c0, c1), (o0, _) in zip(cell, origin))


def plan_box_leaf(
    path: str, itemsize: int, sources: list[Shard], dst: _DstShard, box: Box, picker: _Picker
) -> None:
    """Cover destination `box` with source boxes (one source per cell)."""
    whole = [s for s in sources if _contains(s.box, box)]
    if whole:
        s = picker.pick(whole, dst.device, _size(box) * itemsize)
        if s.device == dst.device and s.box == box and s.rung in ("replica", "live"):
            dst.reuse = s.data
        dst.copies.append(
            _Copy(s, _rel(box, s.box), _rel(box, box), _size(box) * itemsize, False)
        )
        return
    for cell in _cells(box, sources):
        holders = [s for s in sources if _contains(s.box, cell)]
        if not holders:
            raise UnrecoverableStateError(path, cell, "every device holding it has failed")
        s = picker.pick(holders, dst.device, _size(cell) * itemsize)
        dst.copies.append(_Copy(s, _rel(cell, s.box), _rel(cell, box), _size(cell) * itemsize, False))


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
    path: str, itemsize: int, sources: list[Shard], dst: _DstShard, box: Box, old_table,
    new_table, picker: _Picker,
) -> None:
    """Cover each layer of a destination shard from the shards holding that layer (any slot)."""
    by_layer: dict[int, list[tuple[Shard, tuple]]] = defaultdict(list)
    for src in sources:
        for lid, prefix, rest in _layer_entries(src.box, old_table):
            by_layer[lid].append((dataclasses.replace(src, box=rest), prefix))
    for lid, dprefix, drest in _layer_entries(box, new_table):
        holders = by_layer.get(lid, [])
        nbytes = _size(drest) * itemsize
        whole = [(h, pre) for h, pre in holders if _contains(h.box, drest)]
        if whole:
            h = picker.pick([h for h, _ in whole], dst.device, nbytes)
            pre = next(p for x, p in whole if x is h)
            dst.copies.append(
                _Copy(h, pre + _rel(drest, h.box), dprefix + _rel(drest, drest), nbytes, False)
            )
            continue
        for cell in _cells(drest, [h for h, _ in holders]):
            cands = [(h, pre) for h, pre in holders if _contains(h.box, cell)]
            if not cands:
                raise UnrecoverableStateError(path, ((lid, lid + 1),) + cell, "layer has no live copy")
            h = picker.pick([c for c, _ in cands], dst.device, _size(cell) * itemsize)
            pre = next(p for x, p in cands if x is h)
            dst.copies.append(
                _Copy(h, pre + _rel(cell, h.box), dprefix + _rel(cell, drest), _size(cell) * itemsize, False)
            )


# ZeRO storage: canonical element ranges of shards.


def _runs(row: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs (first slot, first piece, length) of consecutive pieces in a table row."""
    idx = np.nonzero(row >= 0)[0]
    if idx.size == 0:
        return []
    brk = np.nonzero((np.diff(idx) != 1) | (np.diff(row[idx]) != 1))[0]
    starts = np.concatenate([[0], brk + 1])
    ends = np.concatenate([brk + 1, [idx.size]])
    return [(int(idx[a]), int(row[idx[a]]), int(b - a)) for a, b in zip(starts, ends)]


def _shard_segments(
    codec, unit, tier: int, rank: int, row: int, cache: dict | None = None
) -> list[tuple[int, int, int]]:
    """(canonical start, canonical end, local flat offset) segments held by one storage shard
    (one rank, one row, one tier), split at member boundaries. `cache` memoises them within a
    transition (Adam's two moments share every segment)."""
    if cache is not None:
        key = (id(codec), unit.name, tier, rank, row)
        if key not in cache:
            cache[key] = _shard_segments(codec, unit, tier, rank, row)
        return cache[key]
    K = codec.layout.n_pieces
    table = codec.tables[tier][rank]
    rot = np.where(table >= 0, (table + unit.rotation) % K, -1)
    out = []
    p, L = unit.piece, unit.row_len
    for slot, piece, n in _runs(rot):
        a, b = piece * p, min((piece + n) * p, L)
        if a >= b:
            continue
        local = slot * p
        for m in unit.members:
            lo, hi = m.row_offset, m.row_offset + m.size // unit.rows
            x0, x1 = max(a, lo), min(b, hi)
            if x0 < x1:
                g0 = m.full_offset + row * (m.size // unit.rows) + (x0 - lo)
                out.append((g0, g0 + (x1 - x0), local + (x0 - a)))
    return out


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


def plan_storage_shard(
    family: str, itemsize: int, batch: int, index: _SegmentIndex, segments, dst: _DstShard,
    picker: _Picker,
) -> None:
    """Fill a destination storage shard's canonical segments from the indexed sources."""
    for g0, g1, doff in segments:
        g = g0
        while g < g1:
            cands = index.covering(g, g + 1)
            if not cands:
                raise UnrecoverableStateError(
                    family, ((g, g1),), "no live device or snapshot holds these elements"
                )
            # among holders of element g, prefer the destination, then the cheapest rung
            end_of = {id(c): min(c[1], g1) for c in cands}
            by_src = [c[3] for c in cands]
            chosen = picker.pick(by_src, dst.device, 0)
            c = next(c for c in cands if c[3] is chosen)
            e = end_of[id(c)]
            n = e - g
            nbytes = n * itemsize * max(batch, 1)
            if chosen.device != dst.device:
                picker.load[chosen.device] += nbytes
            s0 = c[2] + (g - c[0])
            d0 = doff + (g - g0)
            dst.copies.append(
                _Copy(chosen, (Ellipsis, slice(s0, s0 + n)), (Ellipsis, slice(d0, d0 + n)), nbytes, True)
            )
            g = e


def plan_storage_shard_by_layer(
    family: str, itemsize: int, index: dict[int, _SegmentIndex], segments, dst: _DstShard,
    batch_box: tuple[int, int], layer_ids: np.ndarray, picker: _Picker,
) -> None:
    """`plan_storage_shard` for per-layer storage on pipelines: each stacked index (slot) of
    the destination shard is filled from whichever shard holds that layer, at its own index."""
    b0, b1 = batch_box
    for pos in range(b0, b1):
        lid = int(layer_ids[pos])
        if lid < 0:
            continue  # an empty slot stays zero
        layer = index.get(lid)
        for g0, g1, doff in segments:
            g = g0
            while g < g1:
                cands = layer.covering(g, g + 1) if layer is not None else []
                if not cands:
                    raise UnrecoverableStateError(
                        family, ((lid, lid + 1), (g, g1)),
                        "no live device or snapshot holds these elements of this layer",
                    )
                chosen = picker.pick([c[3] for c in cands], dst.device, 0)
                c = next(c for c in cands if c[3] is chosen)
                e = min(c[1], g1)
                n = e - g
                if chosen.device != dst.device:
                    picker.load[chosen.device] += n * itemsize
                s0, d0 = c[2] + (g - c[0]), doff + (g - g0)
                dst.copies.append(
                    _Copy(chosen, (c[4], slice(s0, s0 + n)), (pos - b0, slice(d0, d0 + n)),
                          n * itemsize, True)
                )
                g = e


def _index_family_by_layer(
    store, old_layout, leaf_ids, old_tags, extra, seg_cache=None
) -> dict[int, _SegmentIndex]:
    """`_index_family` per layer: layer id -> canonical segments of (source, stacked index)."""
    codec = old_layout.codec
    out: dict[int, _SegmentIndex] = defaultdict(_SegmentIndex)
    for oi in leaf_ids:
        tag = old_tags[oi]
        unit = codec.unit(tag.unit)
        ids = codec.stacked_layer_ids(unit)
        for s in store.shards[oi] + extra.get(store.paths[oi], []):
            (p0, p1), rank, row = s.box[0], s.box[1][0], s.box[3][0]
            segs = _shard_segments(codec, unit, tag.tier, rank, row, seg_cache)
            for pos in range(p0, p1):
                if ids[pos] >= 0:
                    for g0, g1, off in segs:
                        out[int(ids[pos])].add(g0, g1, off, s, pos - p0)
    for index in out.values():
        index.freeze()
    return dict(out)


# ---------------------------------------------------------------------------------------------
# Execution.


def _host_view(x) -> np.ndarray:
    """Zero-copy read-only view of a CPU buffer (or the numpy array itself)."""
    return x if isinstance(x, np.ndarray) else np.asarray(x)


_ALIGN = 64  # the CPU client adopts 64-byte-aligned host buffers without a copy


def _aligned_empty(shape: tuple[int, ...], dtype, zero: bool) -> np.ndarray:
    """A fresh host buffer whose data is `_ALIGN`-byte aligned, so that `jax.device_put` on the
    CPU backend adopts it instead of copying it a second time."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = (np.zeros if zero else np.empty)(n + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off : off + n].view(dtype).reshape(shape)


def _execute(
    dsts: list[_DstShard], devices: dict[int, jax.Device], data: dict
) -> dict[tuple[int, int], Any]:
    """Build every destination shard: {(leaf, device): buffer}. Copies name their sources by
    `SourceRef`; `data` maps each ref to its buffer. On the CPU backend a new shard is an aligned
    numpy buffer (placed, without a copy, when its global array is made); elsewhere it is a
    single-device array."""
    cpu = all(d.platform == "cpu" for d in devices.values())
    out: dict[tuple[int, int], Any] = {}
    work = []
    for d in dsts:
        if d.reuse is not None:
            out[(d.leaf, d.device)] = data[d.reuse]
        elif cpu:
            work.append(d)
        else:
            out[(d.leaf, d.device)] = _build_on_device(d, devices, data)
    if work:
        # numpy copies release the GIL: split the shards into byte-balanced groups, one per core
        n = min(_COPY_THREADS, len(work))
        groups: list[list[_DstShard]] = [[] for _ in range(n)]
        load = [0] * n
        for d in sorted(work, key=lambda d: -math.prod(d.shape)):
            i = load.index(min(load))
            groups[i].append(d)
            load[i] += math.prod(d.shape) * np.dtype(d.dtype).itemsize
        views: dict = {}
        for d in work:  # source views made once, on this thread
            for c in d.copies:
                vkey = (c.src.data, c.flat, d.batch)
                if vkey not in views:
                    src = _host_view(data[c.src.data])
                    views[vkey] = src.reshape(src.shape[: d.batch] + (-1,)) if c.flat else src
        if n == 1:
            built = [_build_on_host(groups[0], views)]
        else:
            built = list(_copy_pool().map(lambda g: _build_on_host(g, views), groups))
        for part in built:
            out.update(part)
    return out


_COPY_THREADS = max(1, min(os.cpu_count() or 1, 8))
_pool = None


def _copy_pool():
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(_COPY_THREADS, "elasjax-copy")
    return _pool


def _build_on_host(dsts: list[_DstShard], views: dict) -> dict[tuple[int, int], np.ndarray]:
    """Assemble destination shards in aligned host buffers from zero-copy source views."""
    out = {}
    for d in dsts:
        # zero only what no copy writes (a full fill would touch every page twice)
        buf = _aligned_empty(d.shape, d.dtype, zero=not d.covered and d.gaps is None)
        flatbuf = buf.reshape(d.shape[: d.batch] + (-1,))
        for g in d.gaps or ():
            flatbuf[g] = 0
        for c in d.copies:
            src = views[(c.src.data, c.flat, d.batch)]
            if c.flat:
                flatbuf[c.dst_idx] = src[c.src_idx]
            else:
                buf[c.dst_idx] = src[c.src_idx]
        out[(d.leaf, d.device)] = buf
    return out


def _build_on_device(d: _DstShard, devices: dict[int, jax.Device], data: dict) -> jax.Array:
    """Assemble a destination shard on its device (non-CPU backends)."""
    buf = jnp.zeros(d.shape, d.dtype, device=devices[d.device])
    for c in d.copies:
        src = data[c.src.data]
        if isinstance(src, np.ndarray):
            src = jnp.asarray(src)
        if c.flat:
            piece = src.reshape(src.shape[: d.batch] + (-1,))[c.src_idx]
            piece = jax.device_put(piece, devices[d.device])
            flatbuf = buf.reshape(d.shape[: d.batch] + (-1,)).at[c.dst_idx].set(piece)
            buf = flatbuf.reshape(d.shape)
        else:
            piece = jax.device_put(src[c.src_idx], devices[d.device])
            buf = buf.at[c.dst_idx].set(piece)
    return buf


def _private_batched_put():
    """JAX's one-call construction of a global array from per-device values (what
    `jax.make_array_from_callback` ends in, without its per-value Python checks; about 3x
    cheaper per leaf). Private API of the pinned jax; None (the public path) if it moved."""
    try:
        from jax._src import core as jcore
        from jax._src.interpreters import pxla

        def put(shape, sharding, values, devices):
            aval = jcore.update_aval_with_sharding(
                jcore.ShapedArray(shape, values[0].dtype), sharding
            )
            return pxla.batched_device_put(aval, sharding, values, devices)

        return put if callable(getattr(pxla, "batched_device_put", None)) else None
    except (ImportError, AttributeError):
        return None


_batched_put = _private_batched_put()


def _assemble(shape, sharding, dmap: dict, values: list) -> jax.Array:
    """One global array from its per-device values (in the order of `dmap`, the sharding's
    device -> index map): existing single-device arrays are kept, host buffers placed (adopted
    without a copy when aligned)."""
    if sharding.is_fully_replicated:  # make_array_from_callback would read one value for all
        arrays = [v if isinstance(v, jax.Array) else jax.device_put(v, d) for v, d in zip(values, dmap)]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    if _batched_put is not None:
        return _batched_put(shape, sharding, values, list(dmap))
    order = iter(zip(dmap.values(), values))

    def value(index):
        want, v = next(order)
        if index != want:  # the callback must visit devices in the order of `values`
            raise AssertionError(f"make_array_from_callback visited {index}, expected {want}")
        return v

    return jax.make_array_from_callback(shape, sharding, value)


# ---------------------------------------------------------------------------------------------
# The transition: a plan computed from shard descriptions, then executed on the buffers.


@dataclasses.dataclass(frozen=True)
class LeafTag:
    """How a leaf is stored: `unit` is None for a regular array, else the ZeRO storage unit and
    tier of family `key`."""

    key: str
    unit: str | None = None
    tier: int = 0


# A source named by what it is, not by its buffer: (leaf path, device, rung, box). Plans refer to
# sources by ref, so a plan made before a failure (from shard descriptions) runs on the buffers
# present after it.
SourceRef = tuple


def source_ref(path: str, s: Shard) -> SourceRef:
    return (path, s.device, s.rung, s.box)


def described(path: str, s: Shard) -> Shard:
    """`s` with its `SourceRef` for data."""
    return dataclasses.replace(s, data=source_ref(path, s))


def describe(store: ShardStore, extra: dict[str, list[Shard]] | None = None):
    """(store, extra) with every shard's `data` replaced by its `SourceRef`."""
    desc = ShardStore(
        store.treedef, store.paths, store.shapes, store.dtypes,
        [[described(p, s) for s in leaf] for p, leaf in zip(store.paths, store.shards)],
    )
    return desc, {p: [described(p, s) for s in shards] for p, shards in (extra or {}).items()}


def describe_state(state: PyTree, dead: Iterable[int] = ()) -> ShardStore:
    """The `ShardStore` a failure of `dead` would leave of `state`, with `SourceRef`s for data:
    what `faults.inject` returns, without touching a buffer."""
    dead = set(dead)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    paths, shapes, dtypes, shards = [], [], [], []
    for path, x in flat:
        p, shape = path_str(path), tuple(x.shape)
        paths.append(p)
        shapes.append(shape)
        dtypes.append(x.dtype)
        leaf = []
        for d, idx in x.sharding.addressable_devices_indices_map(shape).items():
            if d.id not in dead:
                leaf.append(described(p, Shard(d.id, index_to_box(idx, shape), None)))
        shards.append(leaf)
    return ShardStore(treedef, paths, shapes, dtypes, shards)


def _buffers(store: ShardStore, extra: dict[str, list[Shard]]) -> dict:
    """{SourceRef: buffer} of every source: what a plan's copies read."""
    data = {}
    for p, leaf in zip(store.paths, store.shards):
        for s in leaf:
            data[source_ref(p, s)] = s.data
    for p, shards in extra.items():
        for s in shards:
            data[source_ref(p, s)] = s.data
    return data


def _signature(store: ShardStore, refs: frozenset, target_flat, old_layout, new_layout) -> tuple:
    """What a transition plan depends on: the layouts, the target shardings, the leaves and the
    exact set of sources."""
    return (
        id(old_layout), id(new_layout), tuple(target_flat), tuple(store.paths),
        tuple(store.shapes), tuple(str(d) for d in store.dtypes), refs,
    )


def _refs(store: ShardStore, extra: dict) -> frozenset:
    """The `SourceRef`s of a described store and its extra sources."""
    return frozenset(s.data for leaf in store.shards for s in leaf) | frozenset(
        s.data for shards in extra.values() for s in shards
    )


@dataclasses.dataclass
class TransitionPlan:
    """Every copy of one transition, made from shard descriptions (`SourceRef`s): valid for any
    buffers that match them. `plan_s` is the time it took to make."""

    signature: tuple
    dsts: list[_DstShard]
    log: TransferLog
    target_flat: list
    shapes: list[tuple[int, ...]]
    treedef: Any
    plan_s: float
    layouts: tuple = ()  # keeps the layouts whose ids the signature holds alive

    @property
    def bytes_written(self) -> int:
        """Bytes copied into new shards (local pieces included; kept buffers excluded)."""
        return sum(c.nbytes for d in self.dsts if d.reuse is None for c in d.copies)

    def execute(self, data: dict, devices: dict[int, jax.Device]) -> tuple[PyTree, TransferLog]:
        built = _execute(self.dsts, devices, data)
        leaves = []
        for li, (sh, shape) in enumerate(zip(self.target_flat, self.shapes)):
            dmap = sh.addressable_devices_indices_map(shape)
            leaves.append(_assemble(shape, sh, dmap, [built[(li, d.id)] for d in dmap]))
        log = TransferLog(list(self.log.entries), self.log.kept_bytes)
        return jax.tree_util.tree_unflatten(self.treedef, leaves), log


class TransitionPlanCache:
    """Transition plans by signature (layouts, target shardings and the exact set of sources),
    least recently used dropped beyond `max_plans`. Thread-safe: the trainer fills it in the
    background for the likeliest failures, so that recovery only executes copies."""

    def __init__(self, max_plans: int = 64):
        self.max_plans = max_plans
        self._plans: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, signature: tuple) -> TransitionPlan | None:
        with self._lock:
            plan = self._plans.get(signature)
            if plan is not None:
                self._plans.move_to_end(signature)
            return plan

    def put(self, plan: TransitionPlan) -> None:
        with self._lock:
            self._plans[plan.signature] = plan
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)

    def prepare(
        self, store: ShardStore, target_shardings: PyTree, extra: dict | None = None, *,
        old_layout=None, new_layout=None,
    ) -> TransitionPlan:
        """Plan (and keep) the transition from a described store (`describe`, `describe_state`)."""
        target_flat = _target_leaves(target_shardings)
        sig = _signature(store, _refs(store, extra or {}), target_flat, old_layout, new_layout)
        plan = self.get(sig)
        if plan is None:
            plan = plan_transition(
                store, target_shardings, extra_sources=extra, old_layout=old_layout,
                new_layout=new_layout, signature=sig,
            )
            self.put(plan)
        return plan


def _target_leaves(target_shardings: PyTree) -> list:
    return jax.tree_util.tree_leaves(
        target_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )


def transition(
    store: ShardStore,
    target_shardings: PyTree,
    *,
    devices: dict[int, jax.Device] | None = None,
    extra_sources: dict[str, list[Shard]] | None = None,
    old_layout=None,
    new_layout=None,
    plans: TransitionPlanCache | None = None,
    info: dict | None = None,
) -> tuple[PyTree, TransferLog]:
    """Build the state on `target_shardings` from the store's live shards and `extra_sources`
    (snapshot copies, by leaf path). With ZeRO layouts (`state.StateLayout`), storage leaves are
    rebuilt by canonical element ranges; in-place tiers reuse their buffers. With `plans`, a plan
    made earlier for the same sources is reused (and a new one kept); `info`, if given, receives
    `plan_hit` and `plan_s` (0 on a hit)."""
    devices = devices or {d.id: d for d in jax.devices()}
    data = _buffers(store, extra_sources or {})
    target_flat = _target_leaves(target_shardings)
    sig = _signature(store, frozenset(data), target_flat, old_layout, new_layout)
    plan = plans.get(sig) if plans is not None else None
    hit = plan is not None
    if plan is None:
        desc, desc_extra = describe(store, extra_sources)
        plan = plan_transition(
            desc, target_shardings, extra_sources=desc_extra, old_layout=old_layout,
            new_layout=new_layout, signature=sig,
        )
        if plans is not None:
            plans.put(plan)
    if info is not None:
        info.update(plan_hit=hit, plan_s=0.0 if hit else plan.plan_s, bytes_written=plan.bytes_written)
    return plan.execute(data, devices)


def plan_transition(
    store: ShardStore,
    target_shardings: PyTree,
    *,
    extra_sources: dict[str, list[Shard]] | None = None,
    old_layout=None,
    new_layout=None,
    signature: tuple = (),
) -> TransitionPlan:
    """The copies of a transition, from a described store (shard `data` are `SourceRef`s)."""
    t_start = time.perf_counter()
    extra = extra_sources or {}
    picker = _Picker()
    log = TransferLog()
    target_flat = _target_leaves(target_shardings)
    if new_layout is not None:
        new_tags = [LeafTag(*t) for t in new_layout._tags]
        target_treedef = jax.tree_util.tree_structure(new_layout.abstract)
        shapes = [tuple(x.shape) for x in jax.tree.leaves(new_layout.abstract)]
        dtypes = [x.dtype for x in jax.tree.leaves(new_layout.abstract)]
    else:
        new_tags = [LeafTag(p) for p in store.paths]
        target_treedef = store.treedef
        shapes, dtypes = store.shapes, store.dtypes
    old_tags = (
        [LeafTag(*t) for t in old_layout._tags]
        if old_layout is not None
        else [LeafTag(p) for p in store.paths]
    )
    by_path = {p: i for i, p in enumerate(store.paths)}
    families: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(old_tags):
        if t.unit is not None:
            families[t.key].append(i)
    indexes: dict[str, _SegmentIndex] = {}
    layer_indexes: dict[str, dict[int, _SegmentIndex]] = {}
    seg_cache: dict = {}
    dsts: list[_DstShard] = []
    old_tables = _slot_table(old_layout)
    new_tables = _slot_table(new_layout)
    for li, (tag, sh, shape, dtype) in enumerate(zip(new_tags, target_flat, shapes, dtypes)):
        itemsize = np.dtype(dtype).itemsize
        dmap = sh.addressable_devices_indices_map(shape)
        if tag.unit is None:
            oi = by_path[tag.key]
            sources = store.shards[oi] + extra.get(tag.key, [])
            layered = "layers" in tag.key.split("/") and _differ(old_tables, new_tables)
            for d, idx in dmap.items():
                box = index_to_box(idx, shape)
                ds = _DstShard(li, d.id, tuple(sh.shard_shape(shape)), dtype, 0, box)
                if layered:
                    plan_layered_leaf(
                        tag.key, itemsize, sources, ds, box, old_tables, new_tables, picker
                    )
                    ds.box = ()  # layer-level copies: logged by their own index
                else:
                    plan_box_leaf(tag.key, itemsize, sources, ds, box, picker)
                dsts.append(ds)
            continue
        codec, unit = new_layout.codec, new_layout.codec.unit(tag.unit)
        batch = len(unit.batch_shape)
        # per-layer storage on a pipeline: a storage shard holds its stage's slots, and a layer
        # may sit in another slot (or stage) on the other plan
        slotted = batch > 0 and (old_tables is not None or new_tables is not None)
        same_slots = not _differ(old_tables, new_tables)
        same_pieces = _same_pieces(old_layout, new_layout)
        new_ids = codec.stacked_layer_ids(unit) if slotted else None
        old_tier = families[tag.key][tag.tier] if tag.tier < len(families[tag.key]) else None
        held = {s.device: s for s in store.shards[old_tier]} if old_tier is not None else {}
        for d, idx in dmap.items():
            box = index_to_box(idx, shape)
            rank, row = box[batch][0], box[batch + 2][0]
            ds = _DstShard(li, d.id, tuple(sh.shard_shape(shape)), dtype, batch)
            old = held.get(d.id)
            if (
                same_pieces
                and old is not None
                and tuple(b - a for a, b in old.box) == ds.shape
                and tuple(old_layout.codec.tables[tag.tier][old.box[batch][0]])
                == tuple(codec.tables[tag.tier][rank])
                and (not slotted or (same_slots and old.box[:batch] == box[:batch]))
            ):
                ds.reuse = old.data  # this rank keeps this tier in place: no copy
                log.kept_bytes += math.prod(ds.shape) * itemsize
                dsts.append(ds)
                continue
            segs = _shard_segments(codec, unit, tag.tier, rank, row, seg_cache)
            if slotted:
                if tag.key not in layer_indexes:
                    layer_indexes[tag.key] = _index_family_by_layer(
                        store, old_layout, families[tag.key], old_tags, extra, seg_cache
                    )
                plan_storage_shard_by_layer(
                    tag.key, itemsize, layer_indexes[tag.key], segs, ds, box[0], new_ids, picker,
                )
                dsts.append(ds)
                continue
            if tag.key not in indexes:
                indexes[tag.key] = _index_family(
                    store, old_layout, families[tag.key], old_tags, extra, seg_cache
                )
            plan_storage_shard(tag.key, itemsize, unit.layers, indexes[tag.key], segs, ds, picker)
            dsts.append(ds)
    for ds in dsts:
        if ds.reuse is not None and not ds.copies:
            continue
        leaf = new_tags[ds.leaf].key
        for c in ds.copies:
            if c.flat or not ds.box:
                box = tuple(
                    (s.start, s.stop) if isinstance(s, slice) else (s, s + 1)
                    for s in c.dst_idx if s is not Ellipsis
                )
            else:
                box = tuple((o + s.start, o + s.stop) for (o, _), s in zip(ds.box, c.dst_idx))
            log.entries.append(Transfer(leaf, box, c.src.device, ds.device, c.nbytes, c.src.rung))
    for ds in dsts:
        if ds.reuse is None:
            _find_gaps(ds)
    return TransitionPlan(
        signature, dsts, log, target_flat, shapes, target_treedef,
        time.perf_counter() - t_start, (old_layout, new_layout),
    )


def _find_gaps(ds: _DstShard) -> None:
    """Mark what of a destination shard no copy writes, so that only that is zero-filled (the
    padding of ZeRO partitions); unknown (mixed copy kinds) means a full zero fill."""
    itemsize = np.dtype(ds.dtype).itemsize
    if sum(c.nbytes for c in ds.copies) >= math.prod(ds.shape) * itemsize:
        ds.covered = True
        return
    if not ds.copies or not all(c.flat and c.dst_idx[0] is Ellipsis for c in ds.copies):
        return
    n = math.prod(ds.shape[ds.batch :])
    spans = sorted((c.dst_idx[1].start, c.dst_idx[1].stop) for c in ds.copies)
    gaps, at = [], 0
    for a, b in spans:
        if a > at:
            gaps.append((Ellipsis, slice(at, a)))
        at = max(at, b)
    if at < n:
        gaps.append((Ellipsis, slice(at, n)))
    ds.gaps = gaps


def _differ(a, b) -> bool:
    if a is None or b is None:
        return (a is None) != (b is None)
    return a.shape != b.shape or not np.array_equal(a, b)


def _slot_table(layout):
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
        and [(u.name, u.piece, u.rotation, u.rows) for u in a.units]
        == [(u.name, u.piece, u.rotation, u.rows) for u in b.units]
    )


def _index_family(store, old_layout, leaf_ids, old_tags, extra, seg_cache=None) -> _SegmentIndex:
    """Canonical segments of every source (live shards and snapshots) of one storage family."""
    codec = old_layout.codec
    index = _SegmentIndex()
    for oi in leaf_ids:
        tag = old_tags[oi]
        unit = codec.unit(tag.unit)
        batch = len(unit.batch_shape)
        for s in store.shards[oi] + extra.get(store.paths[oi], []):
            rank, row = s.box[batch][0], s.box[batch + 2][0]
            assert s.box[batch + 2][1] - row == 1, "one storage row per device"
            for g0, g1, off in _shard_segments(codec, unit, tag.tier, rank, row, seg_cache):
                index.add(g0, g1, off, s)
    index.freeze()
    return index
