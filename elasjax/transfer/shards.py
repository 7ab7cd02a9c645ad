"""What a job holds of a state, shard by shard, and the log of what a transition moved.

A *shard* is one copy of a *box* (a hyper-rectangle of a global array) on one device, or in host
memory. A `ShardStore` lists every live shard of every leaf of a state, globally: under the
multi-controller runtime the shards of other processes are described (device, box) with no
data, so that every process plans the same transition, while each executes its own part with
the buffers it holds.

Plans name a source by what it is, `SourceRef = (leaf path, device, rung, box)`, never by its
buffer: a plan made before a failure from descriptions (`describe_state`) runs on the buffers
present after it, provided they are exactly the described ones.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..core.jaxcompat import key_impl_of
from ..core.sharding import path_str

PyTree = Any
Box = tuple[tuple[int, int], ...]
# cheapest first; "live" and "replica" both mean a surviving shard of the state itself
RUNG_ORDER = {"local": 0, "replica": 1, "live": 1, "buddy": 2, "host": 3, "checkpoint": 4}


class UnrecoverableStateError(RuntimeError):
    """A slice of state has no live copy on any rung; the message names the leaf and slice."""

    def __init__(self, leaf: str, box: Box, detail: str = ""):
        self.leaf, self.box = leaf, box
        super().__init__(
            f"state leaf '{leaf}' slice {box_str(box)} has no live copy"
            + (f" ({detail})" if detail else "")
        )


class StateMismatchError(RuntimeError):
    """A rebuilt state does not verify: its checksums differ from those of the state it must
    equal (the last committed state after a recovery, the saved one for a checkpoint, the
    state before a cut-over). Raised by the loop and by `ElasticState` alike; the state is
    then unusable, never handed back."""


def index_to_box(index: tuple, shape: tuple[int, ...]) -> Box:
    out = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        assert step == 1
        out.append((start, stop))
    return tuple(out)


def box_str(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def box_size(box: Box) -> int:
    return math.prod(b - a for a, b in box)


@dataclasses.dataclass(frozen=True)
class Shard:
    """A copy of `box` of a leaf: on device `device` (an int id), or in host memory
    (`device` = "host:<h>", `data` a numpy array). `rung` says where it comes from; `data` is
    None for a shard another process holds (described, not readable here)."""

    device: int | str
    box: Box
    data: Any
    rung: str = "replica"


def is_key(x) -> bool:
    """Whether `x` (an array or an abstract value) holds typed PRNG keys."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _key_data(x, with_data: bool):
    """A key array as its key data: uint32 with trailing axes of the key's words, sharded as the
    keys are (the trailing axes whole). A description needs only the shape and sharding."""
    if with_data:
        return jax.random.key_data(x)
    shape = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype)).shape
    return jax.ShapeDtypeStruct(shape, np.uint32, sharding=key_data_sharding(x.sharding, x.dtype))


def key_data_sharding(sharding, key_dtype):
    """The sharding of the key data of keys of `key_dtype` sharded by `sharding` (the trailing
    axes of each key's words whole)."""
    if isinstance(sharding, NamedSharding):
        words = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), key_dtype)).ndim
        return NamedSharding(
            sharding.mesh, PartitionSpec(*sharding.spec, *([None] * words)),
            memory_kind=sharding.memory_kind,
        )
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    raise TypeError(
        f"a PRNG-key leaf sharded by {type(sharding).__name__} is not supported; allowed: "
        "NamedSharding, SingleDeviceSharding"
    )


def held_elsewhere(like, sharding) -> jax.Array:
    """A global array of `like`'s shape and dtype laid out by `sharding`, of which this process
    holds no shard: what a process that holds none of `sharding`'s devices (a restarted process
    admitted into a job) sees of a leaf before a transition copies its shards to it. A typed
    PRNG-key leaf is its (empty) key data wrapped as keys: wrapping computes nothing."""
    if is_key(like):
        data = _key_data(jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding), False)
        empty = jax.make_array_from_single_device_arrays(
            data.shape, data.sharding, [], dtype=np.uint32)
        return jax.random.wrap_key_data(empty, impl=key_impl_of(like.dtype))
    return jax.make_array_from_single_device_arrays(like.shape, sharding, [], dtype=like.dtype)


@functools.lru_cache(maxsize=512)
def _boxes(sharding, shape: tuple[int, ...]) -> tuple[tuple[int, Box], ...]:
    """(device id, box) of every shard of an array of `shape` laid out by `sharding` (a
    recovery reads them for every leaf, and the layouts repeat)."""
    return tuple(
        (d.id, index_to_box(idx, shape)) for d, idx in sharding.devices_indices_map(shape).items()
    )


def _leaf_shards(x, dead: set[int], with_data: bool) -> list[Shard]:
    local = {s.device.id: s.data for s in x.addressable_shards} if with_data else {}
    return [
        Shard(d, box, local.get(d)) for d, box in _boxes(x.sharding, tuple(x.shape))
        if d not in dead
    ]


@dataclasses.dataclass
class ShardStore:
    """What the job holds of a state, leaf by leaf: every live shard (global), with its buffer
    where this process holds it."""

    treedef: Any
    paths: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[Any]
    shards: list[list[Shard]]
    # typed PRNG-key leaves are held as their key data (uint32, trailing axes of the key's words):
    # path -> (the key dtype, its implementation), which a transition restores them with
    key_dtypes: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def capture(cls, tree: PyTree, dead: Iterable[int] = ()) -> ShardStore:
        """Every shard of `tree` not on a `dead` device; buffers attached where addressable."""
        return cls._of(tree, set(dead), with_data=True)

    @classmethod
    def _of(cls, tree: PyTree, dead: set[int], with_data: bool) -> ShardStore:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths, shapes, dtypes, shards = [], [], [], []
        impls = {}
        for path, x in flat:
            p = path_str(path)
            if is_key(x):
                impls[p] = (x.dtype, jax.random.key_impl(x))
                x = _key_data(x, with_data)
            paths.append(p)
            shapes.append(tuple(x.shape))
            dtypes.append(x.dtype)
            leaf = _leaf_shards(x, dead, with_data)
            shards.append(leaf if with_data else [described(p, s) for s in leaf])
        return cls(treedef, paths, shapes, dtypes, shards, impls)

    def fail(self, device_ids: Iterable[int]) -> int:
        """Delete every buffer this process holds on the given devices (their memory is gone)
        and forget their shards. Returns the bytes lost."""
        dead = set(device_ids)
        lost = 0
        for i, leaf in enumerate(self.shards):
            keep = []
            for s in leaf:
                if s.device in dead:
                    if s.data is not None:
                        lost += s.data.nbytes
                        if not s.data.is_deleted():
                            s.data.delete()
                else:
                    keep.append(s)
            self.shards[i] = keep
        return lost

    def without(self, device_ids: Iterable[int]) -> ShardStore:
        """The store with the shards on `device_ids` left out (their buffers untouched)."""
        dead = set(device_ids)
        return dataclasses.replace(
            self, shards=[[s for s in leaf if s.device not in dead] for leaf in self.shards],
            key_dtypes=dict(self.key_dtypes),
        )

    def devices(self) -> set:
        return {s.device for leaf in self.shards for s in leaf}

    def map_data(self, fn) -> ShardStore:
        """The store with every held buffer replaced by `fn(buffer)` (e.g. a copy onto a
        renewed client's device, `runtime.current`)."""
        return dataclasses.replace(
            self, shards=[map_shard_data(leaf, fn) for leaf in self.shards],
            key_dtypes=dict(self.key_dtypes),
        )


def map_shard_data(shards: list[Shard], fn) -> list[Shard]:
    """`shards` with each held buffer replaced by `fn(buffer)`."""
    return [s if s.data is None else dataclasses.replace(s, data=fn(s.data)) for s in shards]


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
    """Every piece of a transition (global: the same on every process), and what this process
    sent to and received from others (`sent` / `received`: peer process -> bytes)."""

    entries: list[Transfer] = dataclasses.field(default_factory=list)
    kept_bytes: int = 0  # bytes that stayed in place (buffers reused without a copy)
    cross_process_bytes: int = 0  # of all pieces, those whose source is in another process
    sent: dict[int, int] = dataclasses.field(default_factory=dict)
    received: dict[int, int] = dataclasses.field(default_factory=dict)

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
        """The most expensive rung any piece came from. A snapshot copy used on its own device
        counts too: the state it restores was not on a surviving replica."""
        rungs = {t.rung for t in self.entries if not t.local or t.rung not in ("replica", "live")}
        return max(rungs or {"replica"}, key=lambda r: RUNG_ORDER[r])


# ---------------------------------------------------------------------------------------------
# Descriptions: sources named by what they are.

SourceRef = tuple  # (leaf path, device, rung, box)


def source_ref(path: str, s: Shard) -> SourceRef:
    return (path, s.device, s.rung, s.box)


def described(path: str, s: Shard) -> Shard:
    """`s` with its `SourceRef` for data."""
    return Shard(s.device, s.box, source_ref(path, s), s.rung)


def describe(store: ShardStore, extra: dict[str, list[Shard]] | None = None):
    """(store, extra) with every shard's `data` replaced by its `SourceRef`."""
    desc = ShardStore(
        store.treedef, store.paths, store.shapes, store.dtypes,
        [[described(p, s) for s in leaf] for p, leaf in zip(store.paths, store.shards)],
        dict(store.key_dtypes),
    )
    return desc, {p: [described(p, s) for s in shards] for p, shards in (extra or {}).items()}


def describe_state(state: PyTree, dead: Iterable[int] = ()) -> ShardStore:
    """The `ShardStore` a failure of `dead` would leave of `state`, with `SourceRef`s for data,
    read from the shardings alone (no buffer is touched)."""
    return ShardStore._of(state, set(dead), with_data=False)


def buffers(store: ShardStore, extra: dict[str, list[Shard]]) -> dict:
    """{SourceRef: buffer} of every source this process holds: what a plan's copies read."""
    data = {}
    for p, leaf in zip(store.paths, store.shards):
        for s in leaf:
            if s.data is not None:
                data[source_ref(p, s)] = s.data
    for p, shards in extra.items():
        for s in shards:
            if s.data is not None:
                data[source_ref(p, s)] = s.data
    return data


def cells(dst: Box, sources: list[Shard]) -> list[Box]:
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


def uncovered(store: ShardStore, extra: dict[str, list[Shard]] | None = None) -> list[tuple[str, Box]]:
    """The (leaf, slice) pairs that neither `store`'s shards nor the `extra` sources (snapshot
    copies) cover: what a transition from them would raise `UnrecoverableStateError` for. Each
    leaf is cut along every source boundary (`cells`); a cell no source contains is lost."""
    extra = extra or {}
    out = []
    for path, shape, shards in zip(store.paths, store.shapes, store.shards):
        sources = [*shards, *extra.get(path, [])]
        for cell in cells(tuple((0, n) for n in shape), sources):
            if not any(contains(s.box, cell) for s in sources):
                out.append((path, cell))
    return out
