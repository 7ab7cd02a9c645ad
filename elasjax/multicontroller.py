"""The multi-controller runtime: one process per host on `jax.distributed`, surviving the death
of any process but process 0. The trainer (`elasjax.trainer`) runs on it unchanged.

One Python process per host (here: per group of `devices_per_process` CPU devices) runs the same
program; `jax.distributed` connects them through a coordination service hosted by process 0 and
their collectives run over gloo (CPU) or NCCL (GPU). A failure is a process that dies. The
engine's own primitives do the fault tolerance; this module wires them up:

- `initialize` turns on `jax_enable_recoverability` (a dead peer no longer takes everyone down),
  a short coordination heartbeat and `--xla_cpu_collective_timeout_seconds` (the backstop: without
  it the survivors of a kill wait in a gloo collective for minutes).
- `guard(phase)` is a `multihost_utils.live_devices` block over the live devices: either every
  live process finishes it, or every one raises `ProcessFailureError` naming the dead devices
  (its exit is a barrier over the live processes), turned into `DeviceFailure`. So all survivors
  agree on the membership and plan the same next layout (the planner is pure).
- Cross-process copies (a transition's pieces, snapshot copies) go point to point through
  `jax.experimental.transfer`: every process runs a transfer server; the sender schedules its
  arrays under an id every process derives from the same sequence (`await_pull`), the receiver
  pulls exactly those into its own device (`pull`). Only the planned bytes travel, and a pull from
  a dead process fails at once (its socket closes) instead of waiting for a timeout.
  (Cross-process `jax.device_put` onto a different device set is refused by the runtime.)
- `agree` exchanges small values (snapshot refusals, cut-over readiness) through the coordination
  service's key-value store.
- Kills are real: a scheduled `kill_process` event makes that process write the time to the
  key-value store and send itself SIGKILL right after dispatching its step (its collectives in
  flight), or during a recovery's transfer; survivors report kill -> error.

Limits measured on CPU/gloo (jax 0.10.2; see docs/multiprocess.md): process 0 hosts the
coordination service, and its death makes the runtime terminate every other process; a
restarted process reconnects to the coordination service but cannot join a collective (the gloo
rendezvous key already exists), so membership can only shrink on CPU.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import json
import os
import pickle
import signal
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.errors import JaxRuntimeError
from jax.experimental import multihost_utils

from .copies import CopyThreads, aligned_empty
from .faults import MULTI_CONTROLLER, FaultEvent
from .planner import Topology
from .runtime import DeviceFailure
from .shards import ShardStore

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

    @property
    def host(self) -> str:
        return self.coordinator.rpartition(":")[0]


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
        raise RuntimeError("jax.distributed is not initialised; call initialize first")
    return client


def kv_float(client, key: str) -> float | None:
    try:
        return float(client.key_value_try_get(key))
    except JaxRuntimeError:  # NOT_FOUND: the key was never set
        return None


# ---------------------------------------------------------------------------------------------
# The runtime.

_ALIGN = 8  # packed pieces start at multiples of this, so that any dtype views them in place


def _pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    sizes = [(a.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN for a in arrays]
    buf = aligned_empty((sum(sizes),), np.uint8)
    off = 0
    for a, n in zip(arrays, sizes):
        buf[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        off += n
    return buf


def _packed_size(specs: Sequence[tuple]) -> int:
    return sum(
        (int(np.prod(shape)) * np.dtype(dt).itemsize + _ALIGN - 1) // _ALIGN * _ALIGN
        for shape, dt in specs
    )


def _unpack(buf: np.ndarray, specs: Sequence[tuple]) -> list[np.ndarray]:
    out, off = [], 0
    for shape, dt in specs:
        dt = np.dtype(dt)
        n = int(np.prod(shape)) * dt.itemsize
        out.append(buf[off : off + n].view(dt).reshape(shape))
        off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return out


class MultiControllerRuntime:
    """This process's part of a `jax.distributed` job (see the module docstring). A host is a
    process: `topology` groups each process's devices."""

    kind = MULTI_CONTROLLER
    step_sync = True  # every step completes inside its guard, so its metrics are read at once
    failure_simulation = "real: a process of a jax.distributed job died"
    donate = False  # a step a death interrupts must leave its input state readable
    device_failures = False  # a device cannot fail alone: its process goes with it
    host_copies_off_host = True  # a process's host memory dies with it

    def __init__(self, rc: RuntimeConfig):
        self.rc = rc
        self.me = jax.process_index()
        devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.devices = {d.id: d for d in devs}
        per = {p: sum(1 for d in devs if d.process_index == p) for p in range(jax.process_count())}
        if len(set(per.values())) != 1:
            raise RuntimeError(f"processes hold different device counts: {per}")
        self.topology = Topology(tuple(d.id for d in devs), per[self.me])
        self.live: set[int] = set(self.devices)
        self.local = jax.local_devices()
        self.threads = CopyThreads()
        self.client = kv_client()
        self.epoch, self._seq = 0, 0
        self._started = False
        if kv_float(self.client, "elasjax/started") is not None:
            raise RejoinUnsupportedError(
                f"process {self.me} was restarted into a running job: "
                + (REJOIN_UNSUPPORTED if rc.platform == "cpu" else
                   "rejoining is not implemented yet (see docs/multiprocess.md, 'Scale-up')")
            )
        from jax.experimental import transfer

        addr = f"{rc.host}:0"
        self.server = transfer.start_transfer_server(self.local[0].client, addr, [addr])
        self.client.key_value_set(f"elasjax/xfer/{self.me}", self.server.address())
        self._addr: dict[int, str] = {}
        self._conns: dict[int, Any] = {}

    # -- who is where ---------------------------------------------------------------------------

    def process_of(self, device) -> int:
        if isinstance(device, str):  # "host:<h>": a host is a process
            return int(device.split(":")[1])
        return self.devices[device].process_index

    def processes(self) -> set[int]:
        return {self.devices[d].process_index for d in self.live}

    @property
    def writer(self) -> bool:
        return self.me == min(self.processes())

    def log(self, msg: str) -> None:
        print(f"[elasjax p{self.me}] {msg}", flush=True)

    # -- failures -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self, phase: str):
        t_block = time.time()
        try:
            with multihost_utils.live_devices([self.devices[i] for i in sorted(self.live)]):
                yield
        except multihost_utils.ProcessFailureError as e:
            raise self._failure(e, phase, t_block) from e
        if not self._started:  # a process restarted from now on is a rejoin (see __init__)
            self._started = True
            if self.writer:
                self.client.key_value_set("elasjax/started", repr(time.time()), allow_overwrite=True)

    def _failure(self, e, phase: str, t_block: float) -> DeviceFailure:
        t_err = time.time()
        failed = {d.id for d in e.failed_devices}
        procs = sorted({d.process_index for d in e.failed_devices})
        kills = [kv_float(self.client, f"elasjax/kill/{p}") for p in procs]
        kills = [t for t in kills if t is not None]
        k2e = t_err - min(kills) if kills else None
        self.live -= failed
        self.epoch += 1
        self._seq = 0
        for p in procs:
            self._conns.pop(p, None)
        cause = repr(e.__cause__) if e.__cause__ is not None else "failure seen at the block exit"
        self.client.key_value_set(
            f"elasjax/detect/{self.epoch}/{self.me}", json.dumps({"kill_to_error_s": k2e}),
            allow_overwrite=True,
        )
        what = ", ".join(f"process {p} " + ("killed (SIGKILL)" if kills else "failed") for p in procs)
        self.log(
            f"{phase}: ProcessFailureError: {what} (devices {sorted(failed)}); kill -> error "
            + (f"{k2e:.2f}s" if k2e is not None else "n/a") + f"; cause: {cause.splitlines()[0][:160]}"
        )
        return DeviceFailure(
            failed, phase, detect_s=k2e if k2e is not None else t_err - t_block, cause=what,
            detail={
                "failed_processes": procs,
                "kill_to_error_s": k2e,
                "block_to_error_s": t_err - t_block,
                "error_cause": cause.splitlines()[0][:300],
                "incident": self.epoch,
                "collective_timeout_s": self.rc.collective_timeout_s,
                "heartbeat_timeout_s": self.rc.heartbeat_timeout_s,
            },
        )

    def detection_report(self, detail: dict) -> dict:
        """Every survivor's kill -> error time of a failure (`detail` of its event)."""
        if "incident" not in detail:
            return {}
        per = {}
        for p in sorted(self.processes()):
            try:
                v = json.loads(self.client.blocking_key_value_get(
                    f"elasjax/detect/{detail['incident']}/{p}", 5000))
                per[str(p)] = v.get("kill_to_error_s")
            except JaxRuntimeError:  # that process never reported
                continue
        return {"detect_per_process_s": per}

    def inject(self, events: Sequence[FaultEvent], point: str, trees: Sequence[Any] = ()) -> None:
        if point not in ("after_dispatch", "transfer"):
            return
        for e in events:
            if self.me in e.hosts:
                self.client.key_value_set(f"elasjax/kill/{self.me}", repr(time.time()), True)
                self.log(f"sending SIGKILL to myself ({e.spec}, at step {e.at_step}, {point})")
                os.kill(os.getpid(), signal.SIGKILL)

    def capture(self, tree, dead) -> ShardStore:
        return ShardStore.capture(tree, dead)

    def commit(self, tree) -> None:
        jax.block_until_ready([x for x in jax.tree.leaves(tree) if x is not None])

    # -- point-to-point copies ------------------------------------------------------------------

    def _uuid(self, src: int, dst: int) -> int:
        return hash((self.epoch, self._seq, src, dst)) & ((1 << 62) - 1)

    def _conn(self, p: int):
        if p not in self._conns:
            if p not in self._addr:
                self._addr[p] = self.client.blocking_key_value_get(f"elasjax/xfer/{p}", 30_000)
            self._conns[p] = self.server.connect(self._addr[p])
        return self._conns[p]

    def _deadline(self):
        wait = max(30, self.rc.collective_timeout_s)
        return datetime.datetime.now() + datetime.timedelta(seconds=wait)

    def exchange(self, sends: dict[int, list[np.ndarray]], recvs: dict[int, list[tuple]]) -> dict:
        """Send `sends[q]` (host arrays) to process q and receive `recvs[p]` ((shape, dtype)
        each) from process p, one packed buffer per pair. Every process calls it the same
        number of times (it numbers the transfers)."""
        self._seq += 1
        dev = self.local[0]
        for q, arrays in sends.items():
            buf = jax.device_put(_pack(arrays), dev)
            self.server.await_pull(self._uuid(self.me, q), [buf])
        pulled = {}
        for p, specs in recvs.items():
            spec = jax.ShapeDtypeStruct(
                (_packed_size(specs),), np.uint8, sharding=jax.sharding.SingleDeviceSharding(dev)
            )
            pulled[p] = self._conn(p).pull(self._uuid(p, self.me), [spec], self._deadline())[0]
        return {p: _unpack(np.asarray(x), recvs[p]) for p, x in pulled.items()}

    def move(self, items: Sequence[tuple]) -> list:
        """(src device, dst device, array or None, shape, dtype) -> the arrays on the
        destinations this process holds (None elsewhere), device to device."""
        self._seq += 1
        out: list = [None] * len(items)
        sends: dict[int, list] = defaultdict(list)
        recvs: dict[int, list] = defaultdict(list)
        local_put = []
        for i, (src, dst, x, shape, dtype) in enumerate(items):
            sp, dp = self.process_of(src), self.process_of(dst)
            if sp == self.me and dp == self.me:
                local_put.append(i)
            elif sp == self.me:
                sends[dp].append(x)
            elif dp == self.me:
                sh = jax.sharding.SingleDeviceSharding(self.devices[dst])
                recvs[sp].append((i, jax.ShapeDtypeStruct(shape, dtype, sharding=sh)))
        if local_put:
            moved = jax.device_put(
                [items[i][2] for i in local_put], [self.devices[items[i][1]] for i in local_put]
            )
            for i, x in zip(local_put, moved):
                out[i] = x
        for q, arrays in sends.items():
            self.server.await_pull(self._uuid(self.me, q), arrays)
        for p, entries in recvs.items():
            got = self._conn(p).pull(
                self._uuid(p, self.me), [s for _, s in entries], self._deadline()
            )
            for (i, _), x in zip(entries, got):
                out[i] = x
        return out

    def agree(self, value) -> dict[int, Any]:
        """Every live process's `value` (JSON-able), through the key-value store."""
        self._seq += 1
        key = f"elasjax/agree/{self.epoch}/{self._seq}"
        self.client.key_value_set(f"{key}/{self.me}", json.dumps(value), allow_overwrite=True)
        wait_ms = (self.rc.collective_timeout_s + 5) * 1000
        return {
            p: json.loads(self.client.blocking_key_value_get(f"{key}/{p}", wait_ms))
            for p in sorted(self.processes())
        }

    def share(self, value, src: int):
        """Process `src`'s `value` (a small tree of numpy arrays), on every live process."""
        self._seq += 1
        key = f"elasjax/share/{self.epoch}/{self._seq}"
        if self.me == src:
            self.client.key_value_set(key, base64.b64encode(pickle.dumps(value)).decode())
            return value
        wait_ms = (self.rc.collective_timeout_s + 5) * 1000
        return pickle.loads(base64.b64decode(self.client.blocking_key_value_get(key, wait_ms)))

    def close(self) -> None:
        self.threads.close()
