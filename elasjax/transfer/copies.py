"""Executing a transition's copies: build each destination shard from its pieces.

A plan (`reshard.TransitionPlan`) lists, for every destination shard of the new layout, the
copies that fill it (`DstShard.copies`), each reading `src.data[src_idx]` of a source named by its
`SourceRef`. Execution is split by process: every process builds the destination shards on its
own devices; a piece whose source another process holds travels through the runtime's
`transport` (`exchange`: one packed buffer per pair of processes, point to point), in the plan's
order, which every process knows. Nothing else crosses processes.

On the CPU backend a new shard is a 64-byte-aligned host buffer that JAX adopts as the device
buffer without a copy; its pieces are copied in by numpy from zero-copy views of the sources,
split over threads (numpy copies release the GIL) when there is enough to copy. The replicas of
a box on several devices share one buffer, as a replicated `jax.device_put` of a numpy array
does on CPU: adopted memory is never written (a step that donates such an input writes its
output elsewhere; `tests/test_reshard.py` checks it). Ranks whose ZeRO tiers stay in place keep
their very buffers (`reuse`). Other backends slice on the device and `device_put` the pieces.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import jaxcompat
from .shards import Shard

# ---------------------------------------------------------------------------------------------
# What a plan holds. A copy moves `src.data[src_idx]` into destination shard `dst` at `dst_idx`;
# flat copies index arrays viewed as [*batch, -1] (all layers of a ZeRO storage shard at once).


@dataclasses.dataclass(frozen=True)
class Copy:
    src: Shard
    src_idx: tuple
    dst_idx: tuple
    nbytes: int
    flat: bool  # index the [*batch, -1] view


@dataclasses.dataclass
class DstShard:
    leaf: int  # index into the target leaves
    device: int
    shape: tuple[int, ...]
    dtype: Any
    batch: int  # leading axes kept when viewed flat
    box: tuple = ()  # global box of a regular leaf's shard (for the log)
    copies: list[Copy] = dataclasses.field(default_factory=list)
    reuse: Any = None  # the source (its `SourceRef`) that is exactly this shard: kept as is
    covered: bool = False  # the copies write every element (no zero fill needed)
    gaps: list[tuple] | None = None  # else, when known: the [*batch, -1] slices no copy writes

    def flat_shape(self) -> tuple[int, ...]:
        return self.shape[: self.batch] + (math.prod(self.shape[self.batch :]),)


def index_shape(shape: tuple[int, ...], idx: tuple) -> tuple[int, ...]:
    """The shape of `x[idx]` for `x` of `shape` (basic indexing: slices, ints, one Ellipsis)."""
    if Ellipsis in idx:
        i = idx.index(Ellipsis)
        idx = idx[:i] + (slice(None),) * (len(shape) - len(idx) + 1) + idx[i + 1 :]
    out = []
    for n, s in zip(shape, idx + (slice(None),) * (len(shape) - len(idx))):
        if isinstance(s, slice):
            out.append(len(range(*s.indices(n))))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Host buffers.


def host_view(x) -> np.ndarray:
    """Zero-copy read-only view of a CPU buffer (or the numpy array itself)."""
    return x if isinstance(x, np.ndarray) else np.asarray(x)


ALIGN = 64  # the CPU client adopts 64-byte-aligned host buffers without a copy


def aligned_empty(shape: tuple[int, ...], dtype, zero: bool = False) -> np.ndarray:
    """A fresh host buffer whose data is `ALIGN`-byte aligned, so that `jax.device_put` on the
    CPU backend adopts it instead of copying it a second time."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = (np.zeros if zero else np.empty)(n + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + n].view(dtype).reshape(shape)


# Below this many distinct bytes (replicas counted once) per thread, one thread copies faster:
# the copies of a small state are short numpy calls whose Python between them holds the GIL
# (the demo's copies took about twice as long on two threads: experiments/RESULTS.md, "Figures
# moved from code comments").
THREAD_MIN_BYTES = 4 << 20


class CopyThreads:
    """The threads that fill destination shards (one per core, at most 8). Owned by whoever
    runs transitions (a runtime, a benchmark); `close` ends them."""

    def __init__(self, n: int | None = None):
        self.n = max(1, min(os.cpu_count() or 1, 8) if n is None else n)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def map(self, fn, items):
        if self.n == 1 or len(items) <= 1:
            return [fn(x) for x in items]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.n, "elasjax-copy")
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# ---------------------------------------------------------------------------------------------
# Execution.


def execute(
    dsts: list[DstShard],
    devices: dict[int, jax.Device],
    data: dict,
    *,
    transport=None,
    threads: CopyThreads | None = None,
) -> tuple[dict[tuple[int, int], Any], dict[int, int], dict[int, int]]:
    """Build this process's destination shards: ({(leaf, device): buffer}, bytes sent per peer
    process, bytes received per peer process). Copies name their sources by `SourceRef`; `data`
    maps the refs this process holds to buffers. Without a `transport` every source and
    destination is in this process."""
    me = transport.me if transport is not None else 0
    where = transport.process_of if transport is not None else (lambda _: 0)
    mine = [d for d in dsts if where(d.device) == me]
    received, sent, got = ({}, {}, {})
    if transport is not None:
        received, sent, got = _exchange(dsts, data, transport, me, where)
    cpu = all(devices[d.device].platform == "cpu" for d in mine)
    out: dict[tuple[int, int], Any] = {}
    work = []
    for d in mine:
        if d.reuse is not None:
            out[(d.leaf, d.device)] = data[d.reuse]
        elif cpu:
            work.append(d)
        else:
            out[(d.leaf, d.device)] = _build_on_device(d, devices, data, received)
    if work:
        threads = threads or CopyThreads(1)
        # shards of the same box of a leaf (replicas) are built once and share the buffer;
        # split the rest into byte-balanced groups, one per thread, each worth a thread
        same: dict = defaultdict(list)
        for d in work:
            same[(d.leaf, d.box) if d.box else id(d)].append(d)
        units = sorted(same.values(), key=lambda u: -math.prod(u[0].shape))
        size = [math.prod(u[0].shape) * np.dtype(u[0].dtype).itemsize for u in units]
        n = max(1, min(threads.n, len(units), sum(size) // THREAD_MIN_BYTES))
        groups: list[list[list[DstShard]]] = [[] for _ in range(n)]
        load = [0] * n
        for u, nbytes in zip(units, size):
            i = load.index(min(load))
            groups[i].append(u)
            load[i] += nbytes
        views: dict = {}
        for u in units:  # source views made once, on this thread
            d = u[0]
            for j, c in enumerate(d.copies):
                if (id(d), j) in received:
                    continue
                vkey = (c.src.data, c.flat, d.batch)
                if vkey not in views:
                    views[vkey] = _source_view(data[c.src.data], c.flat, d.batch)
        for part in threads.map(lambda g: _build_on_host(g, views, received), groups):
            out.update(part)
    return out, sent, got


def _source_view(x, flat: bool, batch: int) -> np.ndarray:
    src = host_view(x)
    return src.reshape(src.shape[:batch] + (-1,)) if flat else src


def _exchange(dsts, data, transport, me, where):
    """Send the pieces this process holds for other processes' shards and receive the pieces
    of its own shards held elsewhere: {(id(dst), copy index): array}, bytes sent and received
    per peer. Both sides walk the plan in the same order."""
    sends: dict[int, list[np.ndarray]] = defaultdict(list)
    recvs: dict[int, list[tuple]] = defaultdict(list)
    keys: dict[int, list[tuple]] = defaultdict(list)
    for d in dsts:
        if d.reuse is not None:
            continue
        dproc = where(d.device)
        for j, c in enumerate(d.copies):
            sproc = where(c.src.device)
            if sproc == dproc:
                continue
            if sproc == me:
                piece = _source_view(data[c.src.data], c.flat, d.batch)[c.src_idx]
                sends[dproc].append(np.ascontiguousarray(piece))
            elif dproc == me:
                shape = d.flat_shape() if c.flat else d.shape
                recvs[sproc].append((index_shape(shape, c.dst_idx), d.dtype))
                keys[sproc].append((id(d), j))
    got = transport.exchange(dict(sends), dict(recvs))
    received = {k: a for p, ks in keys.items() for k, a in zip(ks, got[p])}
    sent = {q: sum(a.nbytes for a in arrs) for q, arrs in sends.items()}
    recv_bytes = {p: sum(a.nbytes for a in got[p]) for p in keys}
    return received, sent, recv_bytes


def _build_on_host(units: list[list[DstShard]], views: dict, received: dict) -> dict:
    """Assemble destination shards in aligned host buffers from zero-copy source views. The
    shards of a unit hold the same box of a leaf (replicas): one buffer is built for all."""
    out = {}
    for unit in units:
        d = unit[0]
        # zero only what no copy writes (a full fill would touch every page twice)
        buf = aligned_empty(d.shape, d.dtype, zero=not d.covered and d.gaps is None)
        flatbuf = buf.reshape(d.flat_shape())
        for g in d.gaps or ():
            flatbuf[g] = 0
        for j, c in enumerate(d.copies):
            piece = received.get((id(d), j))
            if piece is None:
                piece = views[(c.src.data, c.flat, d.batch)][c.src_idx]
            if c.flat:
                flatbuf[c.dst_idx] = piece
            else:
                buf[c.dst_idx] = piece
        for r in unit:
            out[(r.leaf, r.device)] = buf
    return out


def _build_on_device(d: DstShard, devices: dict[int, jax.Device], data: dict, received) -> jax.Array:
    """Assemble a destination shard on its device (non-CPU backends). Host-resident sources
    (snapshots, received pieces) are placed on the destination device directly."""
    dev = devices[d.device]
    buf = jnp.zeros(d.shape, d.dtype, device=dev)
    for j, c in enumerate(d.copies):
        piece = received.get((id(d), j))
        if piece is None:
            src = data[c.src.data]
            if isinstance(src, np.ndarray):
                piece = _source_view(src, c.flat, d.batch)[c.src_idx]
            else:
                view = src.reshape(src.shape[: d.batch] + (-1,)) if c.flat else src
                piece = view[c.src_idx]
        piece = jax.device_put(piece, dev)
        if c.flat:
            buf = buf.reshape(d.flat_shape()).at[c.dst_idx].set(piece).reshape(d.shape)
        else:
            buf = buf.at[c.dst_idx].set(piece)
    return buf


# ---------------------------------------------------------------------------------------------
# Global arrays from per-device values.


def assemble(shape, sharding, dmap: dict, values: list, dtype=None) -> jax.Array:
    """One global array from this process's per-device values (in the order of `dmap`, the
    sharding's addressable device -> index map): existing single-device arrays are kept, host
    buffers placed (adopted without a copy when aligned). `dtype` is needed where this process
    holds no shard."""
    put = jaxcompat.batched_put() if values else None
    if put is not None:  # replicated too (JAX then adopts the first value for every device)
        return put(shape, sharding, values, list(dmap))
    if not values or sharding.is_fully_replicated:
        # no shard here (a process outside the plan), or replicated (make_array_from_callback
        # would read one value for all)
        arrays = [v if isinstance(v, jax.Array) else jax.device_put(v, d) for v, d in zip(values, dmap)]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)
    order = iter(zip(dmap.values(), values))

    def value(index):
        want, v = next(order)
        if index != want:  # the callback must visit devices in the order of `values`
            raise AssertionError(f"make_array_from_callback visited {index}, expected {want}")
        return v

    return jax.make_array_from_callback(shape, sharding, value)


# ---------------------------------------------------------------------------------------------
# Packed transfers between processes

_ALIGN = 8  # packed pieces start at multiples of this, so that any dtype views them in place


def pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays' bytes in one aligned buffer (a point-to-point transfer between processes)."""
    sizes = [(a.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN for a in arrays]
    buf = aligned_empty((sum(sizes),), np.uint8)
    off = 0
    for a, n in zip(arrays, sizes):
        buf[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        off += n
    return buf


def packed_size(specs: Sequence[tuple]) -> int:
    """The bytes `pack` makes of arrays of these (shape, dtype)s."""
    return sum(
        (int(np.prod(shape)) * np.dtype(dt).itemsize + _ALIGN - 1) // _ALIGN * _ALIGN
        for shape, dt in specs
    )


def unpack(buf: np.ndarray, specs: Sequence[tuple]) -> list[np.ndarray]:
    """Views of the arrays `pack` put in `buf`, by their (shape, dtype)s."""
    out, off = [], 0
    for shape, dt in specs:
        dt = np.dtype(dt)
        n = int(np.prod(shape)) * dt.itemsize
        out.append(buf[off : off + n].view(dt).reshape(shape))
        off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return out
