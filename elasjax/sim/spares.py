"""Growing back in goodput: shrink only, rejoin, or hot spares. SIMULATED.

One elastic strategy (default: ElasWave-style without DVFS, so 1.0 is the failure-free plan) is
replayed against one failure trace under three policies for the devices that come back:

- **shrink**: repaired devices never return to the job; it only ever shrinks (failures of a
  device already out of the job cost nothing).
- **rejoin**: a repaired device returns to its place and the job grows back after the
  strategy's `grow_s` stall (what `timeline.simulate` models; the two agree, see the tests).
- **spares**: K hot-spare hosts are held idle beside the job. A failure takes its whole host out
  of the job and a spare host takes its place after `swap_s` (detection, joining the
  communicator, copying that host's share of the state from a data-parallel peer): the plan keeps
  its size. A host whose failed devices are repaired refills the pool. When the pool is empty the
  job shrinks like `rejoin` (its repaired devices return to their places), and a host that
  refills the pool while the job is short is swapped in at once (`grow_s`).

The trace is drawn over the job's hosts *and* the K spare hosts (device ids `n ..` are the
spares), and every policy replays the same trace: the job's devices fail at the same times under
all three (common random numbers); under shrink and rejoin the spare hosts do not exist and
their events are ignored. Assumptions, stated: idle spares fail at the rate of working devices;
replacement is per host (a node is swapped whole, its healthy devices leave with it); a swap of a
spare that is not running the job's executable yet is not modelled (hot spares: started with the
job, as in docs/multiprocess.md).

Accounting: goodput per *active* device is the surviving progress over the failure-free job's
(the job's `n` device slots); goodput per *total* device divides by all devices paid for,
`n + K * devices_per_host`, so idle spares cost `K * devices_per_host / (n + ...)` of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from .scenario import Outcome, Scenario
from .strategies import STRATEGIES
from .timeline import _discard, bin_progress, in_flight_s, resume_after
from .traces import TraceEvent

Policy = Literal["shrink", "rejoin", "spares"]
POLICIES: tuple[str, ...] = ("shrink", "rejoin", "spares")
STATE_BYTES_PER_PARAM = 16  # bf16 weights + grads, fp32 master + Adam moments (no ZeRO)


@dataclasses.dataclass(frozen=True)
class PolicyTimeline:
    """Goodput of one policy over a trace (fractions of the failure-free job's tokens/s)."""

    policy: str
    strategy: str
    spare_hosts: int
    active_devices: int  # the job's device slots
    total_devices: int  # active + spare devices: what is paid for
    bin_edges_h: tuple[float, ...]
    goodput: tuple[float, ...]  # per bin, per active device
    mean_goodput: float  # per active device
    goodput_per_total_device: float
    mean_filled: float  # time-average share of the job's slots holding a working device
    downtime_s: float
    lost_work_s: float
    transitions: int
    swaps: int  # spare hosts swapped in
    fallbacks: int  # failures that found the pool empty and shrank the job


def swap_seconds(sc: Scenario) -> float:
    """A hot spare's stall: detection, the in-place communicator edit, planning, and the copy
    of one host's share of the state (16 B/param over stage x tensor devices) from a peer at the
    inter-host bandwidth."""
    rc, lay = sc.recovery, sc.layout
    host_bytes = (lay.devices_per_host * STATE_BYTES_PER_PARAM * sc.dims.n_params
                  / (lay.stage * lay.tensor))
    return rc.detect_s + rc.comm_edit_s + rc.plan_s + host_bytes / sc.device.inter_host_bw


def spare_hosts_for(sc: Scenario, fraction: float) -> int:
    """K = `fraction` of the job's hosts, rounded up (at least 1 when fraction > 0)."""
    hosts = -(-sc.layout.n_devices // sc.layout.devices_per_host)
    return int(np.ceil(fraction * hosts)) if fraction > 0 else 0


class _Fleet:
    """The hosts under a policy: which physical host holds each of the job's places
    (`host_at`, `place`), the idle spare hosts (`pool`), the hosts out for repair (`out`), which
    devices work (`alive`), and the job's device slots without a working device (`down`)."""

    def __init__(self, policy: str, groups: int, dph: int, spare_hosts: int):
        self.policy, self.dph = policy, dph
        self.host_at = list(range(groups))  # slot group (a host's place in the job) -> host
        self.place = {h: g for g, h in enumerate(self.host_at)}  # host in the job -> its place
        self.pool = list(range(groups, groups + (spare_hosts if policy == "spares" else 0)))
        self.out: set[int] = set()  # physical hosts out of the job, waiting for their repair
        self.alive = np.ones((groups + max(spare_hosts, 0)) * dph, dtype=bool)
        self.down: set[int] = set()  # the job's slots without a working device
        self.swaps = 0  # spare hosts swapped in

    def slot(self, d: int) -> int:
        return self.place[d // self.dph] * self.dph + d % self.dph

    def swap_in(self, g: int) -> None:
        """A pool host takes place `g`; the host there leaves for repair."""
        dph, old = self.dph, self.host_at[g]
        del self.place[old]
        if not self.alive[old * dph:(old + 1) * dph].all():
            self.out.add(old)
        elif self.policy == "spares":
            self.pool.append(old)
        new = self.pool.pop(0)
        self.host_at[g], self.place[new] = new, g
        self.down.difference_update(range(g * dph, (g + 1) * dph))
        self.swaps += 1

    def fail(self, devs: list[int]) -> str | None:
        """Devices `devs` fail: None where the job loses no working slot, "swapped" where spare
        hosts took the hit hosts' places, "shrunk" where the job goes on without the slots."""
        dph = self.dph
        self.alive[devs] = False
        for h in {d // dph for d in devs}:
            if h in self.pool:  # an idle spare failed: out of the pool until repaired
                self.pool.remove(h)
                self.out.add(h)
        hit = [d for d in devs if d // dph in self.place and self.slot(d) not in self.down]
        if not hit:
            return None
        if self.policy == "spares" and self.pool:
            for g in sorted({self.place[d // dph] for d in hit}):
                if self.pool:
                    self.swap_in(g)
            self.down.update(self.slot(d) for d in hit if d // dph in self.place)
            return "swapped"
        self.down.update(self.slot(d) for d in hit)
        return "shrunk"

    def repair(self, devs: list[int]) -> bool:
        """Devices `devs` are repaired: a whole repaired host out of the job refills the pool
        (spares), a repaired device in the job returns to its slot (not under shrink), and pool
        hosts fill the job's empty places. True where the job's slots changed."""
        dph = self.dph
        self.alive[devs] = True
        before = set(self.down)
        for h in {d // dph for d in devs}:
            if h in self.out and self.alive[h * dph:(h + 1) * dph].all():
                self.out.discard(h)
                if self.policy == "spares":
                    self.pool.append(h)
            elif h in self.place and self.policy != "shrink":
                self.down.difference_update(self.slot(d) for d in devs if d // dph == h)
        while self.policy == "spares" and self.pool and self.down:
            self.swap_in(min(self.down) // dph)
        return self.down != before


def simulate_policy(
    sc: Scenario,
    policy: str,
    trace: Sequence[TraceEvent],
    hours: float,
    bin_hours: float,
    reference_tokens_per_s: float,
    *,
    spare_hosts: int = 0,
    swap_s: float | None = None,
    strategy: str = "elaswave_no_dvfs",
    step_cost: float = 1.0,
) -> PolicyTimeline:
    """Replay `trace` (over the job's `n` devices, then `spare_hosts` hosts of spares) under
    `policy`; see the module docstring. `swap_s` None: `swap_seconds(sc)`. `step_cost`: the
    strategy's fault-free step time over a plain loop's (`SimConfig.step_cost`): every rate is
    divided by it."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}; allowed values: {', '.join(POLICIES)}")
    elastic = [k for k in STRATEGIES if k != "checkpoint_restart"]
    if strategy not in elastic:
        raise ValueError(f"strategy {strategy!r}; allowed values: {', '.join(elastic)}")
    if spare_hosts < 0 or (spare_hosts and policy != "spares"):
        raise ValueError(f"spare_hosts = {spare_hosts}: only policy 'spares' holds spares (>= 0)")
    fn = STRATEGIES[strategy]
    n, dph = sc.layout.n_devices, sc.layout.devices_per_host
    if n % dph:
        raise ValueError(f"the job's {n} devices are not whole hosts of {dph}")
    swap = swap_seconds(sc) if swap_s is None else float(swap_s)
    fleet = _Fleet(policy, n // dph, dph, spare_hosts)
    memo: dict[frozenset, Outcome] = {}

    def outcome() -> Outcome:
        key = frozenset(fleet.down)
        if key not in memo:
            memo[key] = fn(sc, sorted(fleet.down))
        return memo[key]

    horizon = hours * 3600.0
    current = outcome()
    segments: list[list[float]] = []
    filled: list[tuple[float, int]] = [(0.0, n)]
    seg_start = resume_at = downtime = lost = 0.0
    transitions = fallbacks = 0
    for ev in trace:
        te = ev.time_s
        if te > horizon:
            break
        devs = [d for d in ev.devices if d < fleet.alive.size]
        if ev.kind == "fail":
            took = fleet.fail(devs)
            if took is None:
                continue
            if took == "swapped":
                wait = swap
            else:
                fallbacks += policy == "spares"
                wait = None
        else:
            if not fleet.repair(devs):
                continue
            wait = -1.0  # a growth: the new plan's grow_s
        start = max(seg_start, resume_at)
        if te > start:
            segments.append([start, te, current.tokens_per_s / step_cost])
        seg_start = te
        new = outcome()
        if ev.kind == "fail":
            if te > resume_at:  # running when it failed: the step in flight is lost
                lost += _discard(segments, te - in_flight_s(current), te)
            wait = new.recovery_s if wait is None else wait
        else:
            if new.plan == current.plan and new.tokens_per_s == current.tokens_per_s:
                current = new
                filled.append((te, n - len(fleet.down)))
                continue
            wait = new.grow_s
        transitions += 1
        resume_at, idle = resume_after(te, wait, ev.kind, resume_at)
        downtime += idle
        current = new
        filled.append((te, n - len(fleet.down)))
    start = max(seg_start, resume_at)
    if horizon > start:
        segments.append([start, horizon, current.tokens_per_s / step_cost])
    edges, good, mean = bin_progress(segments, horizon, bin_hours, reference_tokens_per_s)
    t = np.array([f[0] for f in filled] + [horizon])
    k = np.array([f[1] for f in filled], dtype=float)
    total = n + (spare_hosts if policy == "spares" else 0) * dph
    return PolicyTimeline(
        policy=policy, strategy=strategy, spare_hosts=spare_hosts if policy == "spares" else 0,
        active_devices=n, total_devices=total, bin_edges_h=edges, goodput=good,
        mean_goodput=mean, goodput_per_total_device=mean * n / total,
        mean_filled=float(np.sum(np.diff(t) * k) / (horizon * n)),
        downtime_s=float(downtime), lost_work_s=float(lost), transitions=transitions,
        swaps=fleet.swaps, fallbacks=fallbacks,
    )


__all__ = ["POLICIES", "PolicyTimeline", "simulate_policy", "spare_hosts_for", "swap_seconds"]
