"""The planner: (live devices, model, global batch, cost model) -> Plan. Pure Python.

A `Plan` says everything about how one step is laid out: which devices, the mesh shape, the
micro-batch schedule with its weight-0 padding slots, and the spare devices. It is frozen and
hashable so that it can key compiled executables and be a static `jit` argument.

Elastic recovery is a transition between plans, so the planner never assumes a device count:
any number of survivors (7, 5, 3 ...) yields a plan. Uneven counts are normal. The global batch
`B` is spread over the `data` replicas as evenly as possible and every replica runs the same
number of slots (SPMD needs uniform shapes); slots without a sample carry weight 0. The loss is
normalised by the real tokens of the whole global batch, so padding changes cost, never the
gradient.

Choosing a shape: every (data, tensor) with `tensor` dividing the model (heads, MLP width,
vocabulary) and `data * tensor <= live` is costed with `costmodel.spmd_step_cost`; the cheapest
wins, and among shapes within `TIE_TOLERANCE` of the cheapest the one using the most devices wins
(spares only when no better shape exists). The rejected alternative, "keep the shape and drop
what does not fit", wastes survivors and is what `parallel.replan: keep_tensor` offers.

Hot spares (`parallel.spares: K`) are the exception to "use every live device": the last K hosts
of the job are held outside the mesh (`held_spares`), and a re-plan after a failure first puts a
spare host in each lost host's place (`substitute_spares`): the same shape, schedule, partition
and ZeRO layout on a different device set, so the mesh keeps its size. Only when the spares are
used up does the re-plan choose a new shape over everything live.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .. import models
from ..config import (
    Config,
    ConfigError,
    HardwareConfig,
    allowed_tensor_degrees,
    deterministic_by_default,
    layer_count,
)
from ..core.partition import minimax_partition
from ..models.costmodel import (
    ModelProfile,
    StepCost,
    ceil_div,
    even_split,
    pipelined_plan_cost,
    spmd_step_cost,
)
from .zero import ZeroLayout, evolve, fresh_layout, kept_ranks

TIE_TOLERANCE = 0.05  # relative; plans closer than this are ranked by devices used


class NoPlanError(ValueError):
    """No layout can run on the live devices (e.g. none are left)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """The job's devices and their failure domains: a host is `devices_per_host` consecutive
    devices of `device_ids`; a host failure removes all of them."""

    device_ids: tuple[int, ...]
    devices_per_host: int = 1

    def host_of(self, device_id: int) -> int:
        return self.device_ids.index(device_id) // self.devices_per_host

    @property
    def n_hosts(self) -> int:
        return ceil_div(len(self.device_ids), self.devices_per_host)

    def host_devices(self, host: int) -> tuple[int, ...]:
        k = self.devices_per_host
        return self.device_ids[host * k : (host + 1) * k]

    def hosts_lost(self, devices) -> set[int]:
        """Hosts all of whose devices are in `devices`: their host memory (and the host copies
        of snapshots in it) is gone with them, as opposed to device failures within a host."""
        dead = set(devices)
        return {
            h for h in {self.host_of(d) for d in dead}
            if all(d in dead for d in self.host_devices(h))
        }


@dataclasses.dataclass(frozen=True)
class Plan:
    """Layout of one training step. See the module docstring."""

    device_ids: tuple[int, ...]  # used devices, mesh order (tensor fastest)
    data: int
    tensor: int
    microbatches: int  # per replica
    micro_batch: int  # samples per replica per micro-batch
    global_batch: int
    spare_ids: tuple[int, ...] = ()
    stage: int = 1
    zero_stage: int = 0
    zero: ZeroLayout | None = None
    partition: tuple[int, ...] = ()  # layers per stage (pipelines only)
    canonical_micro: int = 0  # deterministic mode: samples per canonical micro-batch (0 = off)
    predicted_step_s: float = dataclasses.field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if self.stage > 1 and len(self.partition) != self.stage:
            raise ValueError(f"a {self.stage}-stage plan needs a partition, got {self.partition}")
        if self.data * self.tensor * self.stage != len(self.device_ids):
            raise ValueError(f"plan shape {self.mesh_shape} does not match {len(self.device_ids)} devices")
        if self.slots < self.global_batch:
            raise ValueError(f"plan has {self.slots} slots for a global batch of {self.global_batch}")

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {"data": self.data, "stage": self.stage, "tensor": self.tensor}

    @property
    def n_devices(self) -> int:
        return len(self.device_ids)

    @property
    def slots(self) -> int:
        return self.data * self.microbatches * self.micro_batch

    @property
    def compile_key(self) -> "Plan":
        """The plan as its executable sees it: spare devices do not change the program."""
        return dataclasses.replace(self, spare_ids=()) if self.spare_ids else self

    @property
    def shape_key(self) -> "Plan":
        """The plan as its program sees it: every field but which devices (the program is
        partitioned over mesh positions; the device assignment is bound at load,
        `executables.rebind`)."""
        return dataclasses.replace(self, device_ids=tuple(range(self.n_devices)), spare_ids=())

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Device ids of each data rank (its tensor group), in rank order."""
        t = self.tensor * self.stage
        return tuple(self.device_ids[r * t : (r + 1) * t] for r in range(self.data))

    @property
    def replica_counts(self) -> tuple[int, ...]:
        return even_split(self.global_batch, self.data)

    @property
    def name(self) -> str:
        pp = f"s{self.stage}" if self.stage > 1 else ""
        s = f"d{self.data}{pp}t{self.tensor}m{self.microbatches}b{self.micro_batch}"
        if self.stage > 1:
            s += "p" + "-".join(map(str, self.partition))
        s += f"+{len(self.spare_ids)}spare" if self.spare_ids else ""
        if self.zero is not None:
            s += f".z{self.zero_stage}{self.zero.kind[0]}{len(self.zero.tiers)}"
        return s

    def slot_positions(self) -> np.ndarray:
        """[microbatches, data * micro_batch] batch positions (0..B-1) per slot; -1 = padding.

        Replica r takes a contiguous run of positions (`replica_counts[r]` of them); its k-th
        micro-batch holds that run's items k*b .. k*b+b-1. Row k is the k-th micro-batch of the
        whole mesh, laid out replica-major along the data-sharded dimension.
        """
        m, b = self.microbatches, self.micro_batch
        out = np.full((m, self.data, b), -1, dtype=np.int64)
        if self.canonical_micro:
            # Deterministic mode: slot (k, r) holds canonical micro-batch `canonical_slots()[k, r]`.
            for (k, r), c in np.ndenumerate(self.canonical_slots()):
                if c >= 0:
                    pos = c * b + np.arange(b)
                    out[k, r] = np.where(pos < self.global_batch, pos, -1)
            return out.reshape(m, self.data * b)
        start = 0
        for r, c in enumerate(self.replica_counts):
            idx = np.arange(m * b)
            pos = np.where(idx < c, start + idx, -1)
            out[:, r, :] = pos.reshape(m, b)
            start += c
        return out.reshape(m, self.data * b)

    @property
    def n_canonical(self) -> int:
        return ceil_div(self.global_batch, self.canonical_micro) if self.canonical_micro else 0

    def canonical_slots(self) -> np.ndarray:
        """[microbatches, data] canonical micro-batch index per slot (-1 = empty): replica r
        takes a contiguous run of canonical micro-batches (`even_split` of their count)."""
        out = np.full((self.microbatches, self.data), -1, np.int64)
        start = 0
        for r, c in enumerate(even_split(self.n_canonical, self.data)):
            out[:c, r] = np.arange(start, start + c)
            start += c
        return out

    def describe(self) -> str:
        pp = f" stage={self.stage} (layers {list(self.partition)})" if self.stage > 1 else ""
        return (
            f"{self.name}: data={self.data}{pp} tensor={self.tensor} on devices "
            f"{list(self.device_ids)}"
            f"; {self.microbatches} micro-batch(es) of {self.micro_batch} per replica; "
            f"{self.slots - self.global_batch} padding slot(s); spares {list(self.spare_ids)}"
        )


def assign_devices(
    live_ids: Sequence[int], topo: Topology, data: int, tensor: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Pick `data` tensor groups of `tensor` devices from the live ones, preferring groups inside
    one host (tensor traffic is the heaviest). Returns (used ids in mesh order, spare ids)."""
    live = set(live_ids)
    groups: list[tuple[int, ...]] = []
    leftovers: list[int] = []
    for h in range(topo.n_hosts):
        ids = [d for d in topo.host_devices(h) if d in live]
        full = len(ids) // tensor * tensor
        groups += [tuple(ids[i : i + tensor]) for i in range(0, full, tensor)]
        leftovers += ids[full:]
    full = len(leftovers) // tensor * tensor
    groups += [tuple(leftovers[i : i + tensor]) for i in range(0, full, tensor)]
    if len(groups) < data:
        raise NoPlanError(f"{len(live)} live devices cannot form {data} groups of {tensor}")
    used = tuple(d for g in groups[:data] for d in g)
    spare = tuple(d for d in topo.device_ids if d in live and d not in used)
    return used, spare


def _cost(prof, hw, data, tensor, stage, m, b, partition) -> StepCost:
    if stage == 1:
        return spmd_step_cost(prof, hw, data=data, tensor=tensor, microbatches=m, micro_batch=b)
    return pipelined_plan_cost(
        prof, hw, data=data, stage=stage, tensor=tensor, microbatches=m, micro_batch=b,
        partition=partition,
    )


def layer_partition(
    n_layers: int, stage: int, previous: tuple[int, ...] | None = None, layer_bytes: float = 1.0
) -> tuple[int, ...]:
    """Minimax split of equal-cost layers over `stage` stages; among the optimal splits, the one
    moving the fewest layers relative to `previous` (`partition.minimax_partition`)."""
    if stage == 1:
        return ()
    cur = list(previous) if previous else None
    part = minimax_partition(
        [1.0] * n_layers, stage, layer_bytes=[layer_bytes] * n_layers if cur else None, current=cur
    )
    return part.sizes


def _make(
    live_ids: Sequence[int],
    topo: Topology,
    cfg: Config,
    prof: ModelProfile,
    hw: HardwareConfig,
    data: int,
    tensor: int,
    microbatches: int | None,
    max_micro_batch: int,
    stage: int = 1,
    previous_partition: tuple[int, ...] | None = None,
) -> tuple[Plan, StepCost]:
    B = cfg.train.global_batch
    per_replica = ceil_div(B, data)
    partition = layer_partition(layer_count(cfg.model), stage, previous_partition)
    canon = canonical_size(cfg) if cfg.deterministic else 0
    if canon:
        # Deterministic mode: micro-batches are the canonical ones, dealt over the replicas.
        m, b = ceil_div(ceil_div(B, canon), data), canon
    elif microbatches is None:
        best = None
        lo = max(1, ceil_div(per_replica, max_micro_batch))
        for m in range(lo, max(lo, per_replica) + 1):
            b = ceil_div(per_replica, m)
            if b > max_micro_batch:
                continue
            c = _cost(prof, hw, data, tensor, stage, m, b, partition).total_s
            if best is None or c < best[0] - 1e-15:
                best = (c, m, b)
        m, b = best[1], best[2]
    else:
        m, b = microbatches, ceil_div(per_replica, microbatches)
    used, spare = assign_devices(live_ids, topo, data * stage, tensor)
    cost = _cost(prof, hw, data, tensor, stage, m, b, partition)
    plan = Plan(
        used, data, tensor, m, b, B, spare, stage=stage, partition=partition,
        canonical_micro=canon, predicted_step_s=cost.total_s,
    )
    return plan, cost


def canonical_size(cfg: Config) -> int:
    """Samples per canonical micro-batch in deterministic mode: the initial plan's micro-batch
    (`train.global_batch` over `parallel.data` x `train.microbatches`), or
    `train.canonical_micro_batch` when set."""
    if cfg.train.canonical_micro_batch:
        return cfg.train.canonical_micro_batch
    d = cfg.parallel.data if cfg.parallel.data > 0 else 1
    return max(1, ceil_div(ceil_div(cfg.train.global_batch, d), cfg.train.microbatches))


def plan_for_shape(
    live_ids: Sequence[int],
    topo: Topology,
    cfg: Config,
    *,
    data: int,
    tensor: int,
    microbatches: int | None = None,
    stage: int = 1,
    hw: HardwareConfig | None = None,
) -> Plan:
    """The plan of a given (data, stage, tensor) shape on the live devices;
    `microbatches=None` lets the cost model pick the schedule."""
    hw = hw or cfg.hardware
    prof = models.profile(cfg.model)
    mmb = cfg.train.max_micro_batch or 1 << 30
    plan = _make(live_ids, topo, cfg, prof, hw, data, tensor, microbatches, mmb, stage)[0]
    return with_zero(plan, cfg)


def held_spares(topo: Topology, cfg: Config) -> tuple[int, ...]:
    """The hot spares' devices: the last `parallel.spares` hosts of the job (none by default)."""
    k = cfg.parallel.spares
    if k == 0:
        return ()
    held = k * topo.devices_per_host
    n = len(topo.device_ids)
    if held >= n or (n - held) % topo.devices_per_host:
        raise ConfigError(
            f"config 'parallel.spares' = {k}: the job has {n} devices in hosts of "
            f"{topo.devices_per_host}, so {k} spare host(s) leave "
            f"{'none' if held >= n else 'a partial host'} to train on; allowed values: 0 .. "
            f"{max(0, topo.n_hosts - 1)} with whole hosts left to train on"
        )
    return topo.device_ids[n - held:]


def substitute_spares(previous: Plan, live_ids: Sequence[int], topo: Topology) -> Plan | None:
    """`previous` with a spare host in the place of each host that lost a device of it: the same
    shape, micro-batch schedule, partition and ZeRO layout (ranks keep their pieces; the spare's
    are filled by the transition), on the surviving devices plus the spares' ones in the lost
    devices' mesh positions. A spare host is a host none of whose devices the plan uses, all of
    them live (the held spares, and hosts that returned). None when there are fewer spare hosts
    than lost hosts (or a spare host is smaller than the devices it would replace); `previous`
    with its spare list brought up to date when the plan lost nothing."""
    live, used = set(live_ids), set(previous.device_ids)
    spare_left = [d for d in topo.device_ids if d in live and d not in used]
    lost = [d for d in previous.device_ids if d not in live]
    if not lost:
        if tuple(spare_left) == previous.spare_ids:
            return previous
        return dataclasses.replace(previous, spare_ids=tuple(spare_left))
    pool = set(spare_left)
    spare_hosts = [
        h for h in range(topo.n_hosts)
        if topo.host_devices(h) and set(topo.host_devices(h)) <= pool
    ]
    lost_hosts: dict[int, list[int]] = {}
    for d in lost:  # in mesh order, so a spare's devices take the lost ones' positions in order
        lost_hosts.setdefault(topo.host_of(d), []).append(d)
    if len(spare_hosts) < len(lost_hosts):
        return None
    swap: dict[int, int] = {}
    for (_, gone), s in zip(lost_hosts.items(), spare_hosts):
        new = topo.host_devices(s)
        if len(new) < len(gone):
            return None
        swap.update(zip(gone, new))
    used = tuple(swap.get(d, d) for d in previous.device_ids)
    return dataclasses.replace(
        previous, device_ids=used, spare_ids=tuple(d for d in spare_left if d not in used)
    )


def same_shape(a: Plan, b: Plan) -> bool:
    """Whether `a` and `b` run the same program on (possibly) different devices."""
    skip = ("device_ids", "spare_ids", "predicted_step_s")
    return all(
        getattr(a, f.name) == getattr(b, f.name)
        for f in dataclasses.fields(Plan) if f.name not in skip
    ) and a.n_devices == b.n_devices


def initial_plan(topo: Topology, cfg: Config, hw: HardwareConfig | None = None) -> Plan:
    """The plan the config asks for on the job's devices, less the hot spares
    (`held_spares`), which the plan lists as spare."""
    held = held_spares(topo, cfg)
    if held:
        active = tuple(d for d in topo.device_ids if d not in held)
        plan = initial_plan(Topology(active, topo.devices_per_host), cfg.replace(
            parallel=dataclasses.replace(cfg.parallel, spares=0)), hw)
        spare = tuple(d for d in topo.device_ids if d in set(plan.spare_ids) | set(held))
        return dataclasses.replace(plan, spare_ids=spare)
    hw = hw or cfg.hardware
    prof = models.profile(cfg.model)
    n, p, B = len(topo.device_ids), cfg.parallel, cfg.train.global_batch
    S = p.stage
    micro = cfg.pipeline.microbatches or cfg.train.microbatches if S > 1 else cfg.train.microbatches
    tensors = allowed_tensor_degrees(cfg.model) if p.tensor == -1 else [p.tensor]
    options = []
    for t in tensors:
        d = p.data if p.data != -1 else min(n // (t * S), B)
        if d < 1 or d * t * S > n:
            continue
        if d > B:
            raise ConfigError(
                f"config 'parallel.data' = {d} exceeds train.global_batch = {B}; "
                f"allowed values: -1, 1 .. {B}"
            )
        options.append(_make(topo.device_ids, topo, cfg, prof, hw, d, t, micro, 1 << 30, S))
    if not options:
        raise ConfigError(
            f"config 'parallel' asks for data={p.data} x stage={S} x tensor={p.tensor} but the "
            f"job has {n} devices; choose data * stage * tensor <= {n} (or data = -1)"
        )
    plan = _choose(options, prefer_tensor=tensors[0])[0]
    return with_zero(plan, cfg)


def stage_options(cfg: Config) -> list[int]:
    """Stage counts a re-plan may choose."""
    if cfg.zero.stage > 1:  # ZeRO-2/3 do not run on pipelines (config refuses stage > 1)
        return [1]
    top = cfg.parallel.max_stage or cfg.parallel.stage
    return list(range(cfg.parallel.min_stage, min(top, layer_count(cfg.model)) + 1))


def fast_path_plan(
    previous: Plan, live_ids: Sequence[int], cfg: Config, hw: HardwareConfig | None = None
) -> Plan | None:
    """The plan that resumes at once without moving any layer: keep the data replicas whose
    devices all survive, with their stages and partition, and re-spread the global batch over
    them with more micro-batches of the same size. None when no replica is intact (or none
    was broken)."""
    live = set(live_ids)
    intact = [g for g in previous.groups if all(d in live for d in g)]
    if not intact or len(intact) == previous.data:
        return None
    hw = hw or cfg.hardware
    prof = models.profile(cfg.model)
    D, B, b = len(intact), previous.global_batch, previous.micro_batch
    m = ceil_div(ceil_div(B, D), b)
    if previous.canonical_micro:  # deterministic mode: the canonical micro-batches, dealt out
        m = ceil_div(ceil_div(B, b), D)
    used = tuple(d for g in intact for d in g)
    if cfg.deterministic and len(used) == 1 < previous.n_devices:
        return None  # off one device the bits change (`one_device`): the optimal plan instead
    spare = tuple(d for d in live_ids if d not in used)
    cost = _cost(prof, hw, D, previous.tensor, previous.stage, m, b, previous.partition)
    plan = Plan(
        used, D, previous.tensor, m, b, B, spare, stage=previous.stage,
        partition=previous.partition, canonical_micro=previous.canonical_micro,
        predicted_step_s=cost.total_s,
    )
    return with_zero(plan, cfg, previous, in_place=True)  # a fast path moves nothing


def with_zero(plan: Plan, cfg: Config, previous: Plan | None = None,
              in_place: bool | None = None) -> Plan:
    """Attach the ZeRO storage layout: fresh, or (`in_place`; by default where `zero.shrink`
    says `in_place`) evolved from `previous` so that ranks whose tensor group survives keep
    their partitions in place."""
    stage = cfg.zero.stage
    if stage == 0:
        return plan
    if in_place is None:
        in_place = cfg.zero.shrink == "in_place"
    old = previous.zero if previous is not None else None
    if old is not None and in_place and previous.tensor == plan.tensor:
        lay, _ = evolve(old, kept_ranks(previous.groups, plan.groups), plan.data)
    else:  # an interleaved layout keeps its piece count through re-layouts
        pieces = old.n_pieces if old is not None and cfg.zero.layout == "interleaved" else None
        lay = fresh_layout(cfg.zero.layout, stage, plan.data, pieces)
    return dataclasses.replace(plan, zero_stage=stage, zero=lay)


def rank_candidates(
    live_ids: Sequence[int],
    topo: Topology,
    cfg: Config,
    *,
    tensors: Sequence[int],
    max_micro_batch: int,
    hw: HardwareConfig | None = None,
    stages: Sequence[int] = (1,),
    previous_partition: tuple[int, ...] | None = None,
) -> list[tuple[Plan, StepCost]]:
    """Every feasible (data, stage, tensor) plan on the live devices with its predicted cost,
    best first."""
    hw = hw or cfg.hardware
    prof = models.profile(cfg.model)
    n, B = len(live_ids), cfg.train.global_batch
    out = []
    for S in stages:
        for t in tensors:
            for d in range(1, min(n // (t * S), B) + 1):
                plan, cost = _make(
                    live_ids, topo, cfg, prof, hw, d, t, None, max_micro_batch, S,
                    previous_partition,
                )
                if cost.memory_bytes <= hw.memory_bytes:
                    out.append((plan, cost))
    return _order(out, prefer_tensor=tensors[0] if tensors else 1)


def replan(
    live_ids: Sequence[int],
    topo: Topology,
    cfg: Config,
    previous: Plan,
    initial: Plan,
    hw: HardwareConfig | None = None,
    give_way: bool = True,
) -> Plan:
    """The plan after a membership change. Micro-batches never grow beyond the initial plan's
    (or `train.max_micro_batch`), so activation memory per device does not grow. With hot spares
    (`parallel.spares`) a spare host takes each lost host's place while enough are left
    (`substitute_spares`): the same plan on other devices. In deterministic mode the plan keeps
    the tensor degree and `one_device` of the initial plan; where none does, a mode the default
    chose gives way (`give_way`) and one the config asked for raises `NoPlanError`."""
    if not live_ids:
        raise NoPlanError("no live devices are left; the job cannot continue")
    if cfg.parallel.spares:  # hot spares: keep the shape while a spare host is left
        kept = substitute_spares(previous, live_ids, topo)
        if kept is not None:
            return kept
    allowed = [previous.tensor] + [
        t for t in allowed_tensor_degrees(cfg.model) if t != previous.tensor]
    keep = cfg.parallel.replan == "keep_tensor"
    # deterministic mode: a different tensor degree reduces in a different order
    tensors = [previous.tensor] if keep or cfg.deterministic else allowed
    mmb = cfg.train.max_micro_batch or initial.micro_batch

    def ranked_over(tensors):
        return rank_candidates(
            live_ids, topo, cfg, tensors=tensors, max_micro_batch=mmb, hw=hw,
            stages=stage_options(cfg), previous_partition=previous.partition or None,
        )

    ranked = ranked_over(tensors)
    if cfg.deterministic:
        ranked = [r for r in ranked if one_device(r[0]) == one_device(initial)]
    if not ranked and cfg.deterministic and deterministic_by_default(cfg) and give_way:
        # a mode only the default chose gives way rather than end the run: the loop says that
        # bitwise equality ends here (`Trainer._on_failure`; test_config.py, the tensor test)
        ranked = ranked_over(tensors if keep else allowed)
    if not ranked:
        why = ""
        if cfg.deterministic:
            why = (" and train.deterministic = true, which keeps the tensor degree"
                   if not keep else " and train.deterministic = true")
            why += (", and a run on several devices off one device, and one on one device on it"
                    " (`planner.one_device`)")
        raise NoPlanError(
            f"no layout fits {len(live_ids)} live devices with tensor degree in {tensors} "
            f"(parallel.replan = {cfg.parallel.replan!r}{why})"
        )
    return with_zero(ranked[0][0], cfg, previous)


def one_device(plan: Plan) -> bool:
    """Does `plan` run on a single device? Its program is then compiled without XLA's SPMD
    partitioner (and JAX lowers the step's `shard_map`s inline), and XLA:CPU fused its
    gradient differently: the same canonical micro-batch's gradient came out with other bits
    on one device than on 2 to 8 (where it is the same), so the deterministic mode keeps a run
    that started on several devices off one device, and one that started on one device on it
    (`replan`; experiments/RESULTS.md, "The bitwise sweep": the ZeRO demo's 8 -> 1 device
    shrink). Several devices with one data replica (`d1t2`, `d1s3`) partition as any other."""
    return plan.n_devices == 1


def _order(options, prefer_tensor: int):
    if not options:
        return []
    best = min(c.total_s for _, c in options)
    near = [o for o in options if o[1].total_s <= best * (1 + TIE_TOLERANCE)]
    far = [o for o in options if o[1].total_s > best * (1 + TIE_TOLERANCE)]
    near.sort(key=lambda o: (-o[0].n_devices, o[0].tensor != prefer_tensor, o[1].total_s))
    far.sort(key=lambda o: o[1].total_s)
    return near + far


def _choose(options, prefer_tensor: int):
    return _order(options, prefer_tensor)[0]


def predict_step_s(plan: Plan, cfg: Config, hw: HardwareConfig | None = None) -> float:
    """The cost model's step time of `plan` (recomputed, so that plans built anywhere compare)."""
    hw = hw or cfg.hardware
    prof = models.profile(cfg.model)
    return _cost(
        prof, hw, plan.data, plan.tensor, plan.stage, plan.microbatches, plan.micro_batch,
        plan.partition,
    ).total_s


@dataclasses.dataclass(frozen=True)
class Growth:
    """The planner's answer when devices return: the best plan over the bigger live set
    (`best`), its predicted relative step-time gain over the current plan, and whether the run
    should move to it (`grow`; `reason` says why not)."""

    best: Plan
    current_s: float
    best_s: float
    grow: bool
    reason: str

    @property
    def gain(self) -> float:
        return (self.current_s - self.best_s) / self.current_s if self.current_s > 0 else 0.0


def growth_plan(
    live_ids: Sequence[int],
    topo: Topology,
    cfg: Config,
    current: Plan,
    initial: Plan,
    hw: HardwareConfig | None = None,
) -> Growth:
    """Should the run grow from `current` onto the live devices (which include returned ones)?
    The candidate is `replan`'s choice over them; the run grows only when the cost model
    predicts it at least `recovery.grow_min_gain` (relative) faster than `current`: growth is
    never forced onto a plan that is not better."""
    hw = hw or cfg.hardware
    try:  # growth never gives the deterministic mode's bits away (`replan`)
        best = replan(live_ids, topo, cfg, current, initial, hw, give_way=False)
    except NoPlanError as e:
        s = predict_step_s(current, cfg, hw)
        return Growth(current, s, s, False, f"no plan to grow to keeps the bits: {e}")
    g = Growth(best, predict_step_s(current, cfg, hw), predict_step_s(best, cfg, hw), False, "")
    need = cfg.recovery.grow_min_gain
    if best.compile_key == current.compile_key:
        reason = "the best plan over the live devices is the current one"
    elif g.gain <= 0 or g.gain < need:
        reason = (f"predicted gain {g.gain:+.1%} of {best.name} over {current.name} is below "
                  f"recovery.grow_min_gain = {need:.1%}" + (" (and not positive)" if need == 0 else ""))
    else:
        return dataclasses.replace(g, grow=True)
    return dataclasses.replace(g, reason=reason)


def torchft_plan(previous: Plan, survivors) -> Plan | None:
    """TorchFT-like recovery: keep the intact data replicas exactly as they are (same
    micro-batches, same samples) and drop the broken ones with their samples: the global batch
    shrinks and the loss averages over the surviving replicas."""
    live = set(survivors)
    intact = [g for g in previous.groups if all(d in live for d in g)]
    if not intact:
        return None
    used = tuple(d for g in intact for d in g)
    return Plan(
        used, len(intact), previous.tensor, previous.microbatches, previous.micro_batch,
        previous.global_batch * len(intact) // previous.data or 1,
        tuple(d for d in survivors if d not in used), stage=previous.stage,
        partition=previous.partition,
    ).compile_key


def torchft_kept(keep, old: Plan, new: Plan) -> tuple[int, ...]:
    """Initial-layout replica indices that survive into `new` (`torchft_plan`)."""
    keep = tuple(range(old.data)) if keep is None else keep
    groups = set(new.groups)
    return tuple(k for k, g in zip(keep, old.groups) if g in groups)
