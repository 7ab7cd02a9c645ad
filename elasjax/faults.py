"""The fault schedule: one list of scripted failures (and returns) for both runtimes.

A schedule from config (`{at_step, devices | hosts | count + seed | kill_process, phase}`; `elasjax
launch --kill STEP:PROCESS` adds `{at_step, kill_process}` entries to the same list) is resolved
up front against the job's topology into concrete device sets, so every bad input (an unknown
device, host or process, a device failing twice, a schedule that kills every device, a kind of
failure the runtime cannot produce) is a `ConfigError` before training starts (under `launch`,
before any process starts), naming the fault and the allowed values.

What a failure *is* depends on the runtime (`elasjax.runtime`): in one process the injector
deletes every buffer on the failed devices (`inject`: recovery can only use what truly survives);
under the multi-controller runtime a host is a process, and the targeted process sends itself
SIGKILL. Device-level failures (`devices`, `count`) have no meaning there: one cannot kill a device
of a live process.

A `join` entry returns devices that failed earlier (repaired ones) at a step boundary. It is
resolved against the same running set of live devices: joining a live device, a device or host
that is not part of the job, or more devices than the job started with is a `ConfigError`. Under
the multi-controller runtime a join is refused: a restarted process cannot rejoin on CPU/gloo
(docs/multiprocess.md). What keeps a launched job's size there is hot spares (`parallel.spares`,
`elasjax launch --spares K`): processes started with the job, outside the mesh, one of which takes
a dead process's place (`planner.substitute_spares`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .config import ConfigError, FaultConfig
from .planner import Topology
from .shards import ShardStore

IN_PROCESS = "in-process"
MULTI_CONTROLLER = "multi-controller"


@dataclasses.dataclass(frozen=True)
class FaultEvent:
    at_step: int
    device_ids: tuple[int, ...]
    kind: str  # "devices" | "hosts" | "random" | "process" | "join" (devices return)
    spec: str  # human-readable origin, e.g. "hosts [1]"
    phase: str = "step"  # "step" | "recovery" | "cutover"
    hosts: tuple[int, ...] = ()  # the hosts (processes) it takes down whole (or returns)

    @property
    def is_join(self) -> bool:
        return self.kind == "join"


def resolve_schedule(
    faults: tuple[FaultConfig, ...], topo: Topology, steps: int, runtime: str = IN_PROCESS
) -> list[FaultEvent]:
    """Concrete events in order; `runtime` is the kind of runtime that will inject them."""
    live = list(topo.device_ids)
    events: list[FaultEvent] = []
    for i, f in enumerate(faults):
        key = f"faults[{i}]"
        if not 0 <= f.at_step < steps:
            raise ConfigError(
                f"config '{key}.at_step' = {f.at_step} is outside the run; allowed values: "
                f"0 .. {steps - 1}"
            )
        if f.join is not None:
            ev = _resolve_join(f, key, topo, live, events, runtime)
            live = [d for d in topo.device_ids if d in live or d in ev.device_ids]
            events.append(ev)
            continue
        hosts: tuple[int, ...] = ()
        if runtime == MULTI_CONTROLLER and (f.devices or f.count):
            raise ConfigError(
                f"config '{key}' fails {'devices' if f.devices else 'random devices'}; under "
                "`elasjax launch` a failure is a process (a host): use 'kill_process' (or "
                "--kill STEP:PROCESS) or 'hosts'"
            )
        if f.kill_process >= 0:
            if runtime != MULTI_CONTROLLER:
                raise ConfigError(
                    f"config '{key}.kill_process' needs real processes: run the config with "
                    "`elasjax launch --processes P ...`, which kills that process; `elasjax "
                    "train` simulates device failures in one process (use 'devices', 'hosts' or "
                    "'count')"
                )
            if not 0 <= f.kill_process < topo.n_hosts:
                raise ConfigError(
                    f"config '{key}.kill_process' = {f.kill_process}: process {f.kill_process} "
                    f"does not exist; allowed values: 0 .. {topo.n_hosts - 1}"
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
        elif f.hosts or f.kill_process >= 0:
            hosts = tuple(f.hosts) if f.hosts else (f.kill_process,)
            what = "hosts" if f.hosts else "kill_process"
            ids = []
            for h in hosts:
                if not 0 <= h < topo.n_hosts:
                    raise ConfigError(
                        f"config '{key}.hosts' names host {h}, which does not exist; allowed "
                        f"values: 0 .. {topo.n_hosts - 1} (parallel.devices_per_host = "
                        f"{topo.devices_per_host})"
                    )
                alive = [d for d in topo.host_devices(h) if d in live]
                if not alive:
                    raise ConfigError(
                        f"config '{key}.{what}': {'process' if f.kill_process >= 0 else 'host'} "
                        f"{h} has already failed"
                    )
                ids += alive
            if runtime == MULTI_CONTROLLER:
                kind, spec = "process", ", ".join(f"process {h}" for h in hosts)
            else:
                kind, spec = "hosts", f"hosts {list(hosts)}"
            ids = tuple(ids)
        else:
            if f.count > len(live):
                raise ConfigError(
                    f"config '{key}.count' = {f.count} exceeds the {len(live)} devices alive at "
                    f"step {f.at_step}"
                )
            pick = np.random.default_rng(f.seed).choice(len(live), size=f.count, replace=False)
            ids = tuple(sorted(live[j] for j in pick))
            kind, spec = "random", f"count {f.count} seed {f.seed}"
        if f.phase == "cutover" and runtime == MULTI_CONTROLLER:
            raise ConfigError(
                f"config '{key}.phase' = 'cutover' is not available under `elasjax launch` (a "
                "process is killed at a step, not at an event); allowed values: 'step', 'recovery'"
            )
        if f.phase == "recovery" and not any(
            e.at_step == f.at_step and e.phase == "step" and not e.is_join for e in events
        ):
            raise ConfigError(
                f"config '{key}.phase' = 'recovery' needs a failure with phase 'step' at the same "
                f"step ({f.at_step}) before it in 'faults': that failure starts the recovery this "
                "one interrupts"
            )
        live = [d for d in live if d not in ids]
        if not live:
            raise ConfigError(
                f"config 'faults' fails every device by step {f.at_step} ({key}); at least one "
                "device must survive"
            )
        events.append(FaultEvent(f.at_step, ids, kind, spec + (
            {"recovery": " (during recovery)", "cutover": " (at the cut-over)"}.get(f.phase, "")),
            f.phase, hosts))
    return events


def _resolve_join(
    f: FaultConfig, key: str, topo: Topology, live: list[int], events: list[FaultEvent],
    runtime: str,
) -> FaultEvent:
    """The devices a `join` entry returns, checked against the devices live before it."""
    if runtime == MULTI_CONTROLLER:
        raise ConfigError(
            f"config '{key}.join' is not available under `elasjax launch`: a restarted process "
            "cannot rejoin on CPU/gloo (docs/multiprocess.md); to keep the job's size start hot "
            "spares with it (--spares K), or run joins with `elasjax train` (one process)"
        )
    if any(e.at_step == f.at_step and not e.is_join for e in events):
        raise ConfigError(
            f"config '{key}' (a join at step {f.at_step}) must come before the failures of "
            f"step {f.at_step} in 'faults': devices return at the boundary before the step"
        )
    down = [d for d in topo.device_ids if d not in live]
    allowed = f"the job's devices that are down at step {f.at_step}: {down}" if down else (
        f"none: every device of the job is live at step {f.at_step}")
    n = len(topo.device_ids)
    if f.join.devices:
        ids = f.join.devices
        if len(set(ids)) != len(ids):
            raise ConfigError(f"config '{key}.join.devices' = {list(ids)} names a device twice")
        for d in ids:
            if d in live:
                raise ConfigError(
                    f"config '{key}.join.devices' names device {d}, which is live at step "
                    f"{f.at_step}; allowed values: {allowed}"
                )
        if len(live) + len(ids) > n:
            raise ConfigError(
                f"config '{key}.join.devices' = {list(ids)} would bring the job to "
                f"{len(live) + len(ids)} devices at step {f.at_step}, more than the {n} it started "
                f"with ({len(live)} are live); allowed values: {allowed}"
            )
        for d in ids:
            if d not in topo.device_ids:
                raise ConfigError(
                    f"config '{key}.join.devices' names device {d}, which was never part of the "
                    f"job (devices {list(topo.device_ids)}); allowed values: {allowed}"
                )
        return FaultEvent(f.at_step, tuple(ids), "join", f"join devices {list(ids)}")
    hosts = f.join.hosts
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"config '{key}.join.hosts' = {list(hosts)} names a host twice")
    down_hosts = [h for h in range(topo.n_hosts) if set(topo.host_devices(h)) - set(live)]
    ids = []
    for h in hosts:
        if not 0 <= h < topo.n_hosts:
            raise ConfigError(
                f"config '{key}.join.hosts' names host {h}, which was never part of the job; "
                f"allowed values: the hosts with a device down at step {f.at_step}: {down_hosts} "
                f"(hosts 0 .. {topo.n_hosts - 1}, parallel.devices_per_host = "
                f"{topo.devices_per_host})"
            )
        back = [d for d in topo.host_devices(h) if d not in live]
        if not back:
            raise ConfigError(
                f"config '{key}.join.hosts' names host {h}, whose devices "
                f"{list(topo.host_devices(h))} are all live at step {f.at_step}; allowed values: "
                f"the hosts with a device down then: {down_hosts}"
            )
        ids += back
    return FaultEvent(f.at_step, tuple(ids), "join", f"join hosts {list(hosts)}", hosts=tuple(hosts))


def inject(state: Any, device_ids: tuple[int, ...]) -> tuple[ShardStore, int]:
    """Fail devices under a live state (one process): returns (what survives, bytes lost); the
    state itself is unusable afterwards."""
    store = ShardStore.capture(state)
    return store, store.fail(device_ids)
