"""Analytic step-time and memory model used by the planner (and later the simulator).

The planner must rank layouts it has never run, so it needs a model of a step, not a stopwatch.
The model is deliberately simple and explicit: compute from FLOP counts at a stated device
throughput, padding slots counted as real work (SPMD runs them), a fixed overhead per
micro-batch, ring all-reduce for tensor-parallel activations and data-parallel gradients at a
stated link bandwidth. All hardware numbers are parameters of `config.HardwareConfig` (the
config's `hardware` section); the defaults describe nothing real and only fix the *ranking* of
layouts. Absolute predictions are meaningful only with measured parameters.
"""

from __future__ import annotations

import dataclasses

from ..config import HardwareConfig, ModelConfig


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """Sizes derived from a model config: parameter counts, FLOPs and activation bytes."""

    n_layers: int
    seq_len: int
    d_model: int
    params_per_layer: int
    params_embed: int  # embedding + position + head + final norm
    flops_per_token_layer: float  # forward + backward, one layer
    flops_per_token_embed: float  # forward + backward, embedding/head
    bytes_per_param: int = 4

    @property
    def n_params(self) -> int:
        return self.params_per_layer * self.n_layers + self.params_embed

    @classmethod
    def from_params(
        cls, n_params: int, activation_width: int | None = None, n_layers: int = 1
    ) -> "ModelProfile":
        """A model known only by its size: `n_layers` equal layers sharing `n_params`, 6 FLOPs
        per parameter per example (forward 2, backward 4), activations of `activation_width`
        floats per example (default: sqrt(n_params))."""
        width = activation_width or max(int(n_params**0.5), 1)
        per = max(n_params // n_layers, 1)
        return cls(n_layers, 1, width, per, 0, 6.0 * per, 0.0)

    @classmethod
    def from_gpt(cls, m: ModelConfig) -> "ModelProfile":
        d, f, v, t = m.d_model, m.d_mlp, m.vocab_size, m.seq_len
        # attention qkv (q and v biases) + out, mlp in + out, two layer norms (scale + bias)
        per_layer = 4 * d * d + 3 * d + 2 * d * f + f + d + 4 * d
        head = 0 if m.tie_embeddings else d * v
        embed = v * d + t * d + head + 2 * d
        # 6 FLOPs per parameter per token (fwd 2 + bwd 4) plus attention scores and values.
        layer_flops = 6.0 * (4 * d * d + 2 * d * f) + 6.0 * 2 * t * d
        embed_flops = 6.0 * d * v
        return cls(m.n_layers, t, d, per_layer, embed, layer_flops, embed_flops)


def ring_allreduce_s(nbytes: float, n: int, hw: HardwareConfig) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / hw.link_bw + 2 * (n - 1) * hw.link_latency_s


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A predicted step, broken into parts so tests and `elasjax plan` can show them."""

    compute_s: float
    tensor_comm_s: float
    data_comm_s: float
    overhead_s: float
    memory_bytes: float
    bubble_s: float = 0.0  # pipelines: idle time of the bottleneck stage (inside compute_s)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tensor_comm_s + self.data_comm_s + self.overhead_s


def spmd_step_cost(
    prof: ModelProfile,
    hw: HardwareConfig,
    *,
    data: int,
    tensor: int,
    microbatches: int,
    micro_batch: int,
) -> StepCost:
    """Cost of one data x tensor SPMD step; every replica runs `microbatches * micro_batch` slots
    (padding included, since SPMD computes them)."""
    tokens = microbatches * micro_batch * prof.seq_len
    flops = tokens * (prof.n_layers * prof.flops_per_token_layer + prof.flops_per_token_embed)
    compute = flops / tensor / hw.flops
    act_bytes = micro_batch * prof.seq_len * prof.d_model * 4
    # Megatron-style TP: 2 all-reduces forward and 2 backward per layer per micro-batch.
    tcomm = microbatches * prof.n_layers * 4 * ring_allreduce_s(act_bytes, tensor, hw)
    grad_bytes = prof.n_params * prof.bytes_per_param / tensor
    dcomm = ring_allreduce_s(grad_bytes, data, hw)
    overhead = microbatches * hw.micro_overhead_s
    # params + grads + accumulator + 2 Adam moments, plus activations of one micro-batch
    state = 5 * prof.n_params * prof.bytes_per_param / tensor
    acts = micro_batch * prof.seq_len * prof.d_model * 4 * 16 * prof.n_layers / tensor
    return StepCost(compute, tcomm, dcomm, overhead, state + acts)


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """`total` items over `parts` bins, sizes differing by at most one, larger bins first."""
    q, r = divmod(total, parts)
    return tuple(q + 1 if i < r else q for i in range(parts))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def best_micro_schedule(
    per_replica: int, max_micro_batch: int, prof: ModelProfile, hw: HardwareConfig, **shape: int
) -> tuple[int, int]:
    """(microbatches, micro_batch) covering `per_replica` samples with the cheapest step, each
    micro-batch holding at most `max_micro_batch` samples."""
    lo = max(1, ceil_div(per_replica, max_micro_batch))
    best: tuple[float, int, int] | None = None
    for m in range(lo, max(lo, per_replica) + 1):
        b = ceil_div(per_replica, m)
        if b > max_micro_batch:
            continue
        c = spmd_step_cost(prof, hw, microbatches=m, micro_batch=b, **shape).total_s
        if best is None or c < best[0] - 1e-15:
            best = (c, m, b)
    assert best is not None
    return best[1], best[2]


__all__ = [
    "ModelProfile",
    "StepCost",
    "spmd_step_cost",
    "ring_allreduce_s",
    "even_split",
    "ceil_div",
    "best_micro_schedule",
]


# ---------------------------------------------------------------------------------------------
# Pipelines (1F1B). Used by the cluster simulator (`elasjax.sim`) and, later, the pipeline
# planner. A pipeline of S stages with per-micro-batch stage times t_s runs m micro-batches in
#     T = sum_s t_s + (m - 1) * max_s t_s
# (one pass through every stage to fill and drain, then the bottleneck stage paces the rest).
# For equal stages this is the textbook (m + S - 1) * tau, whose bubble fraction is
# (S - 1) / (m + S - 1). The exact form matters for uneven partitions: a fast stage shortens
# the fill/drain but never the steady state. Stage times include the stage's point-to-point
# activation sends; data-parallel gradient sync and the optimizer follow the pipeline.


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a 1F1B pipeline with equal stages: (S - 1) / (m + S - 1)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(
            f"bubble_fraction needs stages >= 1 and microbatches >= 1, got {stages}, {microbatches}"
        )
    return (stages - 1) / (microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class PipelineStepCost:
    """A predicted pipelined step. `pipeline_s` is the 1F1B time of the micro-batches."""

    pipeline_s: float
    bubble_s: float  # time the bottleneck stage is idle: sum of the other stages' times
    dp_sync_s: float
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.pipeline_s + self.dp_sync_s + self.optimizer_s


def pipeline_step_cost(
    stage_times_s,
    microbatches: int,
    *,
    dp_sync_s: float = 0.0,
    optimizer_s: float = 0.0,
) -> PipelineStepCost:
    """1F1B step: `sum(t) + (m - 1) * max(t)` plus gradient sync and optimizer time.

    Args:
        stage_times_s: forward + backward time of one micro-batch on each stage (seconds).
        microbatches: micro-batches this pipeline runs in the step (0: the pipeline is idle).
        dp_sync_s: data-parallel gradient reduction after the pipeline drains (not overlapped).
        optimizer_s: optimizer update time.
    """
    times = [float(t) for t in stage_times_s]
    if not times or any(t < 0 for t in times):
        raise ValueError(f"stage_times_s must be non-empty and >= 0, got {times}")
    if microbatches < 0:
        raise ValueError(f"microbatches must be >= 0, got {microbatches}")
    if microbatches == 0:
        return PipelineStepCost(0.0, 0.0, dp_sync_s, optimizer_s)
    slowest = max(times)
    pipe = sum(times) + (microbatches - 1) * slowest
    return PipelineStepCost(pipe, sum(times) - slowest, dp_sync_s, optimizer_s)


__all__ += ["bubble_fraction", "PipelineStepCost", "pipeline_step_cost"]


def pipelined_plan_cost(
    prof: ModelProfile,
    hw: HardwareConfig,
    *,
    data: int,
    stage: int,
    tensor: int,
    microbatches: int,
    micro_batch: int,
    partition: tuple[int, ...],
) -> StepCost:
    """Cost of one GPipe step of a data x stage x tensor plan with layer `partition`.

    Stage time per micro-batch: its layers' FLOPs at `hw.flops` over `tensor` devices, their
    tensor-parallel all-reduces, and the activation send to the next stage; the embedding runs on
    the first stage and the LM head on the last. The pipeline takes `sum(t) + (m - 1) max(t)`
    (`pipeline_step_cost`); the data-parallel all-reduce of the largest stage's gradients
    follows. Memory: the largest stage's state plus GPipe's activations of all micro-batches.
    """
    tokens = micro_batch * prof.seq_len
    act_bytes = tokens * prof.d_model * 4
    layer_t = (
        tokens * prof.flops_per_token_layer / tensor / hw.flops
        + 4 * ring_allreduce_s(act_bytes, tensor, hw)
    )
    head_t = tokens * prof.flops_per_token_embed / tensor / hw.flops
    send_t = act_bytes / hw.link_bw + hw.link_latency_s
    times = [n * layer_t + (send_t if i < stage - 1 else 0.0) for i, n in enumerate(partition)]
    times[-1] += head_t
    stage_params = max(partition) * prof.params_per_layer + prof.params_embed
    sync = ring_allreduce_s(stage_params * prof.bytes_per_param / tensor, data, hw)
    pc = pipeline_step_cost(times, microbatches, dp_sync_s=sync)
    overhead = (microbatches + stage - 1) * hw.micro_overhead_s
    state = 5 * stage_params * prof.bytes_per_param / tensor
    acts = microbatches * act_bytes * 16 * max(partition) / tensor
    return StepCost(pc.pipeline_s, 0.0, sync, overhead, state + acts, pc.bubble_s)


__all__ += ["pipelined_plan_cost"]
