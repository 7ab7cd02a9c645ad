"""Per-step in-memory snapshot pool: buddy-device and host-memory copies of unique state.

A shard is *unique* when every device holding its slice sits on one host, so that one host
failure (or one device failure, when it is the only holder) loses it: ZeRO partitions, tensor
slices held in one host, pipeline stages without a replica elsewhere. After every step the pool
copies each unique shard

- to a **buddy** device on another host (`snapshot.buddy`), dispatched asynchronously so it
  overlaps the next step; with `snapshot.copies: k`, to k buddies on k different hosts, none the
  holder's, so that any k hosts failing together leave a copy; and/or
- to **host memory** (`snapshot.host`). Where that memory is depends on the runtime: in one
  process (simulated hosts) it is the holder's host, copied from the holder (never from a buddy
  copy), so the copy survives a device failure and the buddy's loss but not the loss of its
  host; under the multi-controller runtime a host is a process, whose memory dies with it, so
  the host copy lives in the memory of the process the (first) buddy copy is sent to, read from
  that copy: it survives what the buddy copy survives;

together with the step id and a per-shard checksum computed on device by the holder. The copies
travel through the runtime (`Runtime.move`): `jax.device_put` in one process, a point-to-point
pull between processes. In one process on the CPU backend (`fused`) the checksums' program makes
the copies itself, queued right behind the step. In one process (fused or not) a generation is
read (checksum rows to the host, copies as host arrays) only when a recovery or a simulated
failure needs it.

On a failure `sources` hands the transition verified copies of the dead holders' shards: a copy
whose step id differs from the state version being restored, or whose checksum does not match,
is refused (and the refusal reported), and the next rung is tried. Under the multi-controller
runtime each process verifies the copies it holds and the refusals are agreed, so every process
plans with the same sources. After a recovery the pool is configured for the new plan (new
holders, new buddies), so the next failure is covered.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..config import ConfigError, HardwareConfig, SnapshotConfig
from ..core.sharding import path_str
from ..plan.planner import Topology
from . import checksum, copies
from .shards import Box, Shard, box_size, described, index_to_box


@dataclasses.dataclass
class Record:
    leaf: int  # index in the state's flatten order
    path: str
    box: Box
    holder: int
    buddy: int | None  # the device that keeps a device copy (`snapshot.buddy`)
    via: int  # the device the copy lands on first (the buddy, or the holder itself)
    host: int | None  # the host whose memory keeps a host copy (`snapshot.host`)
    nbytes: int
    # which of the shard's `snapshot.copies` buddy copies (0 .. k-1); each is its own record,
    # on its own host, and only copy 0 carries the host copy
    copy: int = 0
    step: int = -1
    checksum: np.ndarray | None = None
    buddy_data: Any = None
    host_data: np.ndarray | None = None
    # why a copy of the filed step is missing ("buddy"/"host" -> reason): reported only if a
    # recovery needs that copy (`sources`), not for every copy a failure happened to catch
    lost: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Generation:
    """One `take`: the holders' checksums and the copies landed on this process, not yet filed."""

    version: int
    sums: Any
    landed: dict = dataclasses.field(default_factory=dict)  # record index -> copy
    # record index -> a host copy taken from the holder beside its buddy copy (`_take`)
    landed_host: dict = dataclasses.field(default_factory=dict)
    moved_sums: dict = dataclasses.field(default_factory=dict)  # (holder, via) -> checksums
    # leaf -> the copies of it made by a fused pool's program, one per buddy copy (outside
    # `in_flight`: they stand for memory off the holders, so a holder's failure spares them)
    copied: dict = dataclasses.field(default_factory=dict)
    rows: dict | None = None  # record index -> its checksum row, once read (`_rows`)


def check_coverable(cfg: SnapshotConfig, topo: Topology) -> None:
    """A buddy must sit on another host: refuse a buddy request on a job of one host, and more
    buddy copies than there are other hosts (`SnapshotConfig.check`)."""
    cfg.check(topo.n_hosts)
    if cfg.buddy and topo.n_hosts < 2:
        raise ConfigError(
            f"config 'snapshot.buddy' = true needs a buddy device on another host, and this job "
            f"has one host ({len(topo.device_ids)} devices, {topo.devices_per_host} per host). Fixes: "
            "set parallel.devices_per_host below the device count (under `elasjax launch`: start "
            "2 processes or more), use snapshot.host = true (a host-memory copy, which survives "
            "a device failure), or leave snapshot unset (it protects by itself)"
        )


def _unique_shards(x, topo: Topology) -> list[tuple[Box, int]]:
    """(box, first holder) of each block of `x` whose holders all sit on one host."""
    holders: dict[Box, list[int]] = defaultdict(list)
    for d, idx in x.sharding.devices_indices_map(tuple(x.shape)).items():
        holders[index_to_box(idx, x.shape)].append(d.id)
    return [
        (box, sorted(devs)[0])
        for box, devs in holders.items()
        if len({topo.host_of(d) for d in devs}) == 1
    ]


def _one_process(runtime) -> bool:
    """Does `runtime` hold every device in this process (`InProcessRuntime`), so that its hosts'
    memory does not die with them? Its snapshot generations are read only when needed
    (`SnapshotPool._file`), and on the CPU backend copied by the checksums' program
    (`SnapshotPool.fusion_helps`)."""
    return getattr(runtime, "host_copies_off_host", True) is False


def copy_counts(resolved: SnapshotConfig, abstract, leaf_ids: list[int]) -> tuple[int, ...]:
    """How many copies of each of `leaf_ids` a fused pool's program makes (`SnapshotPool`,
    `fused`): one per buddy copy (`snapshot.copies`), one where only host copies are taken,
    none for PRNG keys (moved through the runtime). `resolved`: `SnapshotConfig.resolved`."""
    leaves = jax.tree.leaves(abstract)
    k = resolved.copies if resolved.buddy else 1
    return tuple(k if isinstance(leaves[li].dtype, np.dtype) else 0 for li in leaf_ids)


def prepare_checksums(cfg: SnapshotConfig, topo: Topology, abstract, state_shardings,
                      mesh: Mesh, fused: bool = False) -> None:
    """Compile ahead the checksums that the snapshots of `cfg` (as given) would take on a plan
    (`abstract`: its state's shapes and dtypes; `state_shardings`, `mesh`: its layout): the
    standby calls it for each plan it builds, so that a recovery's first snapshot does not
    compile. Which leaves are snapshotted depends only on the layout and the topology, as in
    `SnapshotPool.configure`, so no pool is needed."""
    resolved = cfg.resolved(topo.n_hosts, len(topo.device_ids))
    if not (resolved.buddy or resolved.host):
        return
    placed = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract,
        state_shardings,
    )
    leaf_ids = [li for li, x in enumerate(jax.tree.leaves(placed)) if _unique_shards(x, topo)]
    if leaf_ids:
        checksum.shard_checksums(state_shardings, mesh, leaf_ids, abstract,
                                 copy_counts(resolved, abstract, leaf_ids) if fused else ())


def _mb(n: int) -> str:
    return f"{n / 1e6:.3g} MB"


class SnapshotPool:
    """See the module docstring. `runtime` moves the copies and says which devices are this
    process's (`runtime.process_of`, `runtime.me`) and where host copies live (one process holding
every device of `topo`: `InProcessRuntime(topology=topo)`). `cfg` as given
    (`null` fields are decided from the topology: `SnapshotConfig.resolved`)."""

    def __init__(self, cfg: SnapshotConfig, topo: Topology, runtime, *, donated: bool = True,
                 fused: bool = False):
        """`donated`: the step that follows a snapshot donates the state it reads (its buffers
        are then overwritten): a host copy still under way must read a copy of them.
        `fused`: the copies are made by the checksums' program itself (`fusion_helps`), which
        the next step must not donate the state of."""
        check_coverable(cfg, topo)
        if fused and donated:
            raise ValueError("SnapshotPool: fused=True copies the state in a program queued "
                             "before the next step, which must not donate it: pass donated=False")
        if fused and not self.fusion_helps(runtime):
            raise ValueError("SnapshotPool: fused=True needs one process on the CPU backend with "
                             "synchronous dispatch (`fusion_helps`)")
        self.given, self.donated, self.fused = cfg, donated, fused
        self.cfg = cfg.resolved(topo.n_hosts, len(topo.device_ids))
        self.topo, self.rt = topo, runtime
        self.unprotected: list[str] = []  # unique shards left uncovered (opted out), described
        self.records: list[Record] = []
        self.refusals: list[str] = []
        self._fn = None
        self._pending: _Generation | None = None
        self._unread: _Generation | None = None  # filed, not yet read (`_file`)
        self._copied: dict[int, list[int]] = {}  # a fused pool's: leaf -> its copies' outputs
        self.bytes_per_step = 0

    @staticmethod
    def fusion_helps(runtime) -> bool:
        """Should the checksums' program make the copies too (`fused`)? In one process on the
        CPU backend with elasjax's synchronous dispatch (`runtime.dispatch`), where a device's
        memory is this process's: there a program's output buffer is host memory, so the copy
        its device threads write, queued right behind the step, stands for the buddy's (or the
        host's) memory. A memcpy by a Python thread instead either runs beside the next step
        (whose collectives over 8 fake devices on a few cores it slows by more than it costs
        alone) or holds back its dispatch (experiments/RESULTS.md, "The snapshot's copies made
        by its checksums' program and read only when needed"). Elsewhere the copies travel
        through the runtime (`Runtime.move`)."""
        return (
            _one_process(runtime)
            and jax.default_backend() == "cpu"
            and not jax.config.read("jax_cpu_enable_async_dispatch")
        )

    @property
    def enabled(self) -> bool:
        return self.cfg.buddy or self.cfg.host

    def _local(self, device) -> bool:
        return self.rt.process_of(device) == self.rt.me

    def configure(self, state, state_shardings, mesh: Mesh, live: set[int]) -> None:
        """Choose what to snapshot on this plan and where (buddies on other hosts, balanced).
        Every process makes the same choice (from the shardings alone)."""
        self._fn = None
        self._pending = self._unread = None
        self._copied = {}
        leaf_ids = self.place(state, live)
        if leaf_ids:
            self._leaf_ids = leaf_ids
            self._pos_in = {li: i for i, li in enumerate(leaf_ids)}
            counts = copy_counts(self.cfg, state, leaf_ids) if self.fused else ()
            self._fn = checksum.shard_checksums(state_shardings, mesh, leaf_ids, state, counts)
            at = 1  # a leaf's copies among the program's outputs, after the checksums
            for li, k in zip(leaf_ids, counts):
                if k:
                    self._copied[li], at = list(range(at, at + k)), at + k
            self._mesh_ndim = len(mesh.axis_names)

    def place(self, state, live: set[int]) -> list[int]:
        """The records of a plan's snapshots (`self.records`: which shard goes where), from the
        layout of `state` alone: its leaves may be abstract (`jax.ShapeDtypeStruct`s with
        shardings), as for `elasjax plan --coverage`. Returns the indices of the leaves with
        unique shards. Nothing is copied or compiled."""
        self.records = []
        self.unprotected = []
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        if not self.enabled:
            self.unprotected = [
                f"'{path_str(p)}' {list(box)} on device {h}"
                for p, x in flat
                for box, h in _unique_shards(x, self.topo)
            ]
            self.bytes_per_step = 0
            return []
        load: dict[int, int] = defaultdict(int)
        leaf_ids = []
        # a copy must leave the holder's host when host memory dies with the holder (a process)
        off_host = self.cfg.buddy or self.rt.host_copies_off_host
        k = self.cfg.copies if self.cfg.buddy else 1
        homeless: list[str] = []
        short: list[str] = []
        for li, (path, x) in enumerate(flat):
            unique = _unique_shards(x, self.topo)
            if not unique:
                continue
            leaf_ids.append(li)
            for box, h in unique:
                size = box_size(box) * x.dtype.itemsize
                vias = self._buddies(h, live, load, size, k) if off_host else []
                if off_host and not vias:
                    homeless.append(f"'{path_str(path)}' {list(box)} from device {h}")
                elif len(vias) < k:
                    short.append(f"'{path_str(path)}' {list(box)} from device {h}")
                for c, via in enumerate(vias or [None]):
                    host = None
                    off = self.rt.host_copies_off_host
                    if c == 0 and self.cfg.host and not (off and via is None):
                        host = self.topo.host_of(via if off else h)
                    self.records.append(
                        Record(
                            li, path_str(path), box, h, via if self.cfg.buddy else None,
                            h if via is None else via, host, size, copy=c,
                        )
                    )
        if homeless:  # every other host is gone: these shards have no off-host copy
            self.refusals.append(
                f"no live device on another host: {len(homeless)} buddy copies not taken, "
                f"e.g. {homeless[0]}"
            )
        if short:  # fewer live hosts than snapshot.copies asks for
            self.refusals.append(
                f"snapshot.copies = {k} but fewer other hosts have live devices: {len(short)} "
                f"shards get fewer buddy copies, e.g. {short[0]}"
            )
        # each buddy copy once, each host copy once (with copies = 1: every record carries both)
        self.bytes_per_step = sum(
            r.nbytes * (int(self.cfg.buddy) + int(self.cfg.host and r.copy == 0))
            for r in self.records
        )
        return leaf_ids

    def cost_line(self, hw=None) -> str:
        """What this plan's snapshots cost per step, in words: the bytes copied, and an estimate
        of the time the busiest device spends sending or receiving its buddy copies at the cost
        model's link bandwidth (`hw`: a `config.HardwareConfig`; the nominal one if None). Host copies cross no link the cost model knows: bytes only."""
        if not self.enabled:
            return "snapshots: off (snapshot.buddy and snapshot.host are false)"
        if not self.records:
            return "snapshots: this plan holds no unique shard, so nothing is copied per step"
        # (device, direction) -> bytes and copies: a link sends and receives at once
        load: dict[tuple[int, str], int] = defaultdict(int)
        msgs: dict[tuple[int, str], int] = defaultdict(int)
        for r in self.records:
            if r.buddy is not None:
                for end in ((r.holder, "out"), (r.buddy, "in")):
                    load[end] += r.nbytes
                    msgs[end] += 1
        buddy_b = sum(b for (_, way), b in load.items() if way == "out")
        host_b = self.bytes_per_step - buddy_b
        shards = len({(r.path, r.box) for r in self.records})
        parts = []
        if buddy_b:
            hw = hw or HardwareConfig()
            busiest = max(load.values())
            est = busiest / hw.link_bw + max(msgs.values()) * hw.link_latency_s
            parts.append(
                f"buddy copies x{self.cfg.copies} {_mb(buddy_b)} (busiest device "
                f"{_mb(busiest)}: about {est * 1e3:.3g} ms per step, an estimate at "
                f"hardware '{hw.name}' link_bw {hw.link_bw / 1e9:g} GB/s)"
            )
        if host_b:
            parts.append(f"host copies {_mb(host_b)} (device to host memory)")
        return (f"snapshots: {shards} unique shards, {_mb(self.bytes_per_step)} per step: "
                + "; ".join(parts))

    def risk(self) -> str | None:
        """What an opted-out pool leaves exposed on this plan, or None."""
        if not self.unprotected:
            return None
        n = len(self.unprotected)
        if self.given.auto:  # `SnapshotConfig.resolved`: one device, nowhere to restore to
            return (
                f"this job has one device and no spare, so no snapshot is taken: its failure "
                f"loses the state's {n} shard(s), and recovery then needs a checkpoint or raises "
                "UnrecoverableStateError"
            )
        return (
            f"snapshot.buddy and snapshot.host are false, and this plan holds {n} shard(s) on "
            f"one host only (e.g. {self.unprotected[0]}): a failure of that host (or device) "
            "loses them, and recovery then needs a checkpoint or raises UnrecoverableStateError"
        )

    def _buddies(self, holder: int, live: set[int], load: dict, size: int, k: int) -> list[int]:
        """Up to `k` live devices, each on a different host other than the holder's: nearest
        hosts first (cyclically), the least loaded device of each."""
        H = self.topo.n_hosts
        h0 = self.topo.host_of(holder)
        out = []
        for step in range(1, H):
            if len(out) == k:
                break
            cands = [d for d in self.topo.host_devices((h0 + step) % H) if d in live]
            if cands:
                best = min(cands, key=lambda d: (load[d], d))
                load[best] += size
                out.append(best)
        return out

    def take(self, state, version: int) -> None:
        """Start snapshotting `state` (whose step counter is `version`) right after the step
        produced it. The copies land in a pending generation; the last filed one stays the
        pool's until `complete` files this one (at the next step boundary), and `abort` drops it
        if its step fails. Collective under the multi-controller runtime.

        A `fused` pool's copies are outputs of the checksums' program, queued behind the step
        that produced `state`: nothing waits for them here, and the next take files them
        unread (`_file`)."""
        if not self.records:
            return
        self._file()
        self._pending = self._take(state, version)

    def _take(self, state, version: int) -> _Generation:
        leaves = jax.tree.leaves(state)
        out = self._fn(*[leaves[li] for li in self._leaf_ids])
        if self.fused:  # the copies' blocks are picked out when read (`_fill`)
            gen = _Generation(version, out[0])
            gen.copied = {li: [out[o] for o in outs] for li, outs in self._copied.items()}
            if len(gen.copied) == len(self._leaf_ids):
                return gen
        else:
            gen = _Generation(version, out)
        sums = gen.sums
        held = {
            (li, s.device.id): s.data
            for li in {r.leaf for r in self.records}
            for s in leaves[li].addressable_shards
        }
        sums_of = {s.device.id: s.data for s in sums.addressable_shards}
        moves, targets = [], []
        for i, r in enumerate(self.records):
            if r.leaf in gen.copied:  # made by the program, on this process (`fusion_helps`)
                continue
            if r.via == r.holder:
                if self._local(r.holder):  # host copy on the holder's host
                    gen.landed[i] = self._to_host(held[(r.leaf, r.holder)])
                continue
            if not (self._local(r.holder) or self._local(r.via)):
                continue
            data = held.get((r.leaf, r.holder))
            if r.host is not None and not self.rt.host_copies_off_host and self._local(r.holder):
                # the host copy comes from the holder into its host's memory, not from the
                # buddy's copy: it must survive the buddy's loss
                # (tests/test_api.py::test_a_host_copy_survives_the_loss_of_the_buddy_it_was_sent_to)
                gen.landed_host[i] = self._to_host(data)
            shape = tuple(b - a for a, b in r.box)
            moves.append((r.holder, r.via, data, shape, leaves[r.leaf].dtype))
            targets.append(i)
            key = (r.holder, r.via)
            if key not in gen.moved_sums and self.rt.process_of(r.holder) != self.rt.process_of(r.via):
                gen.moved_sums[key] = None  # the holder's checksums travel with its copies
                shape = (1,) * self._mesh_ndim + (len(self._leaf_ids), 2)
                moves.append((r.holder, r.via, sums_of.get(r.holder), shape, np.dtype(np.uint32)))
                targets.append(key)
        # a collective under the multi-controller runtime: every process takes part, with copies
        # of its own or none (a newcomer admitted before the job grows onto it holds nothing of
        # the current plan; its skipped exchange left its numbered exchanges one behind the
        # others', and the admission timed out: tests/test_bitwise_sweep.py's ZeRO demo launch)
        for t, x in zip(targets, self.rt.move(moves)):
            if x is None:
                continue
            if isinstance(t, int):
                gen.landed[t] = x
            else:
                gen.moved_sums[t] = x
        return gen

    def _to_host(self, x: jax.Array):
        """A host copy of the one-device buffer `x`, independent of it (filed by `complete`).
        On the CPU backend the buffer is host memory already: copied now (a view of it would
        die with its simulated device). On an accelerator the transfer is started and not
        waited for (from a device copy when the next step donates the buffer): the step
        after it runs meanwhile, and `complete` collects it at the next step boundary."""
        # next(iter(...)), not .pop(): `devices()` is the sharding's cached set, shared by every
        # array on that mesh (tests/test_zero_train.py)
        if next(iter(x.devices())).platform == "cpu":
            return np.array(x, copy=True)
        y = x.copy() if self.donated else x
        y.copy_to_host_async()
        return y

    def _rows(self, gen: _Generation) -> dict:
        """Record index -> the holder's checksum row of its leaf, for the records whose holder,
        or a copy of its checksums, is on this process (each holder's block read once)."""
        local = {s.device.id: s.data for s in gen.sums.addressable_shards}
        blocks: dict = {}
        rows = {}
        for i, r in enumerate(self.records):
            if self._local(r.holder):
                key, blk = r.holder, local[r.holder]
            elif gen.moved_sums.get((r.holder, r.via)) is not None:
                key, blk = (r.holder, r.via), gen.moved_sums[(r.holder, r.via)]
            else:
                continue
            if key not in blocks:
                blocks[key] = np.asarray(blk).reshape(-1, 2)
            rows[i] = blocks[key][self._pos_in[r.leaf]]
        return rows

    def abort(self, version: int) -> None:
        """Drop the pending generation of `version` (its step failed): the filed one stays."""
        if self._pending is not None and self._pending.version == version:
            self._pending = None

    def complete(self) -> None:
        """File the pending generation: its copies and their checksums become the pool's."""
        self._file()
        self._read()

    def _file(self) -> None:
        """`complete`, but in one process (`_one_process`, fused or not) the generation is
        read (its checksum rows to the host, its copies as host arrays) only when something
        needs it (`_read`): on XLA:CPU a read at every step boundary waits for that step's program,
        beside which the snapshot's ran, and the loop then ran 1.13x slower at 25.5M
        parameters (experiments/RESULTS.md, "The snapshot's copies made by its checksums'
        program and read only when needed"; `ElasticState`'s pool too: "ElasticState.commit's
        checksums"). Under the multi-controller runtime the read stays at the boundary (the
        copies' transfers between processes waited for there; not measured otherwise)."""
        gen, self._pending = self._pending, None
        if gen is None:
            return
        if _one_process(self.rt):  # (every fused pool is)
            self._unread = gen
            for r in self.records:
                r.step, r.checksum, r.lost = gen.version, None, {}
                r.buddy_data = r.host_data = None
            return
        self._fill(gen)

    def _read(self) -> None:
        """Read the filed generation that `_file` left unread."""
        gen, self._unread = self._unread, None
        if gen is not None:
            self._fill(gen)

    def _fill(self, gen: _Generation) -> None:
        """Make `gen`'s copies and checksums the records'."""
        rows = gen.rows if gen.rows is not None else self._rows(gen)
        made = {  # (leaf, copy, holder) -> the holder's block of a fused program's copy
            (li, c, s.device.id): s.data
            for li, outs in gen.copied.items()
            for c, x in enumerate(outs)
            for s in x.addressable_shards
        }
        for i, r in enumerate(self.records):
            r.step, r.checksum = gen.version, None
            r.buddy_data = r.host_data = None
            r.lost = {}
            if i not in rows:
                continue  # neither the holder nor a copy of it lives here
            r.checksum = rows[i]
            # a fused copy as a host array: a view of the program's output, no second copy
            landed = (copies.host_view(made[(r.leaf, r.copy, r.holder)]) if r.leaf in gen.copied
                      else self._arrived(gen.landed.get(i), r, gen.version))
            if r.buddy is not None:
                r.buddy_data = landed
            if r.host is not None:
                host = (self._arrived(gen.landed_host[i], r, gen.version, "host")
                        if i in gen.landed_host else landed)
                # (on the CPU backend a numpy copy was made in `take` already)
                r.host_data = host if host is None or isinstance(host, np.ndarray) else np.array(host)

    def _arrived(self, x, r: Record, version: int, which: str | None = None):
        """`x`, a copy taken for record `r`, or None (refused) if it was still on its way off a
        device when that device failed."""
        if isinstance(x, jax.Array) and x.is_deleted():
            which = which or ("buddy" if r.buddy is not None else "host")
            r.lost[which] = (f"the copy of step {version} was lost in flight: its device failed "
                             "before it landed")
            return None
        return x

    def sources(
        self, dead_devices: set[int], dead_hosts: set[int], version: int
    ) -> dict[str, list[Shard]]:
        """Verified snapshot copies of shards held by dead devices, by leaf path. A copy held by
        another process is described (data None); the refusals of every process are agreed, so
        every process gets the same sources."""
        self.complete()
        cands: list[tuple[Record, str, Any]] = []
        refused_here: list[int] = []
        for r in self.records:
            if r.holder not in dead_devices:
                continue
            if r.buddy is not None and r.buddy not in dead_devices:
                cands.append((r, "buddy", r.buddy))
            if r.host is not None and r.host not in dead_hosts:
                cands.append((r, "host", f"host:{r.host}"))
        for i, (r, rung, where) in enumerate(cands):
            if self._local(where):
                data = r.buddy_data if rung == "buddy" else r.host_data
                if not self._verify(r, data, rung, version):
                    refused_here.append(i)
        refused = set()
        for ids in self.rt.agree(refused_here).values():
            refused.update(ids)
        out: dict[str, list[Shard]] = defaultdict(list)
        for i, (r, rung, where) in enumerate(cands):
            if i in refused:
                continue
            data = None
            if self._local(where):
                data = r.buddy_data if rung == "buddy" else r.host_data
            out[r.path].append(Shard(where, r.box, data, rung))
        return out

    def describe_sources(
        self, dead_devices: set[int], dead_hosts: set[int]
    ) -> dict[str, list[Shard]]:
        """What `sources` will hand over after this failure if every copy verifies, described
        (`data` is the copy's `shards.SourceRef`): to plan a transition before it is needed."""
        out: dict[str, list[Shard]] = defaultdict(list)
        for r in self.records:
            if r.holder not in dead_devices:
                continue
            if r.buddy is not None and r.buddy not in dead_devices:
                out[r.path].append(described(r.path, Shard(r.buddy, r.box, None, "buddy")))
            if r.host is not None and r.host not in dead_hosts:
                out[r.path].append(described(r.path, Shard(f"host:{r.host}", r.box, None, "host")))
        return dict(out)

    def _verify(self, r: Record, data, rung: str, version: int) -> bool:
        where = f"{rung} copy of '{r.path}' {list(r.box)} from device {r.holder}"
        if data is None:
            self.refusals.append(f"{where}: {r.lost.get(rung, 'no copy was taken')}, refused")
            return False
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

    def in_flight(self) -> list:
        """The copies (and checksums) of the pending generation landing on this process."""
        gen = self._pending
        if gen is None:
            return []
        return [x for x in (*gen.landed.values(), *gen.moved_sums.values()) if isinstance(x, jax.Array)]

    def device_buffers(self) -> list:
        """The device copies this process holds (a failure of their device deletes them). A
        simulated failure asks for them first, so the checksums a fused pool has not read yet
        are read here, from their holders, before any of them fails."""
        self._read()
        gen = self._pending
        if gen is not None and self.fused and gen.rows is None:
            gen.rows = self._rows(gen)
        out = [r.buddy_data for r in self.records if isinstance(r.buddy_data, jax.Array)]
        return out + self.in_flight()

    def fresh(self) -> SnapshotPool:
        """An empty pool of the same kind (for a new plan; this one stays until it is replaced)."""
        pool = SnapshotPool(self.given, self.topo, self.rt, donated=self.donated,
                            fused=self.fused)
        pool.refusals = self.refusals
        return pool

    def drop(self) -> None:
        self.records = []
        self._pending = self._unread = None
