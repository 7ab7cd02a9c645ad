"""Fault schedules, injection and detection (single-process simulation of device loss).

A schedule from config (`{at_step, devices}`, `{at_step, hosts}`, `{at_step, count, seed}`) is
resolved up front against the job's topology into concrete device sets, so every bad input
(unknown device, unknown host, a device failing twice, a schedule that kills every device) is a
`ConfigError` before training starts, naming the fault and the allowed values.

Injection is honest about memory: `inject` records each live leaf's per-device buffers in a
`ShardStore` and then deletes every buffer on the failed devices. The old global arrays become
unusable (JAX refuses to read a deleted array), so recovery can only use what truly survives.
Detection (`detect`) finds the dead devices by probing the buffers, the way a health check would;
with one process this is simulated loss, not a crashed chip, and outputs say so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .config import ConfigError, FaultConfig
from .planner import Topology
from .reshard import ShardStore


@dataclasses.dataclass(frozen=True)
class FaultEvent:
    at_step: int
    device_ids: tuple[int, ...]
    kind: str  # "devices" | "hosts" | "random"
    spec: str  # human-readable origin, e.g. "hosts [1]"


def resolve_schedule(faults: tuple[FaultConfig, ...], topo: Topology, steps: int) -> list[FaultEvent]:
    live = list(topo.device_ids)
    events = []
    for i, f in enumerate(faults):
        key = f"faults[{i}]"
        if f.kill_process >= 0:
            raise ConfigError(
                f"config '{key}.kill_process' needs real processes: run the config with "
                "`elasjax launch --processes P ...`, which kills that process; `elasjax train` "
                "simulates device failures in one process (use 'devices', 'hosts' or 'count')"
            )
        if not 1 <= f.at_step < steps:
            raise ConfigError(
                f"config '{key}.at_step' = {f.at_step} is outside the run; allowed values: "
                f"1 .. {steps - 1}"
            )
        if f.devices:
            for d in f.devices:
                if d not in topo.device_ids:
                    raise ConfigError(
                        f"config '{key}.devices' names device {d}, which does not exist; allowed "
                        f"values: {list(topo.device_ids)}"
                    )
                if d not in live:
                    raise ConfigError(f"config '{key}.devices': device {d} has already failed")
            ids, kind, spec = tuple(f.devices), "devices", f"devices {list(f.devices)}"
        elif f.hosts:
            ids = []
            for h in f.hosts:
                if not 0 <= h < topo.n_hosts:
                    raise ConfigError(
                        f"config '{key}.hosts' names host {h}, which does not exist; allowed "
                        f"values: 0 .. {topo.n_hosts - 1} (parallel.devices_per_host = "
                        f"{topo.devices_per_host})"
                    )
                alive = [d for d in topo.host_devices(h) if d in live]
                if not alive:
                    raise ConfigError(f"config '{key}.hosts': host {h} has no live device left")
                ids += alive
            ids, kind, spec = tuple(ids), "hosts", f"hosts {list(f.hosts)}"
        else:
            if f.count > len(live):
                raise ConfigError(
                    f"config '{key}.count' = {f.count} exceeds the {len(live)} devices alive at "
                    f"step {f.at_step}"
                )
            pick = np.random.default_rng(f.seed).choice(len(live), size=f.count, replace=False)
            ids = tuple(sorted(live[j] for j in pick))
            kind, spec = "random", f"count {f.count} seed {f.seed}"
        live = [d for d in live if d not in ids]
        if not live:
            raise ConfigError(
                f"config 'faults' fails every device by step {f.at_step} ({key}); at least one "
                "device must survive"
            )
        events.append(FaultEvent(f.at_step, ids, kind, spec))
    return events


def inject(state: Any, device_ids: tuple[int, ...]) -> tuple[ShardStore, int]:
    """Fail devices under a live state: returns (what survives, bytes lost); the state itself
    is unusable afterwards."""
    store = ShardStore.capture(state)
    return store, store.fail(device_ids)


def detect(store: ShardStore, expected_live: set[int]) -> set[int]:
    """Devices of the plan with no usable buffer left: probes every recorded buffer."""
    held = {s.device for leaf in store.shards for s in leaf if not s.data.is_deleted()}
    return (expected_live - held) | store.dead_devices()
