"""Per-step in-memory snapshot pool: buddy-device and host-memory copies of unique state.

A shard is *unique* when every device holding its slice sits on one host, so that one host
failure (or one device failure, when it is the only holder) loses it: ZeRO partitions, and any
slice whose data-parallel replicas are gone. After every step the pool copies each unique shard

- to a **buddy** device on another host (`snapshot.buddy`), with `jax.device_put`, dispatched
  asynchronously so it overlaps the next step; and/or
- to **host memory** of the holder's host (`snapshot.host`): from the buddy copy, asynchronously,
  when there is one, else synchronously at the step boundary (the step donates its input state,
  so a device buffer cannot be read after the next step starts);

together with the step id and a per-shard checksum computed on device (`shard_checksums`). A
host failure loses that host's memory: host copies are modelled as living in the holder's host,
so they survive a device failure but not the loss of their host, while a buddy survives the loss
of the holder's host but not its own.

On a failure `sources` hands the transition verified copies of the dead holders' shards:
a copy whose step id differs from the state version being restored, or whose checksum does not
match, is refused (and the refusal reported), and the next rung is tried. After a recovery the
pool is reconfigured for the new plan (new holders, new buddies), so the next failure is covered.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import checksum
from .config import SnapshotConfig
from .mesh import MESH_AXES
from .planner import Topology
from .reshard import Box, Shard, described, index_to_box
from .sharding import path_str


@dataclasses.dataclass
class Record:
    leaf: int  # index in the state's flatten order
    path: str
    box: Box
    holder: int
    buddy: int | None
    host: int  # the holder's host: where a host copy lives
    nbytes: int
    step: int = -1
    checksum: np.ndarray | None = None
    buddy_data: Any = None
    host_data: np.ndarray | None = None
    _host_pending: Any = None


def shard_checksums_fn(state_shardings, mesh: Mesh, leaf_ids: list[int]):
    """jit: state -> uint32[data, stage, tensor, len(leaf_ids), 2], each device's checksum of its
    own block of each listed leaf (block-local element order, as `checksum.np_leaf_checksum`)."""
    specs = [s.spec for s in jax.tree.leaves(state_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))]

    def local(*blocks):
        sums = jnp.stack([checksum.leaf_checksum(b) for b in blocks])
        return sums[None, None, None]

    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(specs[i] for i in leaf_ids),
        out_specs=PartitionSpec(*MESH_AXES),
        check_vma=False,
    )
    return jax.jit(lambda state: f(*[jax.tree.leaves(state)[i] for i in leaf_ids]))


class SnapshotPool:
    """See the module docstring."""

    def __init__(self, cfg: SnapshotConfig, topo: Topology):
        self.cfg, self.topo = cfg, topo
        self.records: list[Record] = []
        self.refusals: list[str] = []
        self._fn = None
        self._mesh_pos: dict[int, tuple[int, ...]] = {}
        self._pending_sums = None
        self.bytes_per_step = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.buddy or self.cfg.host

    def configure(self, state, state_shardings, mesh: Mesh, live: set[int]) -> None:
        """Choose what to snapshot on this plan and where (buddies on other hosts, balanced)."""
        self.records = []
        self._fn = None
        if not self.enabled:
            return
        load: dict[int, int] = defaultdict(int)
        leaf_ids = []
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        for li, (path, x) in enumerate(flat):
            holders: dict[Box, list[int]] = defaultdict(list)
            for s in x.addressable_shards:
                holders[index_to_box(s.index, x.shape)].append(s.device.id)
            nb = x.dtype.itemsize
            unique = []
            for box, devs in holders.items():
                hosts = {self.topo.host_of(d) for d in devs}
                if len(hosts) == 1:
                    unique.append((box, sorted(devs)[0]))
            if not unique:
                continue
            leaf_ids.append(li)
            for box, h in unique:
                size = int(np.prod([b - a for a, b in box])) * nb if box else nb
                buddy = self._buddy(h, live, load, size) if self.cfg.buddy else None
                self.records.append(
                    Record(li, path_str(path), box, h, buddy, self.topo.host_of(h), size)
                )
        self.bytes_per_step = sum(r.nbytes for r in self.records) * (
            int(self.cfg.buddy) + int(self.cfg.host)
        )
        if leaf_ids:
            self._leaf_ids = leaf_ids
            self._fn = shard_checksums_fn(state_shardings, mesh, leaf_ids)
            self._mesh_pos = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}

    def _buddy(self, holder: int, live: set[int], load: dict, size: int) -> int | None:
        """A live device on another host, nearest host first (cyclically), least loaded."""
        H = self.topo.n_hosts
        h0 = self.topo.host_of(holder)
        for step in range(1, H):
            cands = [d for d in self.topo.host_devices((h0 + step) % H) if d in live]
            if cands:
                best = min(cands, key=lambda d: (load[d], d))
                load[best] += size
                return best
        return None

    def take(self, state, version: int, devices: dict[int, jax.Device]) -> None:
        """Snapshot `state` (whose step counter is `version`) right after the step produced it."""
        if not self.records:
            return
        self.complete()
        leaves = jax.tree.leaves(state)
        held = {
            (li, s.device.id): s.data
            for li in {r.leaf for r in self.records}
            for s in leaves[li].addressable_shards
        }
        self._pending_sums = self._fn(state)
        self._pending_sums.copy_to_host_async()
        buddy_x, buddy_dev, buddy_rec = [], [], []
        for r in self.records:
            data = held[(r.leaf, r.holder)]
            r.step = version
            r.checksum = None
            if r.buddy is not None:
                buddy_x.append(data)
                buddy_dev.append(devices[r.buddy])
                buddy_rec.append(r)
            elif self.cfg.host:
                r.host_data = np.array(data, copy=True)  # synchronous: the next step donates it
        if buddy_x:
            # on the CPU backend a device buffer already is host memory: `complete` copies it
            # once (an async host copy first would copy it twice)
            cpu = all(d.platform == "cpu" for d in buddy_dev)
            for r, copy in zip(buddy_rec, jax.device_put(buddy_x, buddy_dev)):
                r.buddy_data = copy
                if self.cfg.host:
                    if not cpu:
                        copy.copy_to_host_async()
                    r._host_pending = copy

    def complete(self) -> None:
        """Materialise in-flight host copies and checksums (called at the next step boundary)."""
        if self._pending_sums is None:
            return
        sums = np.asarray(self._pending_sums)
        self._pending_sums = None
        pos_in = {li: i for i, li in enumerate(self._leaf_ids)}
        for r in self.records:
            r.checksum = sums[self._mesh_pos[r.holder]][pos_in[r.leaf]]
            if r._host_pending is not None:
                r.host_data = np.array(r._host_pending, copy=True)
                r._host_pending = None

    def sources(
        self, dead_devices: set[int], dead_hosts: set[int], version: int
    ) -> dict[str, list[Shard]]:
        """Verified snapshot copies of shards held by dead devices, by leaf path."""
        self.complete()
        out: dict[str, list[Shard]] = defaultdict(list)
        for r in self.records:
            if r.holder not in dead_devices:
                continue
            if r.buddy is not None and r.buddy not in dead_devices and r.buddy_data is not None:
                ok = self._verify(r, r.buddy_data, "buddy", version)
                if ok:
                    out[r.path].append(Shard(r.buddy, r.box, r.buddy_data, "buddy"))
            if r.host_data is not None and r.host not in dead_hosts:
                if self._verify(r, r.host_data, "host", version):
                    out[r.path].append(Shard(f"host:{r.host}", r.box, r.host_data, "host"))
        return out

    def describe_sources(
        self, dead_devices: set[int], dead_hosts: set[int]
    ) -> dict[str, list[Shard]]:
        """What `sources` will hand over after this failure if every copy verifies, described
        (`data` is the copy's `reshard.SourceRef`): to plan a transition before it is needed."""
        out: dict[str, list[Shard]] = defaultdict(list)
        for r in self.records:
            if r.holder not in dead_devices:
                continue
            if self.cfg.buddy and r.buddy is not None and r.buddy not in dead_devices:
                out[r.path].append(described(r.path, Shard(r.buddy, r.box, None, "buddy")))
            if self.cfg.host and r.host not in dead_hosts:
                out[r.path].append(described(r.path, Shard(f"host:{r.host}", r.box, None, "host")))
        return dict(out)

    def _verify(self, r: Record, data, rung: str, version: int) -> bool:
        where = f"{rung} copy of '{r.path}' {list(r.box)} from device {r.holder}"
        if r.step != version:
            self.refusals.append(f"{where}: step {r.step} != {version}, refused")
            return False
        if r.checksum is None:
            self.refusals.append(f"{where}: no checksum recorded, refused")
            return False
        got = checksum.np_leaf_checksum(np.asarray(data))
        if not np.array_equal(got, r.checksum):
            self.refusals.append(
                f"{where}: checksum {checksum.hex_of(got)} != {checksum.hex_of(r.checksum)}, refused"
            )
            return False
        return True

    def drop(self) -> None:
        self.records = []
        self._pending_sums = None
