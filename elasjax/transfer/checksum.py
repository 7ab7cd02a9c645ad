"""Order-independent per-leaf checksums computed on device.

A leaf's checksum is a pair of wrapping uint32 sums of its bit pattern weighted by odd
position-dependent multipliers. Integer addition modulo 2**32 is associative and commutative, so
the result does not depend on how the array is sharded or in which order XLA reduces it: the same
values give the same checksum on any mesh, and any change of a single bit of a single element
changes it (the multipliers are odd, hence invertible modulo 2**32).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core import jaxcompat
from ..core.counters import CompileCounter
from ..core.sharding import path_str
from .shards import StateMismatchError

_K1 = np.uint32(0x9E3779B1)
_K2 = np.uint32(0x85EBCA77)


def _bits(x: jax.Array) -> jax.Array:
    """The bit pattern of `x` as uint32, one value per element; a 64-bit element becomes two
    (its low and high words, in a trailing axis of 2), a PRNG key its key data."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = x.dtype.itemsize * 8
    if width == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if width == 16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if width in (32, 64):  # a 64-bit element bitcasts to uint32[..., 2]
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(
        f"checksum of dtype {x.dtype} is not supported; supported: 8-, 16-, 32- and 64-bit "
        "numbers, bool and PRNG keys"
    )


def _words(x: jax.Array) -> jax.Array:
    """`x` as an array `_bits` takes one value per element of: 64-bit elements split into their
    two uint32 words (a trailing axis), PRNG keys as their key data; other arrays unchanged."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype.itemsize == 8:
        return _bits(x)
    return x


def weights(idx: jax.Array, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The two odd multipliers of element identities `idx` (uint32); zero where `valid` is
    False, so those elements do not count. Arrays with the same identities share them."""
    w1 = idx * jnp.uint32(2) * _K1 + jnp.uint32(1)
    w2 = (idx ^ jnp.uint32(0x5BD1E995)) * jnp.uint32(2) * _K2 + jnp.uint32(1)
    if valid is not None:
        w1 = jnp.where(valid, w1, jnp.uint32(0))
        w2 = jnp.where(valid, w2, jnp.uint32(0))
    return w1, w2


def checksum_with(
    bits: jax.Array, w: tuple[jax.Array, jax.Array], keep_axis: int | None = None
) -> jax.Array:
    """uint32[2] checksum of `bits` (uint32) with precomputed `weights`; with `keep_axis`, the
    partial sums along that axis, uint32[2, n] (their sum is the checksum)."""
    a = bits * w[0]
    b = (bits ^ (bits >> 13)) * w[1]
    axes = None if keep_axis is None else tuple(i for i in range(bits.ndim) if i != keep_axis)
    return jnp.stack(
        [jnp.sum(a, axis=axes, dtype=jnp.uint32), jnp.sum(b, axis=axes, dtype=jnp.uint32)]
    )


def sums_with(blocks: Sequence[jax.Array], w: tuple[jax.Array, jax.Array]) -> jax.Array:
    """uint32[len(blocks), 2]: the checksums of same-shaped `blocks` (any 8-32-bit values or
    uint32 words) with shared `weights` `w`, one reduction per sum for all of them, not one per
    block: the same values, a program half the size for XLA to compile (experiments/RESULTS.md,
    "The checksum code's compile")."""
    if len(blocks) == 1:
        return checksum_with(_bits(blocks[0]), w)[None]
    return checksum_with(jnp.stack([_bits(b) for b in blocks]), (w[0][None], w[1][None]),
                         keep_axis=0).T


# Elements hashed per loop step on the CPU. Hashing a large array in one fused pass writes its
# bit pattern and weighted products to memory before reducing them; on the CPU backend that cost
# about 5x the same work done in cache-sized tiles, each converted to bits on its own (the state
# of a 25.5M-parameter GPT: 257 -> 52 ms, experiments/RESULTS.md, "Checksums"). So arrays larger
# than this are hashed tile by tile in a loop (the same values: the sums wrap, in any order).
CHUNK = 1 << 14
# On an accelerator each loop step is a kernel launch of its own, and XLA fuses a tile's bits,
# products and sums into one reduction that writes nothing out, so small tiles cost only launches:
# with CHUNK tiles the checksums of a 303M-parameter state added 351 ms to an 82 ms step on an
# H200 (experiments/RESULTS.md, "Checksums on a GPU"). There tiles are ACCEL_CHUNK elements.
ACCEL_CHUNK = 1 << 22


def tile_elements() -> int:
    """Elements per tile of `tile_sums`: `CHUNK` where JAX's default backend is the CPU,
    `ACCEL_CHUNK` on an accelerator (the values are the same for any tile size; only the time
    differs)."""
    return CHUNK if jax.default_backend() == "cpu" else ACCEL_CHUNK


def tile_sums(xs: Sequence[jax.Array], ident, start=None, count: int | None = None,
              stop=None) -> jax.Array:
    """uint32[len(xs), 2]: the checksums of same-shaped arrays `xs` (8-32-bit values, or
    uint32 words) viewed as [rows, inner], at the identities `ident(rows, cols)` -> (uint32
    identities, validity or None) of a tile's elements (`rows`: uint32[k], `cols`: uint32
    [k, inner] or [1, c], broadcastable to the tile). With `start` (traced or static), only the
    flat positions [start, start + count) below `stop` count: a share (`count` static).

    Tiles of about `CHUNK` elements (whole rows, or pieces of one row) are hashed in a loop,
    each converted to bits and given its identities on its own; the identities of all of `xs`
    are computed once per tile."""
    R, inner = xs[0].shape
    n = R * inner
    share = start is not None
    lo = hi = None
    if share:
        lo = jnp.uint32(start)
        hi = jnp.minimum(lo + jnp.uint32(count), jnp.uint32(stop))
    zero = jnp.zeros((len(xs), 2), jnp.uint32)

    def hashed(blocks, rows, cols, repeat=None):
        idx, valid = ident(rows, cols)
        shape = blocks[0].shape
        if repeat is not None:
            valid = repeat if valid is None else valid & repeat
        if share:
            pos = rows[:, None] * jnp.uint32(inner) + cols
            inside = (pos >= lo) & (pos < hi)
            valid = inside if valid is None else valid & inside
        w = weights(jnp.broadcast_to(idx, shape),
                    None if valid is None else jnp.broadcast_to(valid, shape))
        return sums_with(blocks, w)

    C = tile_elements()
    if n <= C:  # one pass
        rows = jax.lax.iota(jnp.uint32, R)
        return hashed(list(xs), rows, jax.lax.broadcasted_iota(jnp.uint32, (R, inner), 1))
    if inner >= C:  # tiles inside rows; a row's last tile may start earlier (the repeats masked)
        per_row = -(-inner // C)
        exact = inner % C == 0
        iota = jax.lax.broadcasted_iota(jnp.uint32, (1, C), 1)
        tiles = per_row * R if not share else min(per_row * R, (-(-count // C) + 2) * (
            1 if exact else 2))
        first = 0 if not share else lo // jnp.uint32(inner) * jnp.uint32(per_row) + (
            lo % jnp.uint32(inner)) // jnp.uint32(C)

        def step(t, acc):
            tile = jnp.uint32(first) + t.astype(jnp.uint32)
            inside = tile < jnp.uint32(per_row * R)
            tile = jnp.minimum(tile, jnp.uint32(per_row * R - 1))
            row = tile // jnp.uint32(per_row)
            want = (tile % jnp.uint32(per_row)) * jnp.uint32(C)
            at = jnp.minimum(want, jnp.uint32(inner - C))
            blocks = [jax.lax.dynamic_slice(x, (row, at), (1, C)) for x in xs]
            cols = at + iota
            repeat = None if exact else cols >= want
            got = hashed(blocks, row[None], cols, repeat)
            return acc + (jnp.where(inside, got, jnp.uint32(0)) if share else got)

        return jax.lax.fori_loop(0, tiles, step, zero)
    # tiles of k whole rows; the last one may start earlier (the repeated rows masked)
    k = C // inner
    n_tiles = -(-R // k)
    exact = R % k == 0
    cols = jax.lax.broadcasted_iota(jnp.uint32, (k, inner), 1)
    if share:
        first = lo // jnp.uint32(inner * k)
        steps = min(n_tiles, -(-count // (inner * k)) + 1)
    else:
        first, steps = 0, n_tiles

    def step(t, acc):
        want = (jnp.uint32(first) + t.astype(jnp.uint32)) * jnp.uint32(k)
        at = jnp.minimum(want, jnp.uint32(R - k))
        blocks = [jax.lax.dynamic_slice_in_dim(x, at, k) for x in xs]
        rows = at + jax.lax.iota(jnp.uint32, k)
        repeat = None if exact and not share else (rows >= want)[:, None]
        return acc + hashed(blocks, rows, cols, repeat)

    return jax.lax.fori_loop(0, steps, step, zero)


def grid_sums(bits, row_base=None, start=None, count: int | None = None, stop=None) -> jax.Array:
    """uint32[2] checksum of `bits` viewed as [rows, inner], the element at (r, c) having the
    identity `row_base(r) + c` (default: its row-major position); `start`, `count`, `stop`: a
    share, as in `tile_sums`. Given a list of same-shaped arrays, uint32[len, 2], their
    identities computed once for all of them."""
    xs = list(bits) if isinstance(bits, (list, tuple)) else [bits]
    inner = xs[0].shape[1]
    base = row_base if row_base is not None else (lambda r: r * jnp.uint32(inner))
    sums = tile_sums(xs, lambda rows, cols: (base(rows)[:, None] + cols, None), start, count, stop)
    return sums if isinstance(bits, (list, tuple)) else sums[0]


def same_shape_groups(xs: Sequence[Any], key=lambda x: tuple(x.shape)) -> list[list[int]]:
    """Positions of `xs` grouped by `key` (in order of first appearance). Arrays of one shape
    share their element identities, so one pass hashes them all: a leaf's checksum is the same
    alone or in a group, only the program is smaller (a tiny GPT's 57 state leaves fall into 13
    groups; experiments/RESULTS.md, "The checksum code's compile")."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(key(x), []).append(i)
    return list(groups.values())


def in_order(groups: list[list[int]], sums: Sequence[jax.Array]) -> jax.Array:
    """uint32[n, 2] in the original order, from each group's uint32[len(group), 2]."""
    rows = jnp.concatenate(list(sums)) if len(sums) > 1 else sums[0]
    at = np.argsort(np.concatenate([np.asarray(g) for g in groups]), kind="stable")
    return rows if (at == np.arange(len(at))).all() else rows[at]


def leaf_checksum(x: jax.Array) -> jax.Array:
    """uint32[2] checksum of one array (any sharding); element identity = row-major index."""
    return leaf_checksums([x])[0]


def leaf_checksums(xs: Sequence[jax.Array]) -> jax.Array:
    """uint32[n, 2]: `leaf_checksum` of each of `xs`, arrays of one shape hashed in one pass."""
    flat = [_words(x).reshape(-1) for x in xs]
    groups = same_shape_groups(flat)
    sums = []
    for group in groups:
        big = flat[group[0]].size > tile_elements()
        sums.append(grid_sums([flat[i].reshape((1, -1) if big else (-1, 1)) for i in group]))
    return in_order(groups, sums)


def _axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _axes_index(mesh, names: Sequence[str]):
    """(combined index, count) of this device along `names` (row-major, the first name major),
    inside a `shard_map` over `mesh`."""
    index, count = jnp.uint32(0), 1
    for name in names:
        size = mesh.shape[name]
        index = index * jnp.uint32(size) + jax.lax.axis_index(name).astype(jnp.uint32)
        count *= size
    return index, count


def _block_sums(mesh, xs: Sequence[jax.Array], spec, global_shape: tuple[int, ...]) -> jax.Array:
    """This device's uint32[len(xs), 2] share of the checksums of leaves of `global_shape` laid
    out by `spec`, from their same-shaped blocks `xs` (inside a `shard_map`): the blocks'
    elements at their global row-major identities; a block held by R devices (replicated over
    the mesh axes `spec` leaves out) is split R ways, so each element is counted once over the
    mesh."""
    bits = [_words(x) for x in xs]
    # a 64-bit element's two words are a trailing axis, whole on every device
    shape = tuple(global_shape) + tuple(bits[0].shape[xs[0].ndim:])
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    used = {a for e in entries for a in _axes_of(e)}
    r, R = _axes_index(mesh, [a for a in mesh.axis_names if a not in used])
    if not used:
        grids, row_base = [b.reshape(1, -1) for b in bits], None
    else:
        grids, row_base = _block_grid(mesh, bits, shape, entries)
    if R == 1:
        return grid_sums(grids, row_base)
    n = bits[0].size
    c = -(-n // R)  # this device's share of the block's flat elements
    return grid_sums(grids, row_base, start=r * jnp.uint32(c), count=c, stop=n)


def _block_grid(mesh, bits: Sequence[jax.Array], shape: tuple[int, ...], entries):
    """(this device's same-shaped blocks `bits` each as [rows, inner], row -> global row-major
    identity of the row's first element) for arrays of `shape` (inside a `shard_map`). The
    block's dimensions from the last sharded one on are one contiguous run of the global order
    (`inner` elements); a row's start follows from its leading coordinates."""
    local = bits[0].shape
    nd = len(shape)
    sharded = [i for i in range(nd) if _axes_of(entries[i])]
    last = sharded[-1]
    inner = int(np.prod(local[last:], dtype=np.int64))
    strides = [int(np.prod(shape[i + 1:], dtype=np.uint64) % (1 << 32)) for i in range(nd)]
    base = jnp.uint32(0)  # the block's offset along every sharded dimension
    for i in sharded:
        block, _ = _axes_index(mesh, _axes_of(entries[i]))
        base = base + block * jnp.uint32(local[i]) * jnp.uint32(strides[i])
    # leading dimensions (before `last`), consecutive unsharded ones merged: [extent, stride]
    lead: list[list[int]] = []
    for i in range(last):
        if lead and i - 1 not in sharded and i not in sharded:
            lead[-1][0] *= local[i]
            lead[-1][1] = strides[i]
        else:
            lead.append([local[i], strides[i]])

    def row_base(row):
        idx = base + jnp.zeros_like(row)
        for extent, stride in reversed(lead):
            idx = idx + (row % jnp.uint32(extent)) * jnp.uint32(stride)
            row = row // jnp.uint32(extent)
        return idx

    return [b.reshape(-1, inner) for b in bits], row_base


# elements: a replicated leaf smaller than this is hashed whole on every device that holds it (no
# communication); sharing its hashing out costs more, in a cross-device sum, than it saves
SPLIT_MIN = 1 << 20


def on_mesh(shape: Sequence[int], spec, mesh) -> bool:
    """Whether `mesh_checksums` should take a leaf of `shape` laid out by `spec`: the spec
    splits every axis evenly (as `shard_map` needs), and the leaf is sharded (`leaf_checksum`
    would gather it) or big enough to be worth sharing out."""
    sizes = [int(np.prod([mesh.shape[a] for a in _axes_of(e)], dtype=np.int64)) for e in spec]
    if any(n % k for n, k in zip(shape, sizes)):
        return False
    return any(k > 1 for k in sizes) or int(np.prod(shape, dtype=np.int64)) >= SPLIT_MIN


def mesh_checksums(xs: Sequence[jax.Array], specs: Sequence[Any], mesh) -> jax.Array:
    """uint32[n, 2]: `leaf_checksum` of each of `xs` (traceable), laid out on `mesh` by `specs`
    (PartitionSpecs), with each element hashed once over the mesh and one all-reduce for all
    leaves. `leaf_checksum` under GSPMD hashes a replicated leaf on every device that holds it and
    gathers a sharded one before flattening it; the values are the same (wrapping sums are
    exact in any order)."""
    xs, specs = list(xs), list(specs)
    for i, x in enumerate(xs):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # as its key data (trailing axes whole)
            xs[i] = jax.random.key_data(x)
            specs[i] = jax.sharding.PartitionSpec(*specs[i], *([None] * (xs[i].ndim - x.ndim)))
    shapes = [tuple(x.shape) for x in xs]

    # leaves of one shape, dtype width and layout share their blocks' element identities
    groups = same_shape_groups(range(len(xs)), lambda i: (
        shapes[i], xs[i].dtype.itemsize == 8, tuple(specs[i]) + (None,) * (len(shapes[i]) - len(
            tuple(specs[i])))))

    def local(*blocks):
        sums = [_block_sums(mesh, [blocks[i] for i in g], specs[g[0]], shapes[g[0]])
                for g in groups]
        return jax.lax.psum(in_order(groups, sums), tuple(mesh.axis_names))

    return jax.shard_map(
        local, mesh=mesh, in_specs=tuple(specs), out_specs=jax.sharding.PartitionSpec(),
        check_vma=False,
    )(*xs)


def np_leaf_checksum(x: np.ndarray) -> np.ndarray:
    """`leaf_checksum` computed with numpy on the host (same values)."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    width = x.dtype.itemsize * 8
    if width not in (8, 16, 32, 64):
        raise TypeError(f"checksum of dtype {x.dtype} is not supported")
    # a 64-bit element is its two uint32 words, low first (little-endian), as `_bits`
    view = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint32}[width]
    bits = np.ascontiguousarray(x).reshape(-1).view(view).astype(np.uint32)
    idx = np.arange(bits.size, dtype=np.uint32)
    with np.errstate(over="ignore"):
        w1 = idx * np.uint32(2) * _K1 + np.uint32(1)
        w2 = (idx ^ np.uint32(0x5BD1E995)) * np.uint32(2) * _K2 + np.uint32(1)
        h1 = np.sum(bits * w1, dtype=np.uint32)
        h2 = np.sum((bits ^ (bits >> np.uint32(13))) * w2, dtype=np.uint32)
    return np.array([h1, h2], dtype=np.uint32)


def hex_of(a) -> str:
    a = np.asarray(a, dtype=np.uint32)
    return f"{int(a[0]):08x}{int(a[1]):08x}"


def tree_checksums(tree: Any, shardings: Any = None) -> Any:
    """A pytree of uint32[2] checksums (traceable; use inside or outside jit). Given the tree's
    `shardings` (NamedShardings), its sharded and large leaves on the first leaf's mesh go
    through `mesh_checksums` (same values, no gathering, no hashing on every replica)."""
    if shardings is None:
        return jax.tree.map(leaf_checksum, tree)
    leaves, treedef = jax.tree.flatten(tree)
    shs = treedef.flatten_up_to(shardings)
    mesh = next((s.mesh for s in shs if isinstance(s, jax.sharding.NamedSharding)), None)
    take = [
        i for i, (x, s) in enumerate(zip(leaves, shs))
        if isinstance(s, jax.sharding.NamedSharding) and s.mesh == mesh
        and on_mesh(x.shape, s.spec, mesh)
    ]
    taken = set(take)
    rest = [i for i in range(len(leaves)) if i not in taken]
    out: list[Any] = [None] * len(leaves)
    if rest:
        rows = leaf_checksums([leaves[i] for i in rest])
        for j, i in enumerate(rest):
            out[i] = rows[j]
    if take:
        rows = mesh_checksums([leaves[i] for i in take], [shs[i].spec for i in take], mesh)
        for j, i in enumerate(take):
            out[i] = rows[j]
    return jax.tree.unflatten(treedef, out)


def to_host(sums: Any) -> dict[str, str]:
    """Device checksums -> {leaf path: 16-hex-digit string}."""
    out = {}
    for path, v in jax.tree_util.tree_flatten_with_path(sums)[0]:
        out[path_str(path)] = hex_of(v)
    return out


def stack(sums: dict[str, jax.Array]) -> jax.Array:
    """Traceable: {key: uint32[2]} -> uint32[n, 2] in sorted key order (one array to read)."""
    return jnp.stack([sums[k] for k in sorted(sums)])


def rows_to_host(keys, rows) -> dict[str, str]:
    """Stacked checksums (`stack`; `keys` sorted) -> {key: hex}."""
    rows = np.asarray(rows)
    return {k: hex_of(r) for k, r in zip(keys, rows)}


def diff(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Leaf paths whose checksums differ (or are missing on either side)."""
    keys = sorted(set(expected) | set(actual))
    return [k for k in keys if expected.get(k) != actual.get(k)]


def verify(expected: dict[str, str], actual: dict[str, str], what: str, against: str) -> int:
    """Raise `StateMismatchError` where `actual` differs from `expected`: the one check, and
    the one error, of every rebuilt state (a recovery in the loop or in `ElasticState`, a
    checkpoint restore, a cut-over). `what`: the state checked; `against`: what it must equal.
    Returns the number of leaves compared (every key of either side); an empty comparison is
    refused too, since it would check nothing."""
    bad = diff(expected, actual)
    if bad:
        raise StateMismatchError(
            f"{what}: {len(bad)} leaves differ from {against}, e.g. {bad[:3]}; refused"
        )
    compared = len(set(expected) | set(actual))
    if not compared:
        raise StateMismatchError(f"{what}: no leaf checksums to compare with {against}; refused")
    return compared


def covered_bytes(tree: Any) -> int:
    """The bytes a checksum of every leaf of `tree` covers: each leaf's global size times its
    element width, once however many devices hold it (a PRNG key as its key data; a ZeRO
    storage leaf with its padding, which its checksum masks out). Shapes only: no device work."""
    total = 0
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.eval_shape(jax.random.key_data, x)
        total += int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def digest(sums: dict[str, str]) -> str:
    """One short digest of a state's per-leaf checksums."""
    import hashlib

    text = "\n".join(f"{k}={v}" for k, v in sorted(sums.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- per-device checksums of chosen leaves, compiled ahead (the snapshot pool's) ------------------

def _specs(state_shardings) -> list:
    return [s.spec for s in jax.tree.leaves(state_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))]


def _leaf_checksums(mesh: Mesh, specs: tuple, copies: tuple[int, ...] = ()):
    """shard_map: the listed leaves (laid out by `specs`) -> uint32[*mesh.shape, n, 2], each
    device's checksum of its own block of each leaf (block-local element order, as
    `np_leaf_checksum`). Any mesh: the trainer's (data, stage, tensor) or a user's own
    axes. With `copies` (one count per leaf), followed by that many copies of each leaf, laid
    out as it: new buffers that XLA's copies fill on each device (`SnapshotPool`'s fused
    copies)."""
    ndim = len(mesh.axis_names)
    copies = tuple(copies) or (0,) * len(specs)

    def local(*blocks):
        sums = leaf_checksums(blocks)[(None,) * ndim]
        if not any(copies):
            return sums
        return (sums, *(b for b, k in zip(blocks, copies) for _ in range(k)))

    out_specs = PartitionSpec(*mesh.axis_names)
    if any(copies):
        out_specs = (out_specs, *(sp for sp, k in zip(specs, copies) for _ in range(k)))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)


# `shard_checksums`' compiled functions, by what they depend on: a recovery's new pool finds the
# one the standby compiled for its plan (`snapshot.prepare_checksums`) instead of compiling it.
# Each entry is (function, its serialized source, the device ids that source names): a function
# loaded by `rebind_checksums` keeps the form it was loaded from, since XLA:CPU cannot serialize a
# loaded executable again (run, the copy fails: "Function add_multiply_fusion.1 not found"); None:
# not serialized yet; False: loaded by JAX's persistent compilation cache, so never serializable.
# The standby prepares one per plan it builds and a rebind copies every one kept for the old mesh,
# so the bound must hold a standby set and more: an entry evicted before its recovery is compiled
# on that recovery's path (16 made tests/test_standby_baselines.py::
# test_a_standby_hit_compiles_nothing_for_its_first_snapshot compile once after test_zero_train.py
# in one process, whose entries on the same mesh the rebinds copied too)
_COMPILED: OrderedDict = OrderedDict()
_COMPILED_LOCK = threading.Lock()
COMPILED_KEPT = 64


def _keep(key, entry) -> None:
    with _COMPILED_LOCK:
        _COMPILED[key] = entry
        while len(_COMPILED) > COMPILED_KEPT:
            _COMPILED.popitem(last=False)


def shard_checksums(state_shardings, mesh: Mesh, leaf_ids: list[int], abstract,
                    copies: tuple[int, ...] = ()) -> Any:
    """The on-device checksums of the listed leaves (`_leaf_checksums`), and with `copies` (a
    count per leaf) that many copies of each, compiled ahead for leaves of `abstract`'s shapes
    and dtypes laid out by `state_shardings`; kept (the latest `COMPILED_KEPT`) by mesh,
    layouts, shapes and copies."""
    specs = _specs(state_shardings)
    avals = jax.tree.leaves(abstract)
    copies = tuple(copies) if any(copies) else ()
    key = (mesh, tuple((specs[i], tuple(avals[i].shape), str(avals[i].dtype)) for i in leaf_ids),
           copies)
    with _COMPILED_LOCK:
        entry = _COMPILED.get(key)
        if entry is not None:
            _COMPILED.move_to_end(key)
            return entry[0]
    args = [
        jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype, sharding=NamedSharding(mesh, specs[i]))
        for i in leaf_ids
    ]
    with CompileCounter(event=CompileCounter.CACHE_HIT) as cached:
        fn = jax.jit(_leaf_checksums(mesh, tuple(specs[i] for i in leaf_ids), copies)).lower(
            *args).compile()
    # one that JAX's persistent cache loaded cannot be serialized again: never rebound (False)
    _keep(key, (fn, False if cached.count else None, tuple(d.id for d in mesh.devices.flat)))
    return fn


def rebind_checksums(old: Mesh, new: Mesh, load) -> int:
    """Put the checksums compiled for `old` (`shard_checksums`) onto `new`, a mesh of the same
    shape on other devices or on a renewed client's devices, without compiling. `load(serialized,
    ids)` loads a serialized executable (`jax.experimental.serialize_executable.serialize`) whose
    device references name `ids` onto `new`'s devices, position for position (`executables.rebind`).
    Returns how many it put."""
    with _COMPILED_LOCK:
        kept = [(k, e) for k, e in _COMPILED.items() if k[0] == old and e[1] is not False]
    put = 0
    for (_, *rest), (fn, source, ids) in kept:
        key = (new, *rest)
        with _COMPILED_LOCK:
            if key in _COMPILED:
                continue
        source = jaxcompat.serialize(fn) if source is None else source
        _keep(key, (load(source, ids), source, ids))
        put += 1
    return put
