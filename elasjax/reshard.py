"""Transitions: move what survives of a state onto a new plan's shardings, from live sources only.

After a failure the old global arrays are unusable (their buffers on the failed devices are gone,
and `jax.device_put` of such an array could read a replica on a dead device). What the job still
has is a `ShardStore`: per leaf, the single-device buffers on live devices, each covering a box
(a hyper-rectangle of the global array). A transition

1. *plans*: for every leaf and every destination shard of the target sharding, cover the
   destination box with boxes of live sources (cutting it into cells along the sources' grid
   where no single source covers it) and pick one source per cell: the destination device
   itself when it holds the cell (no transfer), else the least-loaded live holder;
2. *executes*: slices each piece on its source device, copies all pieces in one batched
   `jax.device_put`, concatenates cells on the destination, and assembles the global array with
   `jax.make_array_from_single_device_arrays`;
3. *logs* every piece as a `Transfer(leaf, box, src, dst, nbytes, rung)`.

A cell that no live source holds raises `UnrecoverableStateError` naming the leaf and the box;
callers may then fall back to another rung (a checkpoint), never to re-initialised or partly
stale values.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .sharding import path_str

PyTree = Any
Box = tuple[tuple[int, int], ...]


class UnrecoverableStateError(RuntimeError):
    """A slice of state has no live copy on any rung; the message names the leaf and slice."""

    def __init__(self, leaf: str, box: Box, detail: str = ""):
        self.leaf, self.box = leaf, box
        sl = "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"
        super().__init__(
            f"state leaf '{leaf}' slice {sl} has no live copy"
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
    return "[" + ",".join(f"{a}:{b}" for a, b in box) + "]"


def _contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _size(box: Box) -> int:
    return int(np.prod([b - a for a, b in box])) if box else 1


@dataclasses.dataclass(frozen=True)
class Shard:
    """A live single-device buffer holding `box` of a leaf."""

    device: int
    box: Box
    data: jax.Array


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

    def drop_dead(self) -> None:
        self.shards = [[s for s in leaf if not s.data.is_deleted()] for leaf in self.shards]

    def devices(self) -> set[int]:
        return {s.device for leaf in self.shards for s in leaf}


@dataclasses.dataclass(frozen=True)
class Transfer:
    leaf: str
    box: Box
    src: int | str  # device id, or a named off-device source ("host", "checkpoint")
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


@dataclasses.dataclass(frozen=True)
class _Piece:
    cell: Box  # global coordinates
    shard: Shard


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


def plan_leaf(
    path: str,
    shape: tuple[int, ...],
    itemsize: int,
    sources: list[Shard],
    dst_boxes: dict[int, Box],
    load: dict,
) -> dict[int, list[_Piece]]:
    """Pieces (cell, source) covering every destination box; `load` balances senders."""
    out: dict[int, list[_Piece]] = {}
    for dst, box in dst_boxes.items():
        whole = [s for s in sources if _contains(s.box, box)]
        if whole:
            pick = _pick(whole, dst, load, _size(box) * itemsize)
            out[dst] = [_Piece(box, pick)]
            continue
        pieces = []
        for cell in _cells(box, sources):
            holders = [s for s in sources if _contains(s.box, cell)]
            if not holders:
                raise UnrecoverableStateError(path, cell, "every device holding it has failed")
            pieces.append(_Piece(cell, _pick(holders, dst, load, _size(cell) * itemsize)))
        out[dst] = pieces
    return out


def _pick(holders: list[Shard], dst: int, load: dict, nbytes: int) -> Shard:
    for s in holders:
        if s.device == dst:
            return s
    best = min(holders, key=lambda s: (load[s.device], s.device))
    load[best.device] += nbytes
    return best


def _local_slices(piece: _Piece) -> tuple[slice, ...]:
    return tuple(slice(c0 - s0, c1 - s0) for (c0, c1), (s0, _) in zip(piece.cell, piece.shard.box))


def _assemble(cells: list[tuple[Box, jax.Array]], box: Box) -> jax.Array:
    """Concatenate cells (a full grid over `box`) into one array on their device."""
    if len(cells) == 1:
        return cells[0][1]
    for d in range(len(box)):
        starts = sorted({c[0][d][0] for c in cells})
        if len(starts) > 1:
            groups = [[c for c in cells if c[0][d][0] == s] for s in starts]
            parts = []
            for g in groups:
                sub_box = box[:d] + (g[0][0][d],) + box[d + 1 :]
                parts.append(_assemble(g, sub_box))
            return jnp.concatenate(parts, axis=d)
    raise AssertionError("cells do not tile the box")


def transition(
    store: ShardStore, target_shardings: PyTree, *, devices: dict[int, jax.Device] | None = None
) -> tuple[PyTree, TransferLog]:
    """Build the state on `target_shardings` from the store's live shards. See module docstring."""
    devices = devices or {d.id: d for d in jax.devices()}
    targets = store.treedef.flatten_up_to(target_shardings)
    load: dict = defaultdict(int)
    log = TransferLog()
    plans = []
    for path, shape, dtype, shards, sh in zip(
        store.paths, store.shapes, store.dtypes, store.shards, targets
    ):
        dst_boxes = {
            d.id: index_to_box(idx, shape) for d, idx in sh.addressable_devices_indices_map(shape).items()
        }
        itemsize = np.dtype(dtype).itemsize
        plans.append(plan_leaf(path, shape, itemsize, shards, dst_boxes, load))
    # Slice on the sources, then move every remote piece in one batched device_put.
    remote_x, remote_dev, slots = [], [], []
    for li, plan in enumerate(plans):
        itemsize = np.dtype(store.dtypes[li]).itemsize
        for dst, pieces in plan.items():
            for pi, p in enumerate(pieces):
                whole = p.cell == p.shard.box
                x = p.shard.data if whole else p.shard.data[_local_slices(p)]
                log.entries.append(
                    Transfer(store.paths[li], p.cell, p.shard.device, dst, _size(p.cell) * itemsize)
                )
                if p.shard.device == dst:
                    slots.append((li, dst, pi, x))
                else:
                    remote_x.append(x)
                    remote_dev.append(devices[dst])
                    slots.append((li, dst, pi, None))
    moved = iter(jax.device_put(remote_x, remote_dev)) if remote_x else iter(())
    cells: dict = defaultdict(list)
    for li, dst, pi, x in slots:
        cells[(li, dst)].append((plans[li][dst][pi].cell, x if x is not None else next(moved)))
    leaves = []
    for li, (shape, sh) in enumerate(zip(store.shapes, targets)):
        arrays = []
        for d, idx in sh.addressable_devices_indices_map(shape).items():
            arrays.append(_assemble(cells[(li, d.id)], index_to_box(idx, shape)))
        leaves.append(jax.make_array_from_single_device_arrays(shape, sh, arrays))
    return jax.tree_util.tree_unflatten(store.treedef, leaves), log
