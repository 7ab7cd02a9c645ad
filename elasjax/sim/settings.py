"""Simulator configuration: frozen dataclasses loaded strictly from YAML (`configs/sim/`).

Uses the package's strict loader (`elasjax.config.build_dataclass`): unknown keys and values
outside their allowed set are `ConfigError`s naming the dotted key; `--set a.b=v` overrides
parse as YAML. Hardware fields left `null` take the preset's stated value (see hardware.py
for the sources); anything set here overrides it and is reported as an override.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import yaml

from ..config import ConfigError, apply_override, build_dataclass, read_config_file
from .cluster import Layout
from .dvfs import PowerModel
from .hardware import Device, presets
from .scenario import RecoveryCosts, Scenario
from .traces import LLAMA3_MTBF_HOURS
from .workload import GptDims

StrategyName = Literal[
    "elaswave", "elaswave_no_dvfs", "recycle", "torchft", "oobleck", "elasjax_spmd",
    "checkpoint_restart",
]
ALL_STRATEGIES: tuple[str, ...] = (
    "elaswave", "elaswave_no_dvfs", "recycle", "torchft", "oobleck", "elasjax_spmd",
    "checkpoint_restart",
)


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """The simulated device (`hardware.Device`) of the `hardware` section: a preset plus optional
    overrides (null = the preset's stated value). The planner's cost model of a real run reads
    `elasjax.config.HardwareConfig` instead."""

    preset: Literal["ascend910", "h100_sxm"] = "ascend910"
    peak_flops: Optional[float] = None
    mfu: Optional[float] = None
    mem_bytes: Optional[float] = None
    intra_host_bw: Optional[float] = None
    inter_host_bw: Optional[float] = None
    devices_per_host: Optional[int] = None
    power_w: Optional[float] = None
    static_fraction: Optional[float] = None
    f_min: Optional[float] = None
    f_max: Optional[float] = None
    mem_fraction: Optional[float] = None
    storage_bw: Optional[float] = None

    def build(self) -> Device:
        dev = presets()[self.preset]
        over = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "preset" and getattr(self, f.name) is not None}
        return dataclasses.replace(dev, **over)


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """`devices` = data * stage * tensor; data = devices // (stage * tensor)."""

    devices: int = 96
    stage: int = 6
    tensor: int = 4


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    micro_batch: int = 1  # sequences per micro-batch
    microbatches: int = 24  # per pipeline in the failure-free plan


@dataclasses.dataclass(frozen=True)
class PostChangeConfig:
    """Post-change throughput: `draws` random sets of `k` failed devices for each k."""

    failures: tuple[int, ...] = (1, 2, 4)
    draws: int = 20
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """Goodput over time under an MTBF trace at each device count in `scales`."""

    scales: tuple[int, ...] = ()
    hours: float = 72.0
    mtbf_hours: float = LLAMA3_MTBF_HOURS
    host_fraction: float = 0.16
    repair_hours: float = 4.0
    bin_hours: float = 1.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class GrowthConfig:
    """Growing back (`run: [growth]`, `elasjax.sim.spares`): each of `strategies` replayed at every
    `trace.scales` under the `trace` section's failures and repairs, once per policy: `shrink`
    (repaired devices never return), `rejoin` (they return; the job grows back after the
    strategy's grow stall), `spares` (`spare_fraction` of the job's hosts, rounded up, held idle
    as hot spares; a failed host is replaced after `swap_s`, null = derived by
    `spares.swap_seconds`: detection + communicator edit + planning + one host's state over the
    inter-host link). Defaults: ElasWave-style without DVFS (so 1.0 is the failure-free plan)
    and this repository's rectangular SPMD re-plan (`elasjax_spmd`)."""

    policies: tuple[Literal["shrink", "rejoin", "spares"], ...] = ("shrink", "rejoin", "spares")
    strategies: tuple[StrategyName, ...] = ("elaswave_no_dvfs", "elasjax_spmd")
    spare_fraction: float = 0.02  # assumption: 2% of the hosts held as hot spares
    swap_s: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class DvfsConfig:
    enabled: bool = True
    cap_factor: float = 1.0  # power cap = cap_factor * working devices * nominal power


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    detect_s: float = 10.0
    comm_edit_s: float = 1.0
    partial_rebuild_s: float = 3.6
    full_rebuild_s: float = 82.0
    plan_s: float = 0.5
    compile_s: float = 60.0
    standby_hit: bool = True
    restart_s: float = 300.0
    ckpt_save_s: float = 30.0
    ckpt_interval_s: float = 0.0
    async_overlap_steps: float = 2.0


@dataclasses.dataclass(frozen=True)
class StepCostConfig:
    """Each strategy's fault-free step time over a plain training loop's on the same devices
    (1.0: its protection costs nothing while nothing fails). The goodput of the trace and growth
    studies and the post-change throughput divide every rate by it, so a strategy that taxes each
    step pays for it all run long. Checkpoint-restart's saves are modelled apart
    (`recovery.ckpt_save_s`). The configs in `configs/sim/` set `elasjax_spmd` to the ratio
    measured by `experiments/bench_scale.py` and say where the others come from."""

    elaswave: float = 1.0
    elaswave_no_dvfs: float = 1.0
    recycle: float = 1.0
    torchft: float = 1.0
    oobleck: float = 1.0
    elasjax_spmd: float = 1.0
    checkpoint_restart: float = 1.0


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """A simulator run. `run` picks the studies: post_change (tables at `layout.devices`),
    trace (goodput over time at `trace.scales`) and growth (shrink only / rejoin / hot spares
    under the same traces, `growth`)."""

    run: tuple[Literal["post_change", "trace", "growth"], ...] = ("post_change",)
    strategies: tuple[StrategyName, ...] = ALL_STRATEGIES
    model: GptDims = GptDims()
    hardware: DeviceConfig = DeviceConfig()
    layout: LayoutConfig = LayoutConfig()
    batch: BatchConfig = BatchConfig()
    post_change: PostChangeConfig = PostChangeConfig()
    trace: TraceConfig = TraceConfig()
    growth: GrowthConfig = GrowthConfig()
    dvfs: DvfsConfig = DvfsConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    step_cost: StepCostConfig = StepCostConfig()
    recycle_bubble_fill: float = 1.0
    planner_budget_s: float = 1.0


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config '{key}' {msg}")


def validate(cfg: SimConfig) -> None:
    m, lay = cfg.model, cfg.layout
    for name in ("n_layers", "d_model", "n_heads", "d_mlp", "vocab_size", "seq_len"):
        _require(getattr(m, name) >= 1, f"model.{name}", "must be >= 1")
    _require(m.d_model % m.n_heads == 0, "model.d_model",
             f"= {m.d_model} must be a multiple of model.n_heads = {m.n_heads}")
    tensors = [t for t in range(1, m.n_heads + 1)
               if m.n_heads % t == 0 and m.d_mlp % t == 0 and m.d_model % t == 0]
    _require(lay.tensor in tensors, "layout.tensor",
             f"= {lay.tensor} does not divide the model; allowed values: {tensors}")
    _require(1 <= lay.stage <= m.n_layers + 2, "layout.stage",
             f"= {lay.stage}; allowed values: 1 .. {m.n_layers + 2} (blocks + embedding + head)")
    _require(lay.devices >= lay.stage * lay.tensor, "layout.devices",
             f"= {lay.devices} is smaller than one pipeline (stage * tensor = "
             f"{lay.stage * lay.tensor})")
    _require(cfg.batch.micro_batch >= 1, "batch.micro_batch", "must be >= 1")
    _require(cfg.batch.microbatches >= 1, "batch.microbatches", "must be >= 1")
    _require(len(cfg.strategies) >= 1, "strategies", f"must name at least one of {ALL_STRATEGIES}")
    _require(all(k >= 1 for k in cfg.post_change.failures), "post_change.failures",
             "must be counts >= 1")
    _require(cfg.post_change.draws >= 1, "post_change.draws", "must be >= 1")
    for s in cfg.trace.scales:
        _require(s >= lay.stage * lay.tensor, "trace.scales",
                 f"entry {s} is smaller than one pipeline ({lay.stage * lay.tensor} devices)")
    _require(cfg.trace.hours > 0, "trace.hours", "must be > 0")
    _require(cfg.trace.mtbf_hours > 0, "trace.mtbf_hours", "must be > 0")
    _require(0 <= cfg.trace.host_fraction <= 1, "trace.host_fraction", "must be in [0, 1]")
    _require(cfg.trace.repair_hours >= 0, "trace.repair_hours", "must be >= 0")
    _require(0 < cfg.trace.bin_hours <= cfg.trace.hours, "trace.bin_hours",
             "must be in (0, trace.hours]")
    g = cfg.growth
    _require(len(g.strategies) >= 1 and "checkpoint_restart" not in g.strategies,
             "growth.strategies", f"= {list(g.strategies)}: name at least one elastic strategy "
             "(checkpoint_restart has no elastic growth to compare); allowed values: "
             f"{', '.join(s for s in ALL_STRATEGIES if s != 'checkpoint_restart')}")
    _require(len(g.policies) >= 1, "growth.policies",
             "must name at least one of 'shrink', 'rejoin', 'spares'")
    _require(0 <= g.spare_fraction < 1, "growth.spare_fraction",
             f"= {g.spare_fraction}; allowed values: 0 <= spare_fraction < 1 (a share of the "
             "job's hosts held as hot spares)")
    _require(g.swap_s is None or g.swap_s >= 0, "growth.swap_s",
             f"= {g.swap_s}; allowed values: null (derived) or a number of seconds >= 0")
    if "growth" in cfg.run:
        _require(bool(cfg.trace.scales), "run",
                 "includes 'growth', which replays the trace at every trace.scales entry; "
                 "allowed: set trace.scales to one or more device counts")
        dph = cfg.hardware.build().devices_per_host
        for n in cfg.trace.scales:
            per_pipe = lay.stage * lay.tensor
            _require((n // per_pipe * per_pipe) % dph == 0, "trace.scales",
                     f"entry {n}: the job's {n // per_pipe * per_pipe} devices are not whole "
                     f"hosts of {dph} (growth swaps whole hosts); allowed values: multiples of "
                     f"lcm(stage * tensor, devices_per_host) = {np.lcm(per_pipe, dph)}")
    _require(cfg.dvfs.cap_factor > 0, "dvfs.cap_factor", "must be > 0")
    for name in ALL_STRATEGIES:
        v = getattr(cfg.step_cost, name)
        _require(v >= 1.0, f"step_cost.{name}",
                 f"= {v}; allowed values: >= 1.0 (a fault-free step time over a plain loop's)")
    _require(0 <= cfg.recycle_bubble_fill <= 1, "recycle_bubble_fill", "must be in [0, 1]")
    _require(cfg.planner_budget_s >= 0, "planner_budget_s", "must be >= 0")
    dev = cfg.hardware.build()
    _require(0 < dev.f_min <= 1 <= dev.f_max, "hardware.f_min",
             f"/ f_max = {dev.f_min} / {dev.f_max}: need 0 < f_min <= 1 <= f_max")
    _require(0 < dev.mfu <= 1, "hardware.mfu", f"= {dev.mfu} must be in (0, 1]")
    _require(0 <= dev.mem_fraction < 1, "hardware.mem_fraction", "must be in [0, 1)")
    _require(0 <= dev.static_fraction < 1, "hardware.static_fraction", "must be in [0, 1)")


def from_dict(raw: dict | None) -> SimConfig:
    cfg = build_dataclass(SimConfig, dict(raw or {}), "")
    validate(cfg)
    return cfg


def load(path: str | Path | None, overrides: Sequence[str] = ()) -> SimConfig:
    """Load a simulator YAML config and apply dotted `key=value` overrides."""
    raw = read_config_file(path) if path is not None else {}
    for o in overrides:
        apply_override(raw, o)
    return from_dict(raw)


def scenario(cfg: SimConfig, devices: int | None = None) -> Scenario:
    """The `Scenario` of `cfg` at `devices` (default `layout.devices`); leftover devices that
    do not make a whole pipeline are not part of the job."""
    dev = cfg.hardware.build()
    n = cfg.layout.devices if devices is None else devices
    per_pipe = cfg.layout.stage * cfg.layout.tensor
    layout = Layout(n // per_pipe, cfg.layout.stage, cfg.layout.tensor, dev.devices_per_host)
    power = PowerModel(dev.power_w, dev.static_fraction, dev.f_min, dev.f_max,
                       cfg.dvfs.cap_factor)
    rc = RecoveryCosts(**dataclasses.asdict(cfg.recovery))
    return Scenario(
        layout=layout, dims=cfg.model, device=dev, micro_batch=cfg.batch.micro_batch,
        microbatches=cfg.batch.microbatches, power=power, recovery=rc, dvfs=cfg.dvfs.enabled,
        recycle_bubble_fill=cfg.recycle_bubble_fill, planner_budget_s=cfg.planner_budget_s,
        mtbf_hours=cfg.trace.mtbf_hours,
    )


def dump(cfg: SimConfig) -> str:
    from ..config import to_dict

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


__all__ = [
    "ALL_STRATEGIES",
    "DeviceConfig",
    "LayoutConfig",
    "BatchConfig",
    "PostChangeConfig",
    "TraceConfig",
    "GrowthConfig",
    "DvfsConfig",
    "RecoveryConfig",
    "SimConfig",
    "validate",
    "from_dict",
    "load",
    "scenario",
    "dump",
]
