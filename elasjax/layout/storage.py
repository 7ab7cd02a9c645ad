"""ZeRO storage: the units a state is partitioned by, where a tier puts each rank's pieces of a
row, and the codec between parameter-shaped trees and storage tiers (`ZeroCodec`). Which pieces
each data rank holds is the plan's `ZeroLayout` (`elasjax.plan.zero`).

- A **unit** is what gets partitioned on its own. `interleaved`: every parameter leaf is a unit
  (a stacked-layer leaf is partitioned per layer under ZeRO-3, which gathers one layer at a
  time, and on pipelines, whose layer slots are sharded over `stage`). `contiguous` (the
  Megatron/DeepSpeed distributed-optimizer layout): all tensor-sharded leaves form one flat
  buffer and all other leaves another.
- A unit has `rows` rows (one per tensor rank; 1 for units replicated over `tensor`): row r is
  tensor rank r's blocks of the unit's leaves, each flattened in its own row-major order, as the
  rank holds them. Each row is cut into `K` **pieces** of `row_len // K` or one more elements
  (piece k: `[k * row_len // K, (k + 1) * row_len // K)`), with no padding.
- The **tiers** say which piece each data rank stores in each slot. Storage tier `i` of a unit
  is an array `[*layers, data, rows, width_i]` sharded over `data` (and `tensor` on the rows):
  rank d's pieces of row r, consecutive pieces merged into runs (`TierPlace`), zeros after them
  up to the tier's width (its longest rank's elements).

Why this form: the train step converts parameters and gradients to storage and the updated
storage back every step, so it must cost what sharding the optimizer state by annotation costs.
A rank's storage is slices of its own row (no transpose, no gather), and in the layout a fresh
start has, whenever the data degree divides the row, the tier gathered over `data` *is* the
row: the all-gather writes the parameter block as it lands. Element identities (checksums,
transitions across tensor degrees) are row-major positions in the full leaves, the same on every
plan; a tensor rank's block is not contiguous in them, which costs only at recovery time
(`ZeroCodec.segments`).

Storage past a rank's runs is zero. Adam keeps zeros zero (zero gradient, zero moment, zero
update, and weight decay of zero is zero), so padding never leaks into real values.

"""


from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.mesh import DATA, LOGICAL_RULES, TENSOR
from ..core.packing import all_gather_packed
from ..core.sharding import path_str
from ..plan.zero import ZeroLayout

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Member:
    """A parameter leaf inside a unit."""

    path: str
    shape: tuple[int, ...]
    tdim: int | None  # dimension sharded over `tensor` (full-leaf index), if any
    stacked: bool  # the leading axis is the unit's per-layer batch axis
    row_offset: int  # where the member's block starts inside a unit row
    full_offset: int  # where the member starts in the unit's element identities

    @property
    def inner_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape

    @property
    def size(self) -> int:
        return math.prod(self.inner_shape)

    def around_tdim(self, rows: int) -> tuple[int, int, int, int]:
        """(A, n, n_local, B): the inner shape as [A, n, B] around the tensor dimension (n its
        extent, n_local = n / rows its block on one tensor rank). No tensor dimension: one
        block of the whole inner shape."""
        if self.tdim is None:
            return 1, self.size, self.size, 1
        inner, td = self.inner_shape, self.tdim - (1 if self.stacked else 0)
        A, n, B = math.prod(inner[:td]), inner[td], math.prod(inner[td + 1:])
        return A, n, n // rows, B

    def local_shape(self, rows: int) -> tuple[int, ...]:
        """One tensor rank's block of the inner shape."""
        inner = list(self.inner_shape)
        if self.tdim is not None:
            td = self.tdim - (1 if self.stacked else 0)
            inner[td] //= rows
        return tuple(inner)


@dataclasses.dataclass(frozen=True)
class Unit:
    name: str
    members: tuple[Member, ...]
    rows: int  # tensor ranks the unit is split over (1: replicated over `tensor`)
    tensor_sharded: bool
    layers: int  # the per-layer batch axis' length (0 = none)
    row_len: int  # elements per row: one tensor rank's blocks of the members, flattened

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return (self.layers,) if self.layers else ()

    @property
    def total(self) -> int:
        """Element identities per layer (the members' inner sizes)."""
        return self.rows * self.row_len


@dataclasses.dataclass(frozen=True)
class TierPlace:
    """Where one storage tier of one unit puts the row: each rank's runs (storage offset, row
    offset, length) in storage order, and the tier's width (the longest rank's elements)."""

    runs: tuple[tuple[tuple[int, int, int], ...], ...]  # rank -> runs
    width: int

    @property
    def lengths(self) -> list[int]:
        return [sum(n for _, _, n in r) for r in self.runs]

    @property
    def simple(self) -> bool:
        """Every rank holds at most one run, at the start of its storage."""
        return all(len(r) <= 1 for r in self.runs)

    def exact(self, row_len: int) -> bool:
        """Rank d holds exactly elements [d * width, (d + 1) * width) and they fill the row:
        the tier gathered over `data` is the row itself."""
        return self.width * len(self.runs) == row_len and all(
            r == ((0, d * self.width, self.width),) for d, r in enumerate(self.runs)
        )


def place(layout: ZeroLayout, row_len: int) -> list[TierPlace]:
    """Each tier's placement of a row of `row_len` elements. Piece k of the row is the elements
    [k * row_len // K, (k + 1) * row_len // K): pieces differ by at most one element and pad
    nothing, so a fresh layout whose degree divides the row holds it exactly, without padding."""
    out = []
    for tier in layout.tiers:
        runs = []
        for slots in tier:
            k = np.asarray([x for x in slots if x >= 0], np.int64)
            a, b = _bounds(k, row_len, layout.n_pieces)
            keep = b > a
            a, b = a[keep], b[keep]
            if not a.size:
                runs.append(())
                continue
            brk = np.nonzero(a[1:] != b[:-1])[0] + 1  # a run ends where the next piece jumps
            first = np.concatenate([[0], brk])
            last = np.concatenate([brk, [a.size]])
            at = np.concatenate([[0], np.cumsum(b - a)])
            runs.append(tuple(
                (int(at[i]), int(a[i]), int(b[j - 1] - a[i])) for i, j in zip(first, last)
            ))
        width = max([1] + [sum(r[2] for r in rr) for rr in runs])
        out.append(TierPlace(tuple(runs), width))
    return out


def _bounds(k: np.ndarray, row_len: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Row offsets [start, end) of pieces `k`."""
    return k * row_len // K, (k + 1) * row_len // K


def tier_widths(layout: ZeroLayout, row_len: int) -> list[int]:
    """Elements every rank allocates per tier for a row of `row_len` (the longest rank's)."""
    out = []
    for tier in layout.tiers:
        t = np.asarray(tier, np.int64)
        a, b = _bounds(np.maximum(t, 0), row_len, layout.n_pieces)
        out.append(max(1, int(np.where(t >= 0, b - a, 0).sum(axis=1).max())))
    return out


class ZeroCodec:
    """Converts parameter-shaped trees to and from storage tiers for one plan.

    Storage tier i of unit u is an array [*layers, data, rows, width_i] sharded over `data` and
    (for a tensor-sharded unit) `tensor` on `rows`: rank d's part of tensor row r. A row is one
    tensor rank's blocks of the unit's members, each flattened in its own row-major order (no
    transpose); the `TierPlace` says which row elements each rank stores where. Element
    identities (checksums; `natural_runs`) are the row-major positions in the full leaves, the
    same for every tensor degree.

    Given the `mesh`, `to_storage` and `from_storage` run per device (`shard_map`): a rank
    slices its own elements out of its row, and the row is gathered over `data` and, in the
    layout a fresh start has whenever the data degree divides the row, is the parameter block
    as it lands (no copy): what sharding the optimizer state by annotation costs. Without a
    mesh they compute the same arrays on global values."""

    # False: every unit sliced per device, exact or not (the step before issue 46: the
    # `sliced storage` loops of experiments/bench_scale.py measure it beside the default)
    annotate_exact = True

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
        layers in order; `layer_axis` is the mesh axis it is sharded over (`stage`). Stacked
        leaves are partitioned per layer under ZeRO-3 (a layer is gathered at a time) and on
        pipelines (their slot axis is sharded over `stage`); otherwise a leaf is one unit."""
        self.layout, self.tensor = layout, tensor
        self.layer_ids, self.layer_axis = layer_ids, layer_axis
        per_layer = layout.stage == 3 or layer_ids is not None
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
        specs = self.treedef.flatten_up_to(logical)
        infos = []
        for (path, x), spec in zip(flat, specs):
            names = tuple(spec) + (None,) * (len(x.shape) - len(spec))
            tdims = [i for i, n in enumerate(names) if n and LOGICAL_RULES.get(n) == TENSOR]
            if len(tdims) > 1:
                raise ValueError(f"parameter '{path_str(path)}' is sharded over tensor twice")
            stacked = per_layer and bool(names) and names[0] == "layers"
            infos.append((path_str(path), tuple(x.shape), tdims[0] if tdims else None, stacked))
        self.paths = [i[0] for i in infos]
        units = []
        if layout.kind == "interleaved":
            for p, shape, tdim, stacked in infos:
                rows = tensor if tdim is not None else 1
                m = Member(p, shape, tdim, stacked, 0, 0)
                units.append(Unit(p, (m,), rows, tdim is not None, shape[0] if stacked else 0,
                                  m.size // rows))
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
                units.append(Unit(name, tuple(members), rows, sharded, 0, roff))
        self.units = units
        self.tables = [
            np.asarray(t, dtype=np.int32).reshape(layout.data, -1) for t in layout.tiers
        ]
        self.places = {u.name: place(layout, u.row_len) for u in units}
        # units whose storage is the row cut in `data` equal parts in rank order (a fresh
        # layout whose data degree divides the row): converted by reshapes and sharding
        # annotations, so XLA partitions the conversion with the step (`to_storage`)
        self.exact_units = frozenset(
            u.name for u in units if self.annotate_exact
            and len(self.places[u.name]) == 1 and self.places[u.name][0].exact(u.row_len))
        self.exact_paths = frozenset(
            m.path for u in units if u.name in self.exact_units for m in u.members)
        # the leaves of exact units of one member: their storage is `[data, rows, row_len /
        # data]`, rank d's part elements [d * width, (d + 1) * width) of its row, which a
        # gradient can be handed in already (`to_storage`'s `ready`)
        self.whole_tier_paths = frozenset(
            u.members[0].path for u in units if u.name in self.exact_units and len(u.members) == 1)

    # -- specs ----------------------------------------------------------------------------------

    def member_spec(self, m: Member, batch: bool = True) -> PartitionSpec:
        """The mesh layout of a member leaf in the plan (as `sharding.named_shardings` gives
        it); without `batch`, of one layer of a stacked one."""
        entries = [None] * len(m.shape)
        if m.stacked and self.layer_axis is not None:
            entries[0] = self.layer_axis
        if m.tdim is not None:
            entries[m.tdim] = TENSOR
        if not batch and m.stacked:
            entries = entries[1:]
        return PartitionSpec(*entries)

    def storage_spec(self, u: Unit, batch: bool = True) -> PartitionSpec:
        lead = [self.layer_axis] if u.batch_shape and batch else []
        return PartitionSpec(*lead, DATA, TENSOR if u.tensor_sharded else None, None)

    def storage_shardings(self, mesh: Mesh) -> dict[str, tuple[NamedSharding, ...]]:
        return {
            u.name: tuple(NamedSharding(mesh, self.storage_spec(u)) for _ in self.tables)
            for u in self.units
        }

    def abstract_storage(self, dtype=jnp.float32) -> dict[str, tuple[jax.ShapeDtypeStruct, ...]]:
        return {
            u.name: tuple(
                jax.ShapeDtypeStruct(u.batch_shape + (self.layout.data, u.rows, p.width), dtype)
                for p in self.places[u.name]
            )
            for u in self.units
        }

    def stacked_layer_ids(self, u: Unit) -> np.ndarray:
        """Global layer id of each index of a stacked unit's layer axis (-1 = empty slot)."""
        return self.layer_ids if self.layer_ids is not None else np.arange(u.layers)

    def unit(self, name: str) -> Unit:
        return next(u for u in self.units if u.name == name)

    # -- rows ------------------------------------------------------------------------------------

    @staticmethod
    def _block_row(u: Unit, blocks: Sequence[jax.Array], batch: int) -> jax.Array:
        """The members' blocks of one tensor rank -> [*batch, row_len]."""
        flat = [b.reshape(b.shape[:batch] + (-1,)) for b in blocks]
        return flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=-1)

    @staticmethod
    def _row_blocks(u: Unit, row: jax.Array, batch: int) -> list[jax.Array]:
        """[*batch, row_len] -> the members' blocks of one tensor rank."""
        out = []
        for m in u.members:
            seg = row[..., m.row_offset: m.row_offset + m.size // u.rows]
            out.append(seg.reshape(row.shape[:batch] + m.local_shape(u.rows)))
        return out

    def _global_rows(self, u: Unit, leaves: dict[str, jax.Array], batch: int) -> jax.Array:
        """Full member leaves -> [*batch, rows, row_len] (row r: tensor rank r's blocks)."""
        parts = []
        for m in u.members:
            x = leaves[m.path]
            A, n, nl, B = m.around_tdim(u.rows)
            x = x.reshape(x.shape[:batch] + (A, u.rows, nl, B))
            x = jnp.moveaxis(x, batch + 1, batch)
            parts.append(x.reshape(x.shape[:batch] + (u.rows, A * nl * B)))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)

    def _global_leaves(self, u: Unit, rows: jax.Array, batch: int) -> dict[str, jax.Array]:
        out = {}
        for m in u.members:
            A, n, nl, B = m.around_tdim(u.rows)
            seg = rows[..., m.row_offset: m.row_offset + m.size // u.rows]
            x = seg.reshape(seg.shape[:batch] + (u.rows, A, nl, B))
            x = jnp.moveaxis(x, batch, batch + 1)
            out[m.path] = x.reshape(x.shape[:batch] + m.inner_shape)
        return out

    # -- one rank's storage from its row, and the row from the gathered storage -----------------

    def _take(self, u: Unit, tier: int, row: jax.Array, rank) -> jax.Array:
        """[*b, row_len] -> [*b, width]: what `rank` (traced inside a `shard_map`) stores of the
        row in `tier`; the rest of its width is zeros."""
        pl = self.places[u.name][tier]
        W, L = pl.width, u.row_len
        lens = np.asarray(pl.lengths, np.int32)
        n = jnp.asarray(lens)[rank]
        padded = jnp.pad(row, [(0, 0)] * (row.ndim - 1) + [(0, W)])
        w = jax.lax.iota(jnp.int32, W)
        if pl.simple:  # one run: a slice (pad and slice fuse into one pass over the width)
            starts = np.asarray([r[0][1] if r else 0 for r in pl.runs], np.int32)
            out = jax.lax.dynamic_slice_in_dim(padded, jnp.asarray(starts)[rank], W, axis=-1)
            return out if (lens == W).all() else jnp.where(w < n, out, jnp.zeros((), out.dtype))
        dst, src = self._run_tables(pl)
        pos = self._row_pos(w, jnp.asarray(dst)[rank], jnp.asarray(src)[rank])
        return jnp.take(padded, jnp.where(w < n, pos, L), axis=-1)

    @staticmethod
    def _run_tables(pl: TierPlace) -> tuple[np.ndarray, np.ndarray]:
        """[ranks, most runs] storage and row offsets of each rank's runs (unused runs start past
        the width, so they never apply)."""
        R = max(1, max(len(r) for r in pl.runs))
        dst = np.full((len(pl.runs), R), np.iinfo(np.int32).max, np.int32)
        src = np.zeros((len(pl.runs), R), np.int32)
        for d, rr in enumerate(pl.runs):
            for j, (a, s, _) in enumerate(rr):
                dst[d, j], src[d, j] = a, s
        return dst, src

    @staticmethod
    def _row_pos(w, dst, src):
        """Row offset of storage position `w` from one rank's run tables (`dst`, `src`: [...,
        runs], runs in storage order: the last run starting at or before `w` holds it)."""
        pos = src[..., 0] + (w - dst[..., 0])
        for j in range(1, dst.shape[-1]):
            pos = jnp.where(w >= dst[..., j], src[..., j] + (w - dst[..., j]), pos)
        return pos

    def _assemble(self, u: Unit, tier: int, gathered: Sequence[jax.Array]) -> jax.Array:
        """[*b, data * width_i] per tier (every rank's storage side by side) -> [*b, row_len]:
        the gathered tier itself where it is exact, else the row's runs in order."""
        places = self.places[u.name]
        if len(places) == 1 and places[0].exact(u.row_len):
            return gathered[0]
        runs = sorted(
            (s, i, d * pl.width + a, n)
            for i, pl in enumerate(places) for d, rr in enumerate(pl.runs) for a, s, n in rr
        )
        parts = [gathered[i][..., o: o + n] for _, i, o, n in runs]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)

    # -- tree <-> storage -----------------------------------------------------------------------

    def to_storage(self, params: PyTree, mesh: Mesh | None = None,
                   ready: frozenset[str] = frozenset()) -> dict[str, tuple[jax.Array, ...]]:
        """Parameter-shaped tree -> storage tiers. Given the `mesh` the tree is laid out on
        (`member_spec`), an exact unit's rows are cut into `data` parts by a reshape under the
        storage's sharding, and for the other units each device slices what its rank stores out
        of its own blocks (`shard_map`).

        Why exact units are annotated rather than sliced per device: a `shard_map` needs its
        input whole on every `data` rank, so the gradient it converts is all-reduced whole and
        every rank computes and accumulates all of it. Under an annotation XLA carries the
        storage's sharding back into the gradient's computation, as it does for an optimizer
        state sharded by annotation: 1.24x the plain JAX ZeRO-1 step's device time before,
        1.08x after at 3.3M (experiments/RESULTS.md, "The ZeRO-1 step by annotation"). Both compute
        the same bits (tests/test_zero.py::test_annotated_and_per_device_storage_agree).

        The leaves named in `ready` (of `whole_tier_paths`) are given as their storage tier
        already (the deterministic step's gradient, `treesum.TreeSum.finish`'s chunks)."""
        leaves = dict(zip(self.paths, self.treedef.flatten_up_to(params)))
        if ready - self.whole_tier_paths or (ready and mesh is None):
            raise ValueError(f"storage given for {sorted(ready - self.whole_tier_paths)}: "
                             "only leaves of whole_tier_paths, on a mesh, can be")
        if mesh is None:
            return {u.name: self._unit_to_storage_global(u, leaves) for u in self.units}
        out = {u.name: (leaves[u.members[0].path],) if u.members[0].path in ready
               else (self._exact_to_storage(u, leaves, mesh),)
               for u in self.units if u.name in self.exact_units}
        rest = [u for u in self.units if u.name not in self.exact_units]
        if rest:
            out.update(self._sliced_to_storage(rest, leaves, mesh))
        return out

    def _exact_to_storage(self, u: Unit, leaves: dict, mesh: Mesh) -> jax.Array:
        b = len(u.batch_shape)
        rows = self._global_rows(u, leaves, b)  # [*b, rows, row_len]
        t = rows.reshape(rows.shape[:b] + (u.rows, self.layout.data, -1))
        t = jnp.moveaxis(t, b + 1, b)  # [*b, data, rows, width]
        return jax.lax.with_sharding_constraint(t, NamedSharding(mesh, self.storage_spec(u)))

    def _sliced_to_storage(self, units: Sequence[Unit], leaves: dict, mesh: Mesh
                           ) -> dict[str, tuple[jax.Array, ...]]:
        in_specs = tuple(self.member_spec(m) for u in units for m in u.members)
        out_specs = tuple(self.storage_spec(u) for u in units for _ in self.tables)

        def local(*blocks):
            rank = jax.lax.axis_index(DATA)
            it, out = iter(blocks), []
            for u in units:
                b = len(u.batch_shape)
                row = self._block_row(u, [next(it) for _ in u.members], b)
                for i in range(len(self.tables)):
                    t = self._take(u, i, row, rank)
                    out.append(t.reshape(t.shape[:b] + (1, 1, t.shape[-1])))
            return tuple(out)

        flat = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(*[leaves[m.path] for u in units for m in u.members])
        it = iter(flat)
        return {u.name: tuple(next(it) for _ in self.tables) for u in units}

    def _unit_to_storage_global(self, u: Unit, leaves: dict) -> tuple[jax.Array, ...]:
        """Global arrays: each tier one gather of the rows at every rank's positions (computed
        from the small run tables, no constant as large as the row)."""
        b = len(u.batch_shape)
        rows = self._global_rows(u, leaves, b)  # [*b, rows, row_len]
        padded = jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, 1)])  # row_len: a zero
        D = self.layout.data
        out = []
        for pl in self.places[u.name]:
            rank = jax.lax.broadcasted_iota(jnp.int32, (D, pl.width), 0)
            w = jax.lax.broadcasted_iota(jnp.int32, (D, pl.width), 1)
            dst, src = self._run_tables(pl)
            pos = self._row_pos(w, jnp.asarray(dst)[rank], jnp.asarray(src)[rank])
            pos = jnp.where(w < jnp.asarray(np.asarray(pl.lengths, np.int32))[rank], pos, u.row_len)
            t = jnp.take(padded, pos.reshape(-1), axis=-1)
            t = t.reshape(t.shape[:-1] + (D, pl.width))  # [*b, rows, data, width]
            out.append(jnp.moveaxis(t, b, b + 1))
        return tuple(out)

    def from_storage(self, storage: dict[str, Sequence[jax.Array]], mesh: Mesh | None = None) -> PyTree:
        """Storage tiers -> the parameter-shaped tree; given the `mesh`, each device gathers its
        row over `data` (`member_spec` layout out), every unit's tiers in one `shard_map` and
        the small ones in one collective (`_gather_rows`). Exact units too: annotated, as
        `to_storage` converts them, XLA gathered each leaf on its own, and under launch the
        ZeRO demo's step took 0.20 s against 0.10 s so (experiments/RESULTS.md, "One collective
        per operand under launch"); a gather moves the same bits either way."""
        units = self.units
        if mesh is None or not units:
            leaves = {}
            for u in units:
                leaves.update(self.unit_from_storage(u, storage[u.name]))
            return jax.tree_util.tree_unflatten(self.treedef, [leaves[p] for p in self.paths])
        in_specs = tuple(self.storage_spec(u) for u in units for _ in self.tables)
        out_specs = tuple(self.member_spec(m) for u in units for m in u.members)

        def local(*tiers):
            it, out = iter(self._gather_rows(tiers)), []
            for u in units:
                out.extend(self._rows_to_blocks(u, [next(it) for _ in self.tables]))
            return tuple(out)

        flat = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(*[t for u in units for t in storage[u.name]])
        leaves = dict(zip([m.path for u in units for m in u.members], flat))
        return jax.tree_util.tree_unflatten(self.treedef, [leaves[p] for p in self.paths])

    def _gather_blocks(self, u: Unit, tiers: Sequence[jax.Array]) -> list[jax.Array]:
        """Inside a `shard_map`: this device's storage tiers [*b, 1, 1, width] -> its members'
        blocks, the row gathered over `data`."""
        return self._rows_to_blocks(u, self._gather_rows(tiers))

    def _rows_to_blocks(self, u: Unit, rows: Sequence[jax.Array]) -> list[jax.Array]:
        """Inside a `shard_map`: a unit's tiers gathered over `data` [*b, data * width] (one
        per table) -> its members' blocks on this device."""
        return self._row_blocks(u, self._assemble(u, 0, rows), rows[0].ndim - 1)

    @staticmethod
    def _gather_rows(tiers: Sequence[jax.Array]) -> list[jax.Array]:
        """Inside a `shard_map`: storage tiers [*b, 1, 1, width] -> each gathered over `data`,
        [*b, data * width]; the small ones packed into one collective (`packing`: under
        launch each collective crosses processes, one per tier was most of a ZeRO step)."""
        # [*b, data, 1, width] each
        gathered = all_gather_packed(tiers, DATA, [t.ndim - 3 for t in tiers])
        return [g.reshape(g.shape[:g.ndim - 3] + (-1,)) for g in gathered]

    def unit_from_storage(self, u: Unit, tiers: Sequence[jax.Array], mesh: Mesh | None = None
                          ) -> dict[str, jax.Array]:
        """Full member leaves of one unit from its storage tiers; tiers without the layer axis
        (one layer of a stacked unit, ZeRO-3's layer loop) give that layer's leaves."""
        b = tiers[0].ndim - 3
        if b == 0 and u.layers:  # one layer of a stacked unit
            u = self._one_layer(u)
        if mesh is not None:
            batch = bool(b)
            out = jax.shard_map(
                lambda *ts: tuple(self._gather_blocks(u, ts)), mesh=mesh,
                in_specs=tuple(self.storage_spec(u, batch) for _ in tiers),
                out_specs=tuple(self.member_spec(m, batch) for m in u.members), check_vma=False,
            )(*tiers)
            return {m.path: x for m, x in zip(u.members, out)}
        gathered = [jnp.moveaxis(t, b + 1, b).reshape(t.shape[:b] + (u.rows, -1)) for t in tiers]
        places = self.places[u.name]
        if len(places) == 1 and places[0].exact(u.row_len):
            return self._global_leaves(u, gathered[0], b)
        # one gather: row position -> its run (the runs in row order) -> storage position
        runs = sorted(
            (s, sum(self.layout.data * q.width for q in places[:i]) + d * pl.width + a)
            for i, pl in enumerate(places) for d, rr in enumerate(pl.runs) for a, s, _ in rr
        )
        starts = jnp.asarray(np.asarray([r[0] for r in runs], np.int32))
        at = jnp.asarray(np.asarray([r[1] for r in runs], np.int32))
        p = jax.lax.iota(jnp.int32, u.row_len)
        j = jnp.searchsorted(starts, p, side="right") - 1
        flat = gathered[0] if len(gathered) == 1 else jnp.concatenate(gathered, axis=-1)
        return self._global_leaves(u, jnp.take(flat, at[j] + (p - starts[j]), axis=-1), b)

    @staticmethod
    def _one_layer(u: Unit) -> Unit:
        return dataclasses.replace(u, layers=0, members=tuple(
            dataclasses.replace(m, stacked=False, shape=m.inner_shape,
                                tdim=None if m.tdim is None else m.tdim - 1)
            for m in u.members))

    def zero3_inputs(self, storage: dict, mesh: Mesh | None = None) -> tuple[PyTree, Any]:
        """ZeRO-3 forward inputs: (parameters with every non-layer leaf gathered and `layers`
        left as the stacked storage of the per-layer units, a per-layer gather function for the
        model's layer loop). With the contiguous layout layers are not separable, so the whole
        model is gathered at once and the gather function is None."""
        stacked = [u for u in self.units if u.layers]
        if not stacked:
            return self.from_storage(storage, mesh), None
        leaves = {}
        for u in self.units:
            if not u.layers:
                leaves.update(self.unit_from_storage(u, storage[u.name], mesh))
        params = _nest(leaves)
        params["layers"] = {u.name: tuple(storage[u.name]) for u in stacked}

        def gather_layer(layer_storage: dict) -> PyTree:
            out = {}
            for u in stacked:
                out.update(self.unit_from_storage(u, layer_storage[u.name], mesh))
            return _nest({p.split("/", 1)[1]: x for p, x in out.items()})

        return params, gather_layer

    # -- element identities: checksums and transitions -------------------------------------------

    def storage_identity(self, u: Unit, tier: int, rank, row, layer_ids=None):
        """(rows, cols) -> (uint32 identities, validity) of elements of one device's storage
        block of `tier`, viewed as [layers here (or 1), width] (`checksum.tile_sums`): rank and
        tensor row possibly traced; `layer_ids` (uint32 rows -> layer ids, int32, -1 = empty
        slot) for stacked units. An identity is the element's row-major position in its full
        member leaf, plus the member's offset, plus layer * `u.total`: the same on every plan."""
        pl = self.places[u.name][tier]
        n = jnp.asarray(np.asarray(pl.lengths, np.uint32))[rank]
        if pl.simple:
            starts = np.asarray([r[0][1] if r else 0 for r in pl.runs], np.uint32)
            start = jnp.asarray(starts)[rank]
        else:
            dst, src = self._run_tables(pl)
            dst_r = jnp.asarray(dst.astype(np.uint32))[rank]
            src_r = jnp.asarray(src.astype(np.uint32))[rank]
        row = jnp.uint32(row) if not isinstance(row, jax.Array) else row.astype(jnp.uint32)

        def ident(rows, cols):
            p = start + cols if pl.simple else self._row_pos(cols, dst_r, src_r)
            valid = cols < n
            g = self._natural(u, p, row)
            if layer_ids is not None:
                lid = layer_ids(rows)
                g = g + (lid.astype(jnp.uint32) * jnp.uint32(u.total))[:, None]
                valid = valid & (lid >= 0)[:, None]
            return g, valid

        return ident

    @staticmethod
    def _natural(u: Unit, p, row):
        """Identity of row position `p` (uint32) on tensor row `row`."""
        out = None
        for m in u.members:
            A, nt, nl, B = m.around_tdim(u.rows)
            q = p - jnp.uint32(m.row_offset)
            if m.tdim is None or (u.rows == 1) or A == 1:
                g = q + row * jnp.uint32(nl * B)
            else:
                a = q // jnp.uint32(nl * B)
                g = a * jnp.uint32(nt * B) + row * jnp.uint32(nl * B) + (q - a * jnp.uint32(nl * B))
            g = g + jnp.uint32(m.full_offset)
            out = g if out is None else jnp.where(p >= jnp.uint32(m.row_offset), g, out)
        return out

    def segments(self, u: Unit, tier: int, rank: int, row: int, natural: bool
                 ) -> list[tuple[int, int, int]]:
        """(identity start, end, storage offset) runs of one storage shard (rank, tensor row,
        tier), split at member boundaries. `natural`: identities are positions in the full
        leaves (`storage_identity`), comparable across tensor degrees; runs then split wherever
        a tensor rank's block is not contiguous in its leaf. Otherwise positions in the rows
        (row * row_len + offset), comparable between plans of the same tensor degree: far fewer
        runs."""
        out = []
        for a, s, n in self.places[u.name][tier].runs[rank]:
            if not natural:
                out.append((row * u.row_len + s, row * u.row_len + s + n, a))
                continue
            for m in u.members:
                lo, hi = m.row_offset, m.row_offset + m.size // u.rows
                x0, x1 = max(s, lo), min(s + n, hi)
                if x0 >= x1:
                    continue
                A, nt, nl, B = m.around_tdim(u.rows)
                run = nl * B if (m.tdim is not None and u.rows > 1 and A > 1) else x1 - lo
                q = x0 - lo
                while q < x1 - lo:
                    end = min(x1 - lo, (q // run + 1) * run)
                    ia = q // (nl * B) if run == nl * B else 0
                    g = m.full_offset + (
                        ia * nt * B + row * nl * B + (q - ia * nl * B) if run == nl * B
                        else row * nl * B + q
                    )
                    out.append((g, g + end - q, a + lo + q - s))
                    q = end
        return out

    def rank_elements(self, u: Unit, tier: int, rank: int) -> int:
        """Real (non-padding) elements a rank stores of one row in `tier`."""
        return self.places[u.name][tier].lengths[rank]


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
