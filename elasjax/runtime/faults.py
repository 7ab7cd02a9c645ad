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
the multi-controller runtime a join entry is refused: devices return only with their process,
which rejoins when it is restarted (`elasjax launch --worker-restarts N`, `elasjax.loop.admission`).
Hot spares (`parallel.spares`, `elasjax launch --spares K`) keep a launched job's size with no
restart: processes started with the job, outside the mesh, one of which takes a dead process's
place (`planner.substitute_spares`).

An `mtbf` entry (`config.MtbfConfig`) is a seeded failure-and-repair process for long runs: from
its `at_step` on, every device (or host) fails after an exponential lifetime and returns
`repair_steps` later. It is resolved here, in step order together with the scripted entries and
against the same running live set, into ordinary failure and `join` events (their spec names
the process: `devices [3] (mtbf faults[0])`), so recovery, growth, the run's events and
`compare` are unchanged, and the start event's `faults` list shows what it generated. Rejected
alternative: drawing failures while training, which would make a run depend on its own timing
and could not be checked before it starts. Under `elasjax launch` it is refused (its returns are
joins).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import numpy as np

from ..config import ConfigError, FaultConfig
from ..plan.planner import Topology
from ..transfer.shards import ShardStore

IN_PROCESS = "in-process"
MULTI_CONTROLLER = "multi-controller"
# a fault's `phase` in a recovery (`FaultConfig.phase`): "recovery/<plan|transfer|verify>" strike
# as that guard of `Recoverer._attempt` begins, "recovery/first_step" in the first step after it;
# "recovery" is the short form of "recovery/transfer" (`FaultEvent.phase` holds the long one)
RECOVERY_PHASES = tuple(p for p in typing.get_args(typing.get_type_hints(FaultConfig)["phase"])
                        if p.startswith("recovery"))


@dataclasses.dataclass(frozen=True)
class FaultEvent:
    at_step: int
    device_ids: tuple[int, ...]
    kind: str  # "devices" | "hosts" | "random" | "process" | "join" (devices return) | "stall"
    spec: str  # human-readable origin, e.g. "hosts [1]"
    phase: str = "step"  # "step" | "recovery/<phase>" (`RECOVERY_PHASES`) | "cutover" | "admission"
    hosts: tuple[int, ...] = ()  # the hosts (processes) it takes down whole (or returns)
    stall_process: int = -1  # kind "stall": the process that sleeps `stall_s` (not a failure)
    stall_s: float = 0.0

    @property
    def is_join(self) -> bool:
        return self.kind == "join"


def _resolve_stall(f, key: str, topo: Topology, runtime: str) -> FaultEvent:
    if runtime != MULTI_CONTROLLER:
        raise ConfigError(
            f"config '{key}.stall_process' needs real processes (a straggler among processes): "
            "run the config with `elasjax launch --processes P ...`"
        )
    if not 0 <= f.stall_process < topo.n_hosts:
        raise ConfigError(
            f"config '{key}.stall_process' = {f.stall_process}: process {f.stall_process} does "
            f"not exist; allowed values: 0 .. {topo.n_hosts - 1}"
        )
    if f.phase != "step":
        raise ConfigError(
            f"config '{key}.phase' = '{f.phase}' with 'stall_process': a process stalls before "
            "it dispatches a step; allowed values: 'step'"
        )
    return FaultEvent(
        f.at_step, (), "stall", f"process {f.stall_process} stalls {f.stall_s:g}s",
        stall_process=f.stall_process, stall_s=f.stall_s,
    )


def resolve_schedule(
    faults: tuple[FaultConfig, ...], topo: Topology, steps: int, runtime: str = IN_PROCESS,
    restarts: int = 0,
) -> list[FaultEvent]:
    """Concrete events in order; `runtime` is the kind of runtime that will inject them.
    `restarts` (`recovery.worker_restarts`, launch only): the first that many processes killed
    are started again and rejoin (`elasjax launch` restarts each death while its budget lasts),
    so a later kill may name them again (their new incarnation; one due before it rejoined finds
    nobody to kill and does nothing); only a step that kills every live process at once is
    refused then."""
    live = list(topo.device_ids)
    restarts_left = [restarts if runtime == MULTI_CONTROLLER else 0]
    events: list[FaultEvent] = []
    procs: list[_MtbfProcess] = []
    cursor = [0, False]  # the first step whose process events are not all out; its joins out?
    taken: dict[int, str] = {}  # device -> which process failed it, at which step (messages)

    def run_processes(until: int, joins_too: bool) -> None:
        """Emit the processes' events of the steps before `until` (and their joins at `until`)."""
        nonlocal live
        while cursor[0] < until or (joins_too and cursor[0] == until and not cursor[1]):
            s = cursor[0]
            if not cursor[1]:
                for pr in procs:
                    ev = pr.returns(s, live)
                    if ev is not None:
                        live = [d for d in topo.device_ids if d in live or d in ev.device_ids]
                        events.append(ev)
                        for d in ev.device_ids:
                            taken.pop(d, None)
                cursor[1] = True
            if s == until:
                break
            for pr in procs:
                ev = pr.failures(s, live)
                if ev is not None:
                    live = [d for d in live if d not in ev.device_ids]
                    events.append(ev)
                    taken.update({d: f"{pr.name} failed it at step {s}" for d in ev.device_ids})
            cursor[0], cursor[1] = s + 1, False

    for i, f in enumerate(faults):
        key = f"faults[{i}]"
        if not 0 <= f.at_step < steps:
            raise ConfigError(
                f"config '{key}.at_step' = {f.at_step} is outside the run; allowed values: "
                f"0 .. {steps - 1}"
            )
        if f.mtbf is not None:
            if runtime == MULTI_CONTROLLER:
                raise ConfigError(
                    f"config '{key}.mtbf' is not available under `elasjax launch`: the process "
                    "returns repaired units as joins, and joins do not run there yet "
                    "(docs/multiprocess.md); allowed there: scripted failures ('hosts', "
                    "'kill_process'); run 'mtbf' with `elasjax train` (one process)"
                )
            run_processes(f.at_step, joins_too=False)
            procs.append(_MtbfProcess(key, f, topo, steps))
            continue
        run_processes(f.at_step, joins_too=True)
        if f.join is not None:
            ev = _resolve_join(f, key, topo, live, events, runtime)
            live = [d for d in topo.device_ids if d in live or d in ev.device_ids]
            events.append(ev)
            for d in ev.device_ids:
                taken.pop(d, None)
            continue
        if f.stall_process >= 0:
            events.append(_resolve_stall(f, key, topo, runtime))
            continue
        ids, kind, spec, hosts = _resolve_targets(f, key, topo, live, taken, runtime)
        _check_phase(f, key, events, runtime, restarts)
        restarted = kind == "process" and 0 < len(hosts) <= restarts_left[0]
        if restarted:  # started again: its devices return (`elasjax.loop.admission`)
            restarts_left[0] -= len(hosts)
            down = {d for e in events if e.at_step == f.at_step and e.kind == "process"
                    for d in e.device_ids} | set(ids)
            if set(live) <= down:
                raise ConfigError(
                    f"config 'faults' kills every live process at step {f.at_step} ({key}); at "
                    "least one must survive each step (a restarted process rejoins later)")
        else:
            live = [d for d in live if d not in ids]
        if not live:
            raise ConfigError(
                f"config 'faults' fails every device by step {f.at_step} ({key}); at least one "
                "device must survive"
            )
        phase = "recovery/transfer" if f.phase == "recovery" else f.phase
        events.append(FaultEvent(f.at_step, ids, kind, spec + (
            f" (during the {phase})" if phase.startswith("recovery/") else
            " (at the cut-over)" if phase == "cutover" else
            " (during an admission)" if phase == "admission" else ""), phase, hosts))
    run_processes(steps, joins_too=False)
    for pr in procs:
        pr.annotate(events)
    return events


def _resolve_targets(f: FaultConfig, key: str, topo: Topology, live: list[int],
                     taken: dict[int, str], runtime: str
                     ) -> tuple[tuple[int, ...], str, str, tuple[int, ...]]:
    """(devices, kind, spec, hosts) of the scripted failure `f` (`faults[i]`, `key`) among the
    `live` devices at its step; `taken`: which earlier failure took each dead device (for the
    message when `f` names one again)."""
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
                raise ConfigError(
                    f"config '{key}.devices': device {d} has already failed"
                    + (f" (the {taken[d]})" if d in taken else "")
                )
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
                by = sorted({taken[d] for d in topo.host_devices(h) if d in taken})
                raise ConfigError(
                    f"config '{key}.{what}': {'process' if f.kill_process >= 0 else 'host'} "
                    f"{h} has already failed" + (f" (the {'; the '.join(by)})" if by else "")
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
    return ids, kind, spec, hosts


def _check_phase(f: FaultConfig, key: str, events: list[FaultEvent], runtime: str,
                 restarts: int) -> None:
    """`f.phase` is possible: a cut-over's only in one process; a recovery's only after a step's
    failure at the same step (`events`: those before `f`); an admission's only under launch,
    with restarts, after a process killed at or before its step."""
    if f.phase == "admission" and (runtime != MULTI_CONTROLLER or not restarts or not any(
            e.kind == "process" and e.at_step <= f.at_step for e in events)):
        raise ConfigError(
            f"config '{key}.phase' = 'admission' needs a restarted process to admit: run it "
            "with `elasjax launch`, `recovery.worker_restarts` (--worker-restarts) > 0 and a "
            f"process killed at or before step {f.at_step} earlier in 'faults'")
    if f.phase == "cutover" and runtime == MULTI_CONTROLLER:
        raise ConfigError(
            f"config '{key}.phase' = 'cutover' is not available under `elasjax launch` (a "
            "process is killed at a step, not at an event); allowed values: 'step', "
            + ", ".join(repr(p) for p in RECOVERY_PHASES)
        )
    if f.phase.startswith("recovery") and not any(
        e.at_step == f.at_step and e.phase == "step" and not e.is_join for e in events
    ):
        raise ConfigError(
            f"config '{key}.phase' = '{f.phase}' needs a failure with phase 'step' at the same "
            f"step ({f.at_step}) before it in 'faults': that failure starts the recovery this "
            "one interrupts"
        )


class _MtbfProcess:
    """One `mtbf` entry's units, their clocks and repairs (see `config.MtbfConfig`).

    A unit's clock is the step at which it next fails, drawn when the unit is first seen up
    (at the entry's start, after a return, or after a skipped failure) from the unit's own
    stream `default_rng([seed, unit is a host, unit])`: the draws of one unit never depend on the others."""

    def __init__(self, key: str, f: FaultConfig, topo: Topology, steps: int):
        m = f.mtbf
        self.key, self.m, self.topo, self.steps = key, m, topo, steps
        self.name = f"mtbf process of {key}"
        self.start = f.at_step
        self.stop = steps - 1 if m.stop is None else m.stop
        self.host = m.unit == "host"
        self.units = (list(range(topo.n_hosts)) if self.host else list(topo.device_ids))
        if m.min_live >= len(self.units):
            raise ConfigError(
                f"config '{key}.mtbf.min_live' = {m.min_live} leaves no {m.unit} to fail: the "
                f"job has {len(self.units)} {m.unit}s; allowed values: 1 .. "
                f"{len(self.units) - 1}"
            )
        self.rngs = {u: np.random.default_rng([m.seed, int(self.host), u]) for u in self.units}
        self.clock: dict[int, int | None] = {u: None for u in self.units}
        self.repairs: dict[int, tuple[int, tuple[int, ...]]] = {}  # unit -> (return step, devices)
        self.skipped: list[tuple[int, int]] = []  # (step, unit) failures not done (min_live)
        self.specs: list[str] = []  # the specs of this process's events

    def _devices(self, u: int) -> tuple[int, ...]:
        return tuple(self.topo.host_devices(u)) if self.host else (u,)

    def _draw(self, u: int, origin: int) -> int:
        """The step of the next failure of a unit up from the boundary before `origin`."""
        life = self.rngs[u].exponential(self.m.mtbf_steps)
        return origin + max(1, int(np.ceil(life)))

    def _what(self, units: list[int]) -> str:
        return f"{'hosts' if self.host else 'devices'} {units}"

    def returns(self, s: int, live: list[int]) -> FaultEvent | None:
        """The units this process failed that are back at step `s` (a join), if any."""
        back, ids = [], []
        for u in sorted(self.repairs):
            due, devs = self.repairs[u]
            if due != s:
                continue
            del self.repairs[u]
            down = [d for d in devs if d not in live]  # a scripted join may have returned some
            if down:
                back.append(u)
                ids += down
        if not back:
            return None
        spec = f"join {self._what(back)} (mtbf {self.key}, repaired after {self.m.repair_steps} steps)"
        self.specs.append(spec)
        return FaultEvent(s, tuple(ids), "join", spec, hosts=tuple(back) if self.host else ())

    def failures(self, s: int, live: list[int]) -> FaultEvent | None:
        """The units whose lifetimes end at step `s` (one failure event), if any."""
        if s < self.start:
            return None
        up = [u for u in self.units if any(d in live for d in self._devices(u))]
        for u in self.units:  # scripted failures stop clocks; scripted (and own) returns start them
            if u not in up:
                self.clock[u] = None
                continue
            self.repairs.pop(u, None)  # up again (a scripted join): nothing left to repair
            if self.clock[u] is None:
                self.clock[u] = self._draw(u, s)
        if s > self.stop:
            return None
        n_up, failed, ids = len(up), [], []
        for u in up:
            if self.clock[u] != s:
                continue
            if n_up - 1 < self.m.min_live:
                self.skipped.append((s, u))
                self.clock[u] = self._draw(u, s)
                continue
            n_up -= 1
            failed.append(u)
            devs = tuple(d for d in self._devices(u) if d in live)
            ids += devs
            self.clock[u] = None
            if self.m.repair_steps is not None and s + self.m.repair_steps < self.steps:
                self.repairs[u] = (s + self.m.repair_steps, devs)
        if not failed:
            return None
        spec = f"{self._what(failed)} (mtbf {self.key})"
        self.specs.append(spec)
        return FaultEvent(s, tuple(ids), "hosts" if self.host else "devices", spec,
                          hosts=tuple(failed) if self.host else ())

    def annotate(self, events: list[FaultEvent]) -> None:
        """Note the skipped failures in the spec of the process's last event at or before each
        (else its first event), where the run's start event and logs show them."""
        mine = [j for j, e in enumerate(events) if e.spec in self.specs]
        for s, u in self.skipped:
            if not mine:
                return
            before = [j for j in mine if events[j].at_step <= s]
            j = before[-1] if before else mine[0]
            e = events[j]
            note = (f"; kept {self.m.unit} {u} up at step {s}: failing it would leave fewer "
                    f"than mtbf.min_live = {self.m.min_live}")
            events[j] = dataclasses.replace(e, spec=e.spec + note)
            self.specs.append(events[j].spec)


def _resolve_join(
    f: FaultConfig, key: str, topo: Topology, live: list[int], events: list[FaultEvent],
    runtime: str,
) -> FaultEvent:
    """The devices a `join` entry returns, checked against the devices live before it."""
    if runtime == MULTI_CONTROLLER:
        raise ConfigError(
            f"config '{key}.join' is not available under `elasjax launch`: devices return with "
            "their process, which rejoins when restarted (--worker-restarts N); hot spares "
            "(--spares K) keep the job's size; or run joins with `elasjax train` (one process)"
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
