"""Cluster-scale simulator of elastic hybrid-parallel training. Every number it prints is
*simulated*.

Pure Python + numpy (no JAX devices): synchronous DP x PP x TP training on 96 .. 100,000
devices, driven by the same cost model as the planner (`elasjax.models.costmodel`, the 1F1B
`pipeline_step_cost`) and the minimax layer partition (`elasjax.core.partition`). Modules:

- `hardware`: stated device parameters with sources (Ascend-910-like NPU, H100 SXM).
- `workload`: per-item (embedding, blocks, head) costs of one micro-batch from FLOP counts.
- `cluster`: layout, groups of identical pipelines, greedy min-max micro-batch spreading,
  step time.
- `dvfs`: t(f) = t_c f0/f + t_m, P(f) = P0 + k f^3, and the bubble-absorbing clock policy.
- `planner`: ElasWave-style heterogeneous re-plans with a time budget.
- `strategies`: elaswave, recycle, torchft, oobleck, elasjax_spmd, checkpoint_restart.
- `traces`, `timeline`: seeded MTBF failure traces and goodput over time.
- `config`, `run`: `elasjax sim CONFIG` (configs in `configs/sim/`; `run.run(cfg)`).
- `calibrate` (optional, imports JAX lazily): per-layer compute of the real GPT on this CPU.

Design invariant: every strategy is evaluated by the same `cluster.step_time`, so differences
between strategies are only the behaviours each one models (listed in `strategies.py`). The
alternative, an event-level discrete simulation of every micro-batch on every device, was
rejected: it is O(devices x micro-batches) per step and cannot plan at 10^5 devices in a second,
while the closed-form 1F1B time is exact for the synchronous schedules modelled here.
"""

from .cluster import Layout, PipeGroup, spread_microbatches, step_time
from .dvfs import PowerModel, balance
from .hardware import Device, ascend910, h100_sxm
from .hetplan import HetPlan, plan_heterogeneous
from .scenario import Outcome, RecoveryCosts, Scenario
from .settings import SimConfig, load, scenario
from .strategies import STRATEGIES, failure_free, ideal_tokens_per_s
from .traces import TraceParams, make_trace
from .workload import GptDims, Workload, build_workload

__all__ = [
    "Layout", "PipeGroup", "spread_microbatches", "step_time", "SimConfig", "load", "scenario",
    "PowerModel", "balance", "Device", "ascend910", "h100_sxm", "HetPlan", "plan_heterogeneous",
    "Outcome", "RecoveryCosts", "Scenario", "STRATEGIES", "failure_free",
    "ideal_tokens_per_s", "TraceParams", "make_trace", "GptDims", "Workload", "build_workload",
]
