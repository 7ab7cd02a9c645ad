"""Where a job runs: the runtime object the trainer is given (ARCHITECTURE.md, section 4).

There is one training loop and one recovery path (`elasjax.loop.trainer`). What differs between one
process with fake devices and a real multi-host job is this object:

| concern | `InProcessRuntime` | `multicontroller.MultiControllerRuntime` |
|---|---|---|
| devices | this process's devices | `jax.devices()` of every `jax.distributed` process |
| a host | `devices_per_host` consecutive devices | a process |
| a failure | `inject` deletes the failed devices' buffers | the targeted process SIGKILLs itself |
| detection | the injector reports it (simulated) | heartbeats in the key-value store, the lowest live process arbitrates each guard's barriers |
| cross-process copies | none | point-to-point pulls (`exchange`, `move`) |
| agreement | trivial | the coordination service's key-value store |
| outputs | this process | the lowest live process |

The interface both implement, with the capabilities each declares, is `base.Runtime`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from ..config import Config, ConfigError
from ..plan.planner import Topology
from ..transfer.copies import CopyThreads
from ..transfer.shards import ShardStore
from .dispatch import require_sync_cpu_dispatch
from .faults import IN_PROCESS, FaultEvent


@dataclasses.dataclass(frozen=True)
class FailureReport:
    """What a runtime knows of a failure's cause beyond its devices (`DeviceFailure.report`): in
    one process, the bytes the simulated failure deleted; under `launch`, who died, how the
    death was detected, and the timings (docs/launch-internals.md, "Detecting a death"). The recovery event
    carries the fields that are known, flat (`as_dict`)."""

    failed_processes: tuple[int, ...] = ()
    bytes_lost: int = 0
    detector: str | None = None  # "process exit", "death notice", "heartbeat", ...
    detected_by: str | None = None  # the detector's account, in words
    kill_to_detect_s: float | None = None  # from the kill (posted by the victim) to the verdict
    kill_to_silent_s: float | None = None
    # from the kill to this process's exit watch seeing it (a same-host victim's pidfd)
    kill_to_exit_s: float | None = None
    kill_to_error_s: float | None = None
    block_to_error_s: float | None = None
    # from the end of the entry barrier: how long the block's collectives could wait
    body_to_error_s: float | None = None
    block_to_detect_s: float | None = None
    error_cause: str | None = None
    # this process's block raised: its collectives were cut off (`collectives.renewal_reason`)
    interrupted: str | None = None
    renew: str | None = None  # a block retried on fresh collectives, no process dead: why
    drain_s: float | None = None  # the wait for the interrupted block's programs
    incident: int | None = None  # the runtime's failure count (`detection_report`)
    collective_timeout_s: float | None = None
    liveness_timeout_s: float | None = None
    heartbeat_timeout_s: float | None = None

    def as_dict(self) -> dict:
        """The known fields (None left out), for the event."""
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items() if v is not None}


class DeviceFailure(Exception):
    """Devices were lost. Every live process raises it with the same `devices` (the runtime
    agrees on them); `detect_s` is how long the runtime took to know, `report` what it knows
    of the cause (`FailureReport`: killed processes, timings)."""

    def __init__(
        self, devices: Iterable[int], phase: str, *, detect_s: float = 0.0,
        cause: str = "", report: FailureReport | None = None,
    ):
        self.devices = frozenset(devices)
        self.phase, self.detect_s, self.cause = phase, detect_s, cause
        self.report = report if report is not None else FailureReport()
        self.t_known = time.perf_counter()
        super().__init__(f"devices {sorted(self.devices)} failed during {phase}")


def read_replicated(x: jax.Array, live: Iterable[int]) -> np.ndarray:
    """A replicated array's value, read from a shard on a live device of this process (never
    from a failed device's memory)."""
    live = set(live)
    shards = x.addressable_shards
    if x.is_fully_addressable and x.is_fully_replicated and shards and shards[0].device.id in live:
        # reads the first shard, through the host copy `copy_to_host_async` made, if requested
        return np.asarray(x)
    for s in shards:
        if s.device.id in live:
            return np.asarray(s.data)
    raise RuntimeError("no live device of this process holds a copy of the value")


def host_values(rt, tree, devices: Iterable[int]):
    """The values of a tree of arrays replicated over `devices` (a plan's), on every live
    process: read locally, and handed to the processes holding none of `devices` by the lowest
    one that does (`rt.share`; only while some process is outside the plan)."""
    devices = sorted(devices)
    holders = sorted({rt.process_of(d) for d in devices})
    value = None
    if rt.me in holders:
        value = jax.tree.map(lambda x: read_replicated(x, devices), tree)
    if (rt.processes() or {rt.me}) - set(holders):
        value = rt.share(value, holders[0])
    return value


def job_devices(cfg: Config) -> list[jax.Device]:
    """The job's devices: `parallel.devices` to train on, then `parallel.spares` hot spare hosts
    on top (the last ones: `planner.held_spares`)."""
    avail = jax.devices()
    held = cfg.parallel.spares * cfg.parallel.devices_per_host
    n = len(avail) if cfg.parallel.devices == -1 else cfg.parallel.devices + held
    if n > len(avail) or n - held < 1:
        spares = f" plus {held} for parallel.spares = {cfg.parallel.spares}" if held else ""
        raise ConfigError(
            f"config 'parallel.devices' = {cfg.parallel.devices}{spares} but only {len(avail)} "
            f"devices are visible; allowed values: -1, 1 .. {len(avail) - held} (for fake CPU "
            f"devices set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)"
        )
    return avail[:n]


class InProcessRuntime:
    """One process owns every device; failures are simulated by deleting buffers.

    A scheduled failure deletes every buffer this process holds on the failed devices (the
    state's and the snapshot pool's) and is reported at once, before anything could run on the
    lost buffers: detection here is simulated, and every recovery event says so."""

    kind = IN_PROCESS
    step_sync = False  # the loop may read a step's metrics a few steps late
    failure_simulation = "simulated (single process): the failed devices' buffers were deleted"
    donate = True
    device_failures = True
    host_copies_off_host = False
    devices_return = True  # a fault schedule's `join`
    rejoins = False  # one process: nothing restarts
    shares_compiles = False  # one process: nobody to share with
    client = None
    me = 0
    writer = True
    admission = None

    def __init__(self, cfg: Config | None = None, *, topology: Topology | None = None):
        # before the first device is used: "set", "already" or "too late" (`runtime.dispatch`)
        self.cpu_dispatch = require_sync_cpu_dispatch("InProcessRuntime")
        if topology is None:
            devs = job_devices(cfg)
            topology = Topology(tuple(d.id for d in devs), cfg.parallel.devices_per_host)
        table = {d.id: d for d in jax.devices()}
        self.devices = {i: table[i] for i in topology.device_ids}
        self.topology = topology
        self.live: set[int] = set(self.devices)
        self.threads = CopyThreads()
        self._survivors: dict[int, tuple] = {}  # id(tree) -> (tree, what `inject` left of it)

    def process_of(self, device) -> int:
        return 0

    def peer_gone(self, p: int) -> bool:
        return False

    def processes(self) -> set[int] | None:
        """The live processes, for collective I/O (None: this process alone)."""
        return None

    def log(self, msg: str) -> None:
        pass  # the progress bar prints here

    def detection_report(self, incident: int | None) -> dict:
        return {}

    @contextlib.contextmanager
    def guard(self, phase: str):
        yield

    def inject(self, events: Sequence[FaultEvent], point: str, trees: Sequence[Any] = ()) -> None:
        if point not in ("before_step", "plan", "transfer", "verify") or not events:
            return
        t0 = time.perf_counter()
        ids = {d for e in events for d in e.device_ids}
        lost = 0
        self._survivors.clear()
        for tree in trees:
            if isinstance(tree, ShardStore):
                lost += tree.fail(ids)
                continue
            # a global array with one deleted buffer can no longer be read at all: keep what
            # survives of it for `capture`
            store = ShardStore.capture(tree, set(self.devices) - self.live)
            lost += store.fail(ids)
            self._survivors[id(tree)] = (tree, store)  # the tree is kept: its id stays unique
        self.live -= ids
        raise DeviceFailure(
            ids, point, detect_s=time.perf_counter() - t0,
            cause="; ".join(e.spec for e in events), report=FailureReport(bytes_lost=lost),
        )

    def join(self, device_ids: Iterable[int]) -> None:
        """Devices return (repaired): live again, holding nothing."""
        ids = set(device_ids)
        if not ids <= set(self.devices):
            raise ValueError(f"devices {sorted(ids - set(self.devices))} are not the job's")
        self.live |= ids

    def joiners(self) -> list[int]:
        return []

    def admit(self, package):
        raise AssertionError("a single process has no restarted processes to admit")

    def capture(self, tree, dead: Iterable[int]) -> ShardStore:
        """Every live shard of `tree` (its surviving buffers, if a failure was injected under it)."""
        kept = self._survivors.get(id(tree))
        self._survivors.clear()
        if kept is not None and kept[0] is tree:
            return kept[1].without(dead)
        return ShardStore.capture(tree, dead)

    def commit(self, tree) -> None:
        pass  # nothing fails mid-step here: dispatch stays asynchronous

    def exchange(self, sends: dict, recvs: dict) -> dict:
        if sends or recvs:
            raise AssertionError("a single process has no peers to exchange with")
        return {}

    def move(self, items: Sequence[tuple]) -> list:
        """(src device, dst device, array, shape, dtype) -> the arrays on their destinations."""
        if not items:
            return []
        return jax.device_put([x for _, _, x, _, _ in items], [self.devices[d] for _, d, *_ in items])

    def agree(self, value) -> dict[int, Any]:
        return {0: value}

    def renew_collectives(self, failure: DeviceFailure) -> None:
        return None  # one client, no communicator a dead peer could have broken

    def current(self, x):
        return x

    def share(self, value, src: int):
        return value

    def close(self) -> None:
        self.threads.close()
