"""The multi-controller runtime: start-up, live-set agreement, cross-process state movement and a
host-memory snapshot pool held by a buddy process.

One Python process per host (here: per group of `devices_per_process` CPU devices) runs the same
program; `jax.distributed` connects them through a coordination service hosted by process 0 and
their collectives run over gloo (CPU) or NCCL (GPU). A failure is a process that dies. The
engine's own primitives do the fault tolerance; this module only wires them up:

- `initialize` turns on `jax_enable_recoverability` (a dead peer no longer takes everyone down),
  a short coordination heartbeat and `--xla_cpu_collective_timeout_seconds` (without it the
  survivors of a kill wait in a gloo collective for minutes; with it the collective fails after
  the timeout and `multihost_utils.live_devices` turns that into `ProcessFailureError`).
- `Membership` is the agreed set of live processes and their devices. Every change to it comes
  out of a `live_devices` block, whose barrier hands every survivor the same set, so all
  processes plan the same next layout (the planner is pure).
- State moves between processes only through collectives over the live processes
  (`Exchanger`): cross-process `device_put` onto a different device set is refused by the
  runtime. `plan_rebuild` is a pure, deterministic transfer plan that every process computes
  identically; `execute_rebuild` performs its part of it: local pieces (a surviving shard on the
  same process, or a host snapshot it holds) by single-device `device_put`, remote pieces by one
  all-gather of packed byte buffers, then `jax.make_array_from_single_device_arrays` assembles
  the arrays of the new plan from each process's local shards.
- Recovery ladder, cheapest first: a live replica of the slice (data-parallel copies on any
  survivor), then the host snapshot of the dead process's *unique* shards, which its ring
  successor received after every committed step (`take_snapshot`, a `ppermute` ring shift of
  byte buffers, each shard with a CRC32 and the step id). A slice on neither rung raises
  `UnrecoverableStateError`; a snapshot whose checksum or step does not match raises
  `SnapshotCorruptError`. Nothing is re-initialised.

Rejected alternative: shipping state through the coordination service's key-value store. It
works on every platform, but it routes every byte through process 0 and a gRPC channel, and
process 0 would then hold the "buddy" copy of everyone; the data plane (collectives) is the right
transport and stays the same on GPU.

Limits measured on CPU/gloo (jax 0.10.2; see docs/multiprocess.md): process 0 hosts the
coordination service, and its death makes the runtime terminate every other process;
`client.wait_at_barrier` with a dead participant blocks until its own timeout (so the only
barrier used here is the one inside `live_devices`); a restarted process reconnects to the
coordination service but cannot join a collective (the gloo rendezvous key already exists), so
membership can only shrink on CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .reshard import Box, Transfer, TransferLog, UnrecoverableStateError, box_str, index_to_box
from .sharding import path_str

PyTree = Any

COORDINATOR_LOSS = (
    "process 0 hosts the JAX coordination service; when it dies the runtime terminates every "
    'other process ("Terminating process because the JAX distributed service detected fatal '
    'errors"), so the job cannot survive the loss of process 0: restart it (from a checkpoint)'
)
REJOIN_UNSUPPORTED = (
    "a restarted process cannot rejoin on CPU/gloo: it reconnects to the coordination service, "
    "but its first collective fails with 'Gloo context initialization failed: ALREADY_EXISTS: "
    "key cpu:gloo/<devices>/<n> already exists' and the survivors' collectives time out "
    "(measured with jax 0.10.2); membership can only shrink on CPU"
)


class SnapshotCorruptError(RuntimeError):
    """A host snapshot fails its checksum or holds another step than the one being restored."""


class RejoinUnsupportedError(RuntimeError):
    """Growing the membership (a process rejoining) is not possible on this platform."""


# ---------------------------------------------------------------------------------------------
# Start-up.


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How one process joins the job.

    Attributes:
      coordinator: `host:port` of the coordination service (process 0 binds it).
      num_processes: processes in the job.
      process_id: this process, 0 .. num_processes - 1.
      platform: `cpu` (gloo collectives, `devices_per_process` fake devices) or `gpu`.
      devices_per_process: CPU devices per process (ignored on GPU).
      heartbeat_timeout_s: a process missing heartbeats this long is declared dead.
      collective_timeout_s: a CPU collective waiting longer fails (`--xla_cpu_collective_timeout_
        seconds`); it bounds detection of a peer that died inside a collective.
      init_timeout_s: how long `initialize` waits for every process to connect.
    """

    coordinator: str
    num_processes: int
    process_id: int
    platform: str = "cpu"
    devices_per_process: int = 2
    heartbeat_timeout_s: int = 5
    collective_timeout_s: int = 8
    init_timeout_s: int = 120

    def __post_init__(self) -> None:
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"coordinator {self.coordinator!r} must look like HOST:PORT")
        if self.num_processes < 1:
            raise ValueError(f"num_processes = {self.num_processes} must be >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id = {self.process_id}; allowed values: 0 .. {self.num_processes - 1}"
            )
        if self.platform not in ("cpu", "gpu"):
            raise ValueError(f"platform {self.platform!r}; allowed values: 'cpu', 'gpu'")
        if self.platform == "cpu" and self.devices_per_process < 1:
            raise ValueError(f"devices_per_process = {self.devices_per_process} must be >= 1")
        for name in ("heartbeat_timeout_s", "collective_timeout_s", "init_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")


def xla_flags(rc: RuntimeConfig, existing: str = "") -> str:
    """XLA_FLAGS for a worker: the caller's flags without a fake-device count (the count is
    `jax_num_cpu_devices`) or an older collective timeout, plus this job's timeout flags."""
    drop = ("--xla_force_host_platform_device_count", "--xla_cpu_collective_timeout_seconds")
    kept = [f for f in existing.split() if not f.startswith(drop)]
    if rc.platform == "cpu":
        kept.append(f"--xla_cpu_collective_timeout_seconds={rc.collective_timeout_s}")
    else:  # GPU: do not abort the process on a NCCL error; let live_devices handle it
        kept += ["--xla_gpu_nccl_terminate_on_error=false", "--xla_gpu_nccl_async_execution=true"]
    return " ".join(kept)


def initialize(rc: RuntimeConfig) -> None:
    """Join the job. Must run before anything creates a JAX backend in this process."""
    os.environ["XLA_FLAGS"] = xla_flags(rc, os.environ.get("XLA_FLAGS", ""))
    if rc.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", rc.devices_per_process)
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "1")
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        coordinator_address=rc.coordinator,
        num_processes=rc.num_processes,
        process_id=rc.process_id,
        initialization_timeout=rc.init_timeout_s,
        heartbeat_timeout_seconds=rc.heartbeat_timeout_s,
    )
    if jax.process_count() != rc.num_processes:
        raise RuntimeError(
            f"jax.distributed reports {jax.process_count()} processes, expected {rc.num_processes}"
        )


def kv_client():
    """The coordination service client (key-value store), or an error if not initialised."""
    from jax._src import distributed as _dist  # the runtime keeps its client here

    client = _dist.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised; call distributed.initialize first")
    return client


# ---------------------------------------------------------------------------------------------
# Membership.


@dataclasses.dataclass(frozen=True)
class Membership:
    """The agreed live devices, process-major (process index, then device id)."""

    devices: tuple[Any, ...]

    @classmethod
    def of(cls, devices: Sequence[Any]) -> Membership:
        return cls(tuple(sorted(devices, key=lambda d: (d.process_index, d.id))))

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices)

    @property
    def processes(self) -> tuple[int, ...]:
        return tuple(sorted({d.process_index for d in self.devices}))

    def process_of(self) -> dict[int, int]:
        return {d.id: d.process_index for d in self.devices}

    def by_id(self) -> dict[int, Any]:
        return {d.id: d for d in self.devices}

    def without(self, failed_ids: set[int]) -> Membership:
        return Membership(tuple(d for d in self.devices if d.id not in failed_ids))

    def representatives(self) -> list[Any]:
        """One device (the lowest) per live process, in process order."""
        first: dict[int, Any] = {}
        for d in self.devices:
            first.setdefault(d.process_index, d)
        return [first[p] for p in self.processes]

    def successor(self, process: int) -> int:
        """The next live process on the ring: it holds `process`'s host snapshot."""
        procs = self.processes
        return procs[(procs.index(process) + 1) % len(procs)]

    def predecessor(self, process: int) -> int:
        procs = self.processes
        return procs[(procs.index(process) - 1) % len(procs)]


# ---------------------------------------------------------------------------------------------
# Collectives over the live processes: one device per process, byte buffers.


def _identity(x):
    return x


class Exchanger:
    """All-gather and ring shift of equal-length byte buffers among the live processes.

    Buffers travel as uint32 words on a 1-D mesh of one device per live process; executables are
    compiled per buffer length and cached in the instance (one instance per membership).
    """

    def __init__(self, member: Membership):
        self.member = member
        self.reps = member.representatives()
        self.mesh = Mesh(np.asarray(self.reps, dtype=object), ("proc",))
        self._fns: dict = {}
        self._me = jax.process_index()

    def _global(self, buf: np.ndarray) -> jax.Array:
        words = _to_words(buf)
        local = [d for d in self.reps if d.process_index == self._me]
        if not local:
            raise RuntimeError(f"process {self._me} is not a member of {self.member.processes}")
        sh = NamedSharding(self.mesh, PartitionSpec("proc"))
        x = jax.device_put(words[None], local[0])
        return jax.make_array_from_single_device_arrays((len(self.reps), words.size), sh, [x])

    def all_gather(self, buf: np.ndarray) -> np.ndarray:
        """uint8[L] from every process -> uint8[n_processes, L] (process order) on every one."""
        x = self._global(buf)
        key = ("gather", x.shape)
        if key not in self._fns:
            self._fns[key] = jax.jit(
                _identity, out_shardings=NamedSharding(self.mesh, PartitionSpec())
            )
        y = np.asarray(self._fns[key](x).addressable_shards[0].data)
        return y.view(np.uint8)[:, : buf.size]

    def ring_shift(self, buf: np.ndarray) -> np.ndarray:
        """Send uint8[L] to the ring successor; return the predecessor's buffer."""
        x = self._global(buf)
        key = ("ring", x.shape)
        if key not in self._fns:
            n = len(self.reps)
            perm = [(i, (i + 1) % n) for i in range(n)]
            spec = PartitionSpec("proc")
            fn = jax.shard_map(
                lambda a: jax.lax.ppermute(a, "proc", perm),
                mesh=self.mesh,
                in_specs=spec,
                out_specs=spec,
            )
            self._fns[key] = jax.jit(fn)
        y = np.asarray(self._fns[key](x).addressable_shards[0].data)
        return y.view(np.uint8).reshape(-1)[: buf.size]


def _to_words(buf: np.ndarray) -> np.ndarray:
    pad = (-buf.size) % 4
    b = np.concatenate([buf, np.zeros(pad, np.uint8)]) if pad else buf
    return np.ascontiguousarray(b).view(np.uint32)


def _host_bytes(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


# ---------------------------------------------------------------------------------------------
# Layouts: where every box of every leaf lives (global knowledge, identical on all processes).


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """One state leaf: its shape, dtype and the box each device of its sharding holds."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    boxes: Mapping[int, Box]  # device id -> box, every device of the sharding

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize


def layouts(abstract: PyTree, shardings: PyTree) -> list[LeafLayout]:
    """Layouts of a tree of (abstract or concrete) arrays under a matching tree of shardings."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shs = treedef.flatten_up_to(shardings)
    out = []
    for (path, x), sh in zip(flat, shs):
        shape = tuple(x.shape)
        boxes = {d.id: index_to_box(idx, shape) for d, idx in sh.devices_indices_map(shape).items()}
        out.append(LeafLayout(path_str(path), shape, x.dtype, boxes))
    return out


def local_shards(tree: PyTree) -> list[dict[int, jax.Array]]:
    """Per leaf, this process's single-device buffers by device id."""
    return [{s.device.id: s.data for s in x.addressable_shards} for x in jax.tree.leaves(tree)]


def _contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _size(box: Box) -> int:
    return int(np.prod([b - a for a, b in box])) if box else 1


def _cells(dst: Box, boxes: Sequence[Box]) -> list[Box]:
    """Cut `dst` along every boundary of `boxes` inside it."""
    axes = []
    for d, (lo, hi) in enumerate(dst):
        cuts = {lo, hi}
        for b in boxes:
            cuts.update(c for c in b[d] if lo < c < hi)
        pts = sorted(cuts)
        axes.append(list(itertools.pairwise(pts)))
    return [tuple(c) for c in itertools.product(*axes)]


def _rel(cell: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(slice(c0 - o0, c1 - o0) for (c0, c1), (o0, _) in zip(cell, outer))


# ---------------------------------------------------------------------------------------------
# Host snapshots of unique shards, held by the ring successor.


def unique_shards(lays: Sequence[LeafLayout], member: Membership) -> dict[int, list]:
    """Per live process, `(leaf, box, device)` of every box no other live process holds a copy
    of (on its lowest device). With state replicated over `data` and each tensor group inside
    one process this is empty; it is not when a slice lives in one process only (data = 1,
    tensor groups spanning processes, or ZeRO partitions)."""
    proc_of = member.process_of()
    out: dict[int, list] = {p: [] for p in member.processes}
    for li, lay in enumerate(lays):
        held: dict[int, dict[Box, int]] = defaultdict(dict)
        for dev, box in sorted(lay.boxes.items()):
            if dev in proc_of:
                held[proc_of[dev]].setdefault(box, dev)
        for p, boxes in held.items():
            for box, dev in boxes.items():
                others = [b for q, bs in held.items() if q != p for b in bs]
                if not any(_contains(b, box) for b in others):
                    out[p].append((li, box, dev))
    return out


@dataclasses.dataclass
class SnapshotPool:
    """This process's view of the host snapshots after committed step `step`.

    Every process knows the global placement (`unique`: what each owner sent; the holder of an
    owner's shards is its ring successor in `member`) and holds the bytes of exactly one owner,
    its ring predecessor: `held[(leaf, box)] = (host array, crc32)`.
    """

    step: int
    member: Membership
    unique: dict[int, list]
    owner: int | None = None  # whose shards this process holds
    held: dict = dataclasses.field(default_factory=dict)
    nbytes: int = 0

    def holdings(self, live_processes: Sequence[int]) -> dict[int, list[tuple[int, Box]]]:
        """leaf -> [(holder process, box)] of the shards of failed owners whose holder is live."""
        out: dict[int, list] = defaultdict(list)
        if len(self.member.processes) < 2:
            return out
        for owner, entries in self.unique.items():
            holder = self.member.successor(owner)
            if owner in live_processes or holder not in live_processes:
                continue
            for li, box, _ in entries:
                out[li].append((holder, box))
        return out

    def read(self, leaf: int, box: Box, step: int, path: str) -> np.ndarray:
        """The held copy of `box`, after checking its step and checksum."""
        if step != self.step:
            raise SnapshotCorruptError(
                f"host snapshot of '{path}' {box_str(box)} is of step {self.step}, restoring step "
                f"{step}; refusing to mix steps"
            )
        arr, crc = self.held[(leaf, box)]
        if zlib.crc32(_host_bytes(arr)) != crc:
            raise SnapshotCorruptError(
                f"host snapshot of '{path}' {box_str(box)} (step {step}, from process "
                f"{self.owner}) fails its checksum; refusing to restore it"
            )
        return arr


def snapshot_layout_bytes(lays: Sequence[LeafLayout], entries: list) -> int:
    return 4 * len(entries) + sum(_size(box) * lays[li].itemsize for li, box, _ in entries)


def take_snapshot(
    tree: PyTree,
    lays: Sequence[LeafLayout],
    member: Membership,
    exchanger: Exchanger,
    step: int,
) -> SnapshotPool:
    """Copy each process's unique shards of `tree` (the state after `step` committed steps) into
    its ring successor's host memory. Collective over the live processes when anything is
    unique; a no-op otherwise. Each shard carries a CRC32, checked on receipt and on restore."""
    me = jax.process_index()
    unique = unique_shards(lays, member)
    sizes = {p: snapshot_layout_bytes(lays, e) for p, e in unique.items()}
    pool = SnapshotPool(step, member, unique)
    if len(member.processes) < 2 or all(not e for e in unique.values()):
        return pool
    length = max(sizes.values())
    local = local_shards(tree)
    crcs, parts = [], []
    for li, box, dev in unique[me]:
        b = _host_bytes(local[li][dev])
        crcs.append(zlib.crc32(b))
        parts.append(b)
    buf = np.zeros(length, np.uint8)
    payload = np.concatenate([np.asarray(crcs, np.uint32).view(np.uint8), *parts]) if parts else []
    buf[: len(payload)] = payload
    got = exchanger.ring_shift(buf)
    owner = member.predecessor(me)
    entries = unique[owner]
    n = len(entries)
    sent_crcs = got[: 4 * n].view(np.uint32)
    off = 4 * n
    for (li, box, _), crc in zip(entries, sent_crcs):
        lay = lays[li]
        nb = _size(box) * lay.itemsize
        arr = (
            got[off : off + nb]
            .copy()
            .view(np.dtype(lay.dtype))
            .reshape(tuple(b - a for a, b in box))
        )
        off += nb
        if zlib.crc32(_host_bytes(arr)) != int(crc):
            raise SnapshotCorruptError(
                f"snapshot of '{lay.path}' {box_str(box)} from process {owner} (step {step}) "
                "arrived corrupted"
            )
        pool.held[(li, box)] = (arr, int(crc))
        pool.nbytes += nb
    pool.owner = owner
    return pool


# ---------------------------------------------------------------------------------------------
# Rebuilding state on a new plan from what the live processes hold.


@dataclasses.dataclass(frozen=True)
class Piece:
    """One cell of a destination shard and where it comes from.

    `src` is a device id for `rung == "replica"` and a process id (the holder) for
    `rung == "host"` (a host-memory snapshot); `src_box` is the box of the source buffer, which
    the cell is sliced from.
    """

    leaf: int
    cell: Box
    dst: int
    rung: str
    src: int
    src_box: Box
    src_process: int
    dst_process: int
    nbytes: int

    @property
    def remote(self) -> bool:
        return self.src_process != self.dst_process


def plan_rebuild(
    old: Sequence[LeafLayout],
    new: Sequence[LeafLayout],
    proc_of: Mapping[int, int],
    snapshots: Mapping[int, Sequence[tuple[int, Box]]] | None = None,
) -> list[Piece]:
    """Every cell of every destination shard of `new`, with its source. Pure and deterministic:
    every process computes the same plan from the same inputs.

    Args:
      old: where each leaf's boxes lived before (only devices in `proc_of` are live sources).
      new: the target layouts (every destination device must be in `proc_of`).
      proc_of: live device id -> process.
      snapshots: leaf -> [(holder process, box)] of live host snapshots.

    Sources are chosen by the recovery ladder: a live replica (rung `replica`: the destination
    device itself, then one on the destination's process, then the least-loaded remote one),
    then a host snapshot (rung `host`: on the destination's process first). A cell without a
    source raises `UnrecoverableStateError` naming the leaf and the slice.
    """
    snapshots = snapshots or {}
    load: dict = defaultdict(int)
    pieces: list[Piece] = []
    for li, (o, n) in enumerate(zip(old, new)):
        reps = [(dev, box) for dev, box in sorted(o.boxes.items()) if dev in proc_of]
        snaps = list(snapshots.get(li, ()))
        bounds = [b for _, b in reps] + [b for _, b in snaps]
        for dst, dbox in sorted(n.boxes.items()):
            if dst not in proc_of:
                raise ValueError(f"destination device {dst} of '{n.path}' is not live")
            dproc = proc_of[dst]
            whole = [(dev, b) for dev, b in reps if _contains(b, dbox)]
            whole_s = [(h, b) for h, b in snaps if _contains(b, dbox)]
            cells = [dbox] if whole or whole_s else _cells(dbox, bounds)
            for cell in cells:
                nb = _size(cell) * o.itemsize
                pieces.append(_pick(li, o, cell, dst, dproc, reps, snaps, proc_of, load, nb))
    return pieces


def _pick(li, lay, cell, dst, dproc, reps, snaps, proc_of, load, nbytes) -> Piece:
    holders = [(dev, b) for dev, b in reps if _contains(b, cell)]
    if holders:

        def rank(h):
            dev = h[0]
            return (dev != dst, proc_of[dev] != dproc, load[dev], dev)

        dev, box = min(holders, key=rank)
        if proc_of[dev] != dproc:
            load[dev] += nbytes
        return Piece(li, cell, dst, "replica", dev, box, proc_of[dev], dproc, nbytes)
    held = [(h, b) for h, b in snaps if _contains(b, cell)]
    if held:
        h, box = min(held, key=lambda x: (x[0] != dproc, load[("host", x[0])], x[0]))
        if h != dproc:
            load[("host", h)] += nbytes
        return Piece(li, cell, dst, "host", h, box, h, dproc, nbytes)
    raise UnrecoverableStateError(
        lay.path,
        cell,
        "every process holding it has failed and no live process holds a host snapshot of it",
    )


def execute_rebuild(
    pieces: Sequence[Piece],
    old: Sequence[LeafLayout],
    local: Sequence[Mapping[int, jax.Array]],
    pool: SnapshotPool | None,
    step: int,
    target: PyTree,
    treedef,
    devices: Mapping[int, Any],
    exchanger: Exchanger,
) -> tuple[PyTree, TransferLog]:
    """Perform this process's part of a rebuild plan; returns the new state and the log.

    Args:
      pieces: the plan (identical on every process).
      old: the source layouts (for paths, shapes and dtypes).
      local: this process's surviving buffers per leaf (`local_shards` of the last good state).
      pool: the host snapshots (checked against `step` before use), or None.
      step: the committed step being restored.
      target: tree of target `NamedSharding`s (the new plan's state shardings).
      treedef: the state's tree structure.
      devices: device id -> device.
      exchanger: collectives over the live processes (used only if a piece crosses processes).
    """
    me = jax.process_index()
    log = TransferLog()
    for p in pieces:
        src = p.src if p.rung == "replica" else f"host:p{p.src}"
        log.entries.append(Transfer(old[p.leaf].path, p.cell, src, p.dst, p.nbytes, p.rung))

    def host_piece(p: Piece) -> np.ndarray:
        if p.rung == "replica":
            x = local[p.leaf][p.src]
            return np.asarray(x if p.cell == p.src_box else x[_rel(p.cell, p.src_box)])
        if pool is None:
            raise SnapshotCorruptError(f"no host snapshot pool holds '{old[p.leaf].path}'")
        arr = pool.read(p.leaf, p.src_box, step, old[p.leaf].path)
        return arr if p.cell == p.src_box else arr[_rel(p.cell, p.src_box)]

    # Cross-process pieces: every sender packs its pieces (plan order) into one buffer; one
    # all-gather; receivers cut theirs out. Offsets are known to all from the plan.
    remote = [p for p in pieces if p.remote]
    recv: dict[int, np.ndarray] = {}
    if remote:
        offsets: dict[int, int] = defaultdict(int)
        where = []
        for p in remote:
            where.append((p.src_process, offsets[p.src_process]))
            offsets[p.src_process] += p.nbytes
        length = max(offsets.values())
        buf = np.zeros(length, np.uint8)
        for p, (sp, off) in zip(remote, where):
            if sp == me:
                buf[off : off + p.nbytes] = _host_bytes(host_piece(p))
        table = exchanger.all_gather(buf)
        row = {q: i for i, q in enumerate(exchanger.member.processes)}
        for i, (p, (sp, off)) in enumerate(zip(remote, where)):
            if p.dst_process == me:
                recv[id(p)] = table[row[sp], off : off + p.nbytes]

    cells: dict = defaultdict(list)
    puts, put_dev, slots = [], [], []
    for p in pieces:
        if p.dst_process != me:
            continue
        lay = old[p.leaf]
        shape = tuple(b - a for a, b in p.cell)
        if p.remote:
            x = recv[id(p)].copy().view(np.dtype(lay.dtype)).reshape(shape)
        elif p.rung == "replica":
            buf_ = local[p.leaf][p.src]
            x = buf_ if p.cell == p.src_box else buf_[_rel(p.cell, p.src_box)]
            if p.src == p.dst:
                cells[(p.leaf, p.dst)].append((p.cell, x))
                continue
        else:
            x = host_piece(p)
        slots.append((p.leaf, p.dst, p.cell))
        puts.append(x)
        put_dev.append(devices[p.dst])
    moved = jax.device_put(puts, put_dev) if puts else []
    for (li, dst, cell), x in zip(slots, moved):
        cells[(li, dst)].append((cell, x))

    leaves = []
    for li, sh in enumerate(treedef.flatten_up_to(target)):
        lay = old[li]
        arrays = [
            _assemble(cells[(li, d.id)], index_to_box(idx, lay.shape))
            for d, idx in sh.addressable_devices_indices_map(lay.shape).items()
        ]
        leaves.append(jax.make_array_from_single_device_arrays(lay.shape, sh, arrays))
    return jax.tree_util.tree_unflatten(treedef, leaves), log


def _assemble(cells: list[tuple[Box, jax.Array]], box: Box) -> jax.Array:
    """Concatenate cells that tile `box` (all on one device) into one array."""
    if len(cells) == 1:
        return cells[0][1]
    for d in range(len(box)):
        starts = sorted({c[0][d][0] for c in cells})
        if len(starts) > 1:
            parts = []
            for s in starts:
                group = [c for c in cells if c[0][d][0] == s]
                sub = box[:d] + (group[0][0][d],) + box[d + 1 :]
                parts.append(_assemble(group, sub))
            return jnp.concatenate(parts, axis=d)
    raise AssertionError(f"cells do not tile the box {box_str(box)}")
