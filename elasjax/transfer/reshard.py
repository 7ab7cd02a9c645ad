"""Transitions: move what survives of a state onto a new plan's layout, from live sources only.

After a failure the old global arrays are unusable (their buffers on the failed devices are gone,
and `jax.device_put` of such an array could read a replica on a dead device). What the job still
has is a `ShardStore` (every live shard of every leaf) and the snapshot pool's copies (`Shard`s on
buddy devices or in host memory). A transition

1. *plans* copies, for every destination shard of the new layout on every process (the plan is
   global and deterministic, so every process computes the same one). Leaves whose meaning does
   not change with the plan (parameters, scalars) are matched by *box* (a hyper-rectangle of the
   global array): each destination box is covered by source boxes, cut into cells where no
   single source covers it (`transfer.matching`). ZeRO storage leaves (`elasjax.layout.storage`)
   are matched by *canonical element ranges*, because the same element sits at a different
   storage position on a different plan. Each needed piece gets exactly one source, the cheapest rung first: the
   destination itself, a live device, a buddy snapshot, a host snapshot; then a source in the
   destination's own process; ties go to the least-loaded sender;
2. *executes* them (`transfer.copies`): each process builds its own destination shards; pieces
   held by another process come through the runtime's transport, point to point;
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

import dataclasses
import math
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from . import copies
from .copies import CopyThreads, DstShard
from .matching import LeafTag, Picker, Planning, plan_array_leaf, plan_storage_leaf, slot_table
from .shards import (
    Shard,
    ShardStore,
    Transfer,
    TransferLog,
    buffers,
    describe,
    key_data_sharding,
    source_ref,
)

PyTree = Any




# ---------------------------------------------------------------------------------------------
# The transition: a plan computed from shard descriptions, then executed on the buffers.




def _signature(store: ShardStore, refs: frozenset, target_flat, old_layout, new_layout) -> tuple:
    """What a transition plan depends on: the layouts, the target shardings, the leaves and the
    exact set of sources."""
    return (
        _form(old_layout), _form(new_layout), tuple(_sharding_key(s) for s in target_flat),
        tuple(store.paths), tuple(store.shapes), tuple(str(d) for d in store.dtypes), refs,
    )


def _sharding_key(sh) -> Any:
    """A target sharding as a plan depends on it: its devices' ids, the mesh's shape and axes,
    the spec; not the client the devices belong to. A plan prepared before a renewed CPU client
    (`runtime.collectives`) then serves the same shardings on the new client: it names devices
    by id, and `TransitionPlan.execute` builds on the shardings it is given."""
    if isinstance(sh, NamedSharding):
        m = sh.mesh
        return ("named", tuple(d.id for d in m.devices.flat), m.devices.shape,
                tuple(m.axis_names), sh.spec, sh.memory_kind)
    return sh


def _form(layout) -> Any:
    return None if layout is None else layout.key


def _refs(store: ShardStore, extra: dict) -> frozenset:
    """The `SourceRef`s of a store and its extra sources (described or not: a ref is made of
    what a shard is, never of its data)."""
    return frozenset(
        source_ref(p, s) for p, leaf in zip(store.paths, store.shards) for s in leaf
    ) | frozenset(source_ref(p, s) for p, shards in extra.items() for s in shards)


@dataclasses.dataclass
class TransitionPlan:
    """Every copy of one transition, for every process, made from shard descriptions
    (`SourceRef`s): valid for any buffers that match them. `plan_s` is the time it took."""

    signature: tuple
    dsts: list[DstShard]
    log: TransferLog
    target_flat: list
    shapes: list[tuple[int, ...]]
    dtypes: list
    treedef: Any
    plan_s: float
    layouts: tuple = ()  # keeps the layouts whose ids the signature holds alive

    @property
    def bytes_written(self) -> int:
        """Bytes copied into new shards (local pieces included; kept buffers excluded)."""
        return sum(c.nbytes for d in self.dsts if d.reuse is None for c in d.copies)

    def execute(
        self, data: dict, devices: dict[int, jax.Device], *, transport=None,
        threads: CopyThreads | None = None, target_flat: list | None = None,
    ) -> tuple[PyTree, TransferLog]:
        """Build this process's part of the new state (`data`: the buffers it holds, by
        `SourceRef`); pieces held by other processes come through `transport`. `target_flat`:
        the target shardings on the current client's devices (default: the ones planned)."""
        built, sent, received = copies.execute(
            self.dsts, devices, data, transport=transport, threads=threads
        )
        leaves = []
        shardings = self.target_flat if target_flat is None else target_flat
        for li, (sh, shape, dtype) in enumerate(zip(shardings, self.shapes, self.dtypes)):
            dmap = sh.addressable_devices_indices_map(shape)
            leaves.append(
                copies.assemble(shape, sh, dmap, [built[(li, d.id)] for d in dmap], dtype)
            )
        log = dataclasses.replace(self.log, entries=list(self.log.entries), sent=sent, received=received)
        return jax.tree_util.tree_unflatten(self.treedef, leaves), log


class TransitionPlanCache:
    """Transition plans by signature (layouts, target shardings and the exact set of sources),
    least recently used dropped beyond `max_plans`. Thread-safe: the trainer fills it in the
    background for the likeliest failures, so that recovery only executes copies. `where` (device
    -> process) is the job's: every plan in the cache is made with it."""

    def __init__(self, max_plans: int = 64, where: Callable[[Any], int] | None = None):
        self.max_plans, self.where = max_plans, where
        self._plans: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

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

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def prepare(
        self, store: ShardStore, target_shardings: PyTree, extra: dict | None = None, *,
        old_layout=None, new_layout=None, info: dict | None = None,
    ) -> TransitionPlan:
        """Plan (and keep) the transition from a store (described, `describe_state`, or not:
        it is described only if no plan is kept for it); `info`, if given, receives `plan_hit`
        (it was kept already) and `plan_s`."""
        target_flat = _target_leaves(target_shardings)
        sig = _signature(store, _refs(store, extra or {}), target_flat, old_layout, new_layout)
        plan = self.get(sig)
        if info is not None:
            info.update(plan_hit=plan is not None, plan_s=0.0 if plan is not None else None)
        if plan is None:
            store, extra = describe(store, extra)
            plan = plan_transition(
                store, target_shardings, extra_sources=extra, old_layout=old_layout,
                new_layout=new_layout, signature=sig, where=self.where,
            )
            self.put(plan)
            if info is not None:
                info["plan_s"] = plan.plan_s
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
    transport=None,
    threads: CopyThreads | None = None,
) -> tuple[PyTree, TransferLog]:
    """Build the state on `target_shardings` from the store's live shards and `extra_sources`
    (snapshot copies, by leaf path). With ZeRO layouts (`state.StateLayout`), storage leaves are
    rebuilt by canonical element ranges; in-place tiers reuse their buffers. With `plans`, a plan
    made earlier for the same sources is reused (and a new one kept); `info`, if given, receives
    `plan_hit`, `plan_s` (0 on a hit) and `bytes_written`. Under the multi-controller runtime
    every process calls this with the same (global) store and sources, and `transport` moves
    the pieces that cross processes."""
    devices = devices or {d.id: d for d in jax.devices()}
    extra_sources = extra_sources or {}
    if store.key_dtypes:  # typed PRNG keys travel as their key data, and are wrapped again
        target_shardings = _key_data_targets(store, target_shardings)
    target_flat = _target_leaves(target_shardings)
    sig = _signature(store, _refs(store, extra_sources), target_flat, old_layout, new_layout)
    plan = plans.get(sig) if plans is not None else None
    hit = plan is not None
    if plan is None:
        desc, desc_extra = describe(store, extra_sources)
        where = plans.where if plans is not None and plans.where is not None else (
            transport.process_of if transport is not None else None
        )
        plan = plan_transition(
            desc, target_shardings, extra_sources=desc_extra, old_layout=old_layout,
            new_layout=new_layout, signature=sig, where=where,
        )
        if plans is not None:
            plans.put(plan)
    if info is not None:
        info.update(plan_hit=hit, plan_s=0.0 if hit else plan.plan_s, bytes_written=plan.bytes_written)
    state, log = plan.execute(
        buffers(store, extra_sources), devices, transport=transport, threads=threads,
        target_flat=target_flat,
    )
    if store.key_dtypes:
        state = _wrap_keys(store, state)
    return state, log


def _key_data_targets(store: ShardStore, target_shardings: PyTree) -> PyTree:
    flat, treedef = jax.tree_util.tree_flatten(
        target_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    if len(flat) != len(store.paths):
        raise ValueError(
            f"target_shardings has {len(flat)} leaves and the state {len(store.paths)}; give one "
            "sharding per leaf of the state"
        )
    return jax.tree_util.tree_unflatten(treedef, [
        key_data_sharding(sh, store.key_dtypes[p][0]) if p in store.key_dtypes else sh
        for p, sh in zip(store.paths, flat)
    ])


def _wrap_keys(store: ShardStore, state: PyTree) -> PyTree:
    leaves, treedef = jax.tree_util.tree_flatten(state)
    return jax.tree_util.tree_unflatten(treedef, [
        jax.random.wrap_key_data(x, impl=store.key_dtypes[p][1]) if p in store.key_dtypes else x
        for p, x in zip(store.paths, leaves)
    ])




def plan_transition(
    store: ShardStore,
    target_shardings: PyTree,
    *,
    extra_sources: dict[str, list[Shard]] | None = None,
    old_layout=None,
    new_layout=None,
    signature: tuple = (),
    where: Callable[[Any], int] | None = None,
) -> TransitionPlan:
    """The copies of a transition, from a described store (shard `data` are `SourceRef`s), for
    the destination shards of every process. `where` maps a device (or "host:<h>") to its
    process; None means one process."""
    t_start = time.perf_counter()
    target_flat = _target_leaves(target_shardings)
    if new_layout is not None:
        new_tags = [LeafTag(*t) for t in new_layout.tags]
        target_treedef = jax.tree_util.tree_structure(new_layout.abstract)
        shapes = [tuple(x.shape) for x in jax.tree.leaves(new_layout.abstract)]
        dtypes = [x.dtype for x in jax.tree.leaves(new_layout.abstract)]
    else:
        new_tags = [LeafTag(p) for p in store.paths]
        target_treedef = store.treedef
        shapes, dtypes = store.shapes, store.dtypes
    old_tags = (
        [LeafTag(*t) for t in old_layout.tags]
        if old_layout is not None
        else [LeafTag(p) for p in store.paths]
    )
    families: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(old_tags):
        if t.unit is not None:
            families[t.key].append(i)
    pl = Planning(store, extra_sources or {}, Picker(where), TransferLog(), old_layout,
                   new_layout, old_tags, families, slot_table(old_layout),
                   slot_table(new_layout))
    by_path = {p: i for i, p in enumerate(store.paths)}
    dsts: list[DstShard] = []
    for li, (tag, sh, shape, dtype) in enumerate(zip(new_tags, target_flat, shapes, dtypes)):
        if tag.unit is None:
            dsts += plan_array_leaf(pl, li, tag, by_path[tag.key], sh, shape, dtype)
        else:
            dsts += plan_storage_leaf(pl, li, tag, sh, shape, dtype)
    _log_copies(pl, dsts, new_tags)
    for ds in dsts:
        if ds.reuse is None:
            _find_gaps(ds)
    return TransitionPlan(
        signature, dsts, pl.log, target_flat, shapes, dtypes, target_treedef,
        time.perf_counter() - t_start, (old_layout, new_layout),
    )




def _log_copies(pl: Planning, dsts: list[DstShard], new_tags: list[LeafTag]) -> None:
    """Every planned copy in the transfer log (its leaf, box, source and rung), and the bytes
    that cross processes."""
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
            pl.log.entries.append(
                Transfer(leaf, box, c.src.device, ds.device, c.nbytes, c.src.rung))
            if pl.picker.where(c.src.device) != pl.picker.where(ds.device):
                pl.log.cross_process_bytes += c.nbytes


def _find_gaps(ds: DstShard) -> None:
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


