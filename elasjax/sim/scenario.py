"""A simulated job (`Scenario`), recovery-time parameters and a strategy's result (`Outcome`).

A `Scenario` is everything a strategy needs to turn a set of failed devices into a post-change
plan: the layout, the model, the device, the failure-free batch (micro-batches per pipeline),
the power model and the recovery-time parameters. It is frozen; its only mutable part is a
private memo of partitions and workloads (pure functions of the frozen fields), so repeated
evaluations at 10^5 devices stay cheap without module-level caches.

Recovery times are parameters, not measurements. Where the paper states a figure we use it and
say so ([P]: ElasWave abstract: communicator recovery < 1 s, up to 82x / 3.6x faster than a
full / partial rebuild); the rest are stated assumptions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..core.partition import Partition, minimax_partition
from .cluster import Layout
from .dvfs import PowerModel
from .hardware import Device
from .workload import GptDims, Workload, build_workload


@dataclasses.dataclass(frozen=True)
class RecoveryCosts:
    """Seconds each recovery step takes (parameters; see the comments for sources)."""

    detect_s: float = 10.0  # assumption: heartbeat / collective-timeout detection
    comm_edit_s: float = 1.0  # [P] ElasWave: in-place communicator edit "< 1 s"
    partial_rebuild_s: float = 3.6  # [P] ElasWave is "up to 3.6x" faster than a partial rebuild
    full_rebuild_s: float = 82.0  # [P] ElasWave is "up to 82x" faster than a full rebuild
    plan_s: float = 0.5  # assumption (the measured planner latency is reported separately)
    compile_s: float = 60.0  # assumption: compiling a new executable without a standby one
    standby_hit: bool = True  # elasjax: the post-failure executable was precompiled
    restart_s: float = 300.0  # assumption: relaunch, rendezvous, runtime init of a whole job
    ckpt_save_s: float = 30.0  # assumption: blocking part of one persistent checkpoint
    ckpt_interval_s: float = 0.0  # 0 = Young's interval sqrt(2 * save * cluster MTBF)
    async_overlap_steps: float = 2.0  # assumption: steps of compute that hide async migration


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One simulated job. `microbatches` is per pipeline in the failure-free plan."""

    layout: Layout
    dims: GptDims
    device: Device
    micro_batch: int
    microbatches: int
    power: PowerModel
    recovery: RecoveryCosts = RecoveryCosts()
    dvfs: bool = True
    recycle_bubble_fill: float = 1.0  # share of a stage's idle time rerouted work can fill
    planner_budget_s: float = 1.0
    mtbf_hours: float = 50680.0  # per device; used for Young's checkpoint interval
    _memo: dict = dataclasses.field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.microbatches < 1:
            raise ValueError("micro_batch and microbatches must be >= 1")
        if self.layout.stage > self.dims.n_layers + 2:
            raise ValueError(
                f"layout.stage = {self.layout.stage} exceeds the {self.dims.n_layers + 2} "
                f"partitionable items (embedding, {self.dims.n_layers} blocks, head)"
            )

    @property
    def total_micro(self) -> int:
        """Micro-batches in the global batch."""
        return self.layout.data * self.microbatches

    @property
    def global_batch(self) -> int:
        return self.total_micro * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.dims.seq_len

    def workload(self, tensor: int | None = None) -> Workload:
        t = self.layout.tensor if tensor is None else tensor
        key = ("workload", t)
        if key not in self._memo:
            self._memo[key] = build_workload(self.dims, self.device, t, self.micro_batch)
        return self._memo[key]

    def mem_cap(self) -> float:
        return self.device.mem_bytes * self.device.mem_usable

    def partition(self, n_stages: int, *, tensor: int | None = None, data: int | None = None
                  ) -> Partition | None:
        """Balanced partition over `n_stages` stages that fits memory (None if none fits)."""
        t = self.layout.tensor if tensor is None else tensor
        d = self.layout.data if data is None else data
        key = ("partition", n_stages, t, d)
        if key not in self._memo:
            w = self.workload(t)
            try:
                mem = w.layer_mem(d, n_stages)
                cap = self.mem_cap() if np.isfinite(self.mem_cap()) else None
                self._memo[key] = minimax_partition(
                    w.cost(), n_stages, layer_mem=mem if cap else None, stage_mem_cap=cap
                )
            except ValueError:
                self._memo[key] = None
        return self._memo[key]

    def memo(self, key: Any, fn):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def ckpt_interval_s(self) -> float:
        """The configured interval, or Young's sqrt(2 * save * MTBF_cluster)."""
        if self.recovery.ckpt_interval_s > 0:
            return self.recovery.ckpt_interval_s
        mtbf_cluster_s = self.mtbf_hours * 3600.0 / self.layout.n_devices
        return float(np.sqrt(2.0 * self.recovery.ckpt_save_s * mtbf_cluster_s))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A strategy's steady state after a change, and what the change cost.

    `recovery_s` is downtime with no progress (detect .. first step); `lost_s` is work that is
    redone (the step in flight, or everything since the last checkpoint for
    checkpoint-restart; expected value in post-change tables). `grow_s` is the downtime of
    moving to this state when devices come back (a scale-up).
    """

    strategy: str
    step_s: float
    samples_per_step: int
    global_batch: int  # the batch the strategy trains with after the change
    batch_preserved: bool
    tokens_per_s: float
    recovery_s: float
    lost_s: float
    grow_s: float
    moved_bytes: float
    devices_used: int
    energy_j_per_token: float
    plan: str
    dvfs_used: bool = False
    note: str = ""
    samples_processed: int = -1  # real samples run per step (padding excluded); -1 = samples


__all__ = ["RecoveryCosts", "Scenario", "Outcome"]
