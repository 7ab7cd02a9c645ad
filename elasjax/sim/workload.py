"""What one micro-batch costs, item by item: the simulator's view of a GPT-like model.

The model is a list of partitionable items: the embedding, `n_layers` transformer blocks and the
head (final norm, output projection and loss). For each item and one micro-batch on one
tensor-parallel group at the nominal clock the workload states

- `tc`: compute time that scales with the clock (FLOPs / (tensor * peak * MFU), minus the
  memory-bound share),
- `tm`: time that does not scale (the memory-bound share, tensor-parallel all-reduces),
- parameters (for migration bytes, gradient sync and memory) and activation bytes.

FLOP counts match `elasjax.models.costmodel.ModelProfile` (6 FLOPs per parameter per token plus
attention scores), so the planner and the simulator rank layouts with the same model.
Activation memory per block uses Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", Table 2) with sequence parallelism and selective recomputation:
`s * b * h * 34 / t` bytes; 1F1B keeps at most `S` micro-batches in flight on a stage (bounded
above by the first stage), which the memory check uses for every stage (conservative).

The alternative of profiling every item on the target hardware is what a production system
does; here the target hardware is not available, so costs are computed from stated FLOP/s and
bandwidths and only the CPU-scale numbers are measured (`calibrate.py`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..config import HardwareConfig
from ..models.costmodel import ring_allreduce_s
from .hardware import Device

BYTES_PARAM = 2  # bf16 parameters
BYTES_GRAD = 2  # bf16 gradients
BYTES_OPT = 12  # fp32 master copy + Adam m, v (ZeRO-1: sharded over the data-parallel group)


@dataclasses.dataclass(frozen=True)
class GptDims:
    """Dimensions of a decoder-only GPT (two-matrix MLP, untied head)."""

    n_layers: int = 32
    d_model: int = 4096
    n_heads: int = 32
    d_mlp: int = 16384
    vocab_size: int = 50304
    seq_len: int = 2048

    @property
    def block_params(self) -> int:
        d, f = self.d_model, self.d_mlp
        return 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.d_model + self.seq_len * self.d_model

    @property
    def head_params(self) -> int:
        return self.d_model * self.vocab_size + 2 * self.d_model

    @property
    def n_params(self) -> int:
        return self.n_layers * self.block_params + self.embed_params + self.head_params

    def block_flops_per_token(self) -> float:
        """Forward + backward FLOPs of one block per token (as `costmodel.ModelProfile`)."""
        d, f, t = self.d_model, self.d_mlp, self.seq_len
        return 6.0 * (4 * d * d + 2 * d * f) + 6.0 * 2 * t * d

    def head_flops_per_token(self) -> float:
        return 6.0 * self.d_model * self.vocab_size

    def flops_per_token(self) -> float:
        return self.n_layers * self.block_flops_per_token() + self.head_flops_per_token()


@dataclasses.dataclass(frozen=True)
class Workload:
    """Per-item costs of one micro-batch on one tensor-parallel group at the nominal clock.

    Items are `[embed, block_0 .. block_{L-1}, head]`. Times are seconds; bytes per device
    unless the name says otherwise.
    """

    dims: GptDims
    tensor: int
    micro_batch: int
    tc: tuple[float, ...]
    tm: tuple[float, ...]
    params: tuple[int, ...]  # parameters of each item (all tensor shards together)
    act_bytes: tuple[float, ...]  # activation bytes per device per in-flight micro-batch
    p2p_s: float  # one stage's activation send + gradient send per micro-batch
    inter_host_bw: float
    link_latency_s: float

    @property
    def n_items(self) -> int:
        return len(self.tc)

    @property
    def tokens_per_micro(self) -> int:
        return self.micro_batch * self.dims.seq_len

    def cost(self) -> np.ndarray:
        """[items] time at the nominal clock."""
        return np.asarray(self.tc) + np.asarray(self.tm)

    def grad_bytes(self) -> np.ndarray:
        """[items] gradient bytes per device (one tensor shard)."""
        return np.asarray(self.params, dtype=np.float64) * BYTES_GRAD / self.tensor

    def state_bytes(self, data: int) -> np.ndarray:
        """[items] parameter + gradient + ZeRO-1 optimizer bytes per device."""
        p = np.asarray(self.params, dtype=np.float64) / self.tensor
        return p * (BYTES_PARAM + BYTES_GRAD + BYTES_OPT / max(data, 1))

    def move_bytes(self, data: int) -> np.ndarray:
        """[items] bytes a tensor group receives when an item moves to it in one pipeline:
        the bf16 parameters and its ZeRO-1 optimizer chunk (all tensor shards together)."""
        return np.asarray(self.params, dtype=np.float64) * (BYTES_PARAM + BYTES_OPT / max(data, 1))

    def layer_mem(self, data: int, inflight: int) -> np.ndarray:
        """[items] memory per device with `inflight` micro-batches of activations held."""
        return self.state_bytes(data) + np.asarray(self.act_bytes) * inflight

    def stage_sums(self, sizes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-stage (tc, tm, grad bytes per device) for contiguous `sizes`; tm includes the
        point-to-point sends when there is more than one stage."""
        owner = np.repeat(np.arange(len(sizes)), sizes)
        tc = np.bincount(owner, weights=np.asarray(self.tc), minlength=len(sizes))
        tm = np.bincount(owner, weights=np.asarray(self.tm), minlength=len(sizes))
        if len(sizes) > 1:
            tm = tm + self.p2p_s
        gb = np.bincount(owner, weights=self.grad_bytes(), minlength=len(sizes))
        return tc, tm, gb

    def dp_sync_s(self, grad_bytes_per_device: float, participants: int) -> float:
        """Ring all-reduce of one stage's gradients over the data-parallel group."""
        hw = HardwareConfig(link_bw=self.inter_host_bw, link_latency_s=self.link_latency_s)
        return ring_allreduce_s(grad_bytes_per_device, participants, hw)

    def flops_per_sample(self) -> float:
        return self.dims.flops_per_token() * self.dims.seq_len


def build_workload(dims: GptDims, device: Device, tensor: int, micro_batch: int) -> Workload:
    """Item costs of `dims` on `device` with tensor degree `tensor` and `micro_batch` samples."""
    if tensor < 1 or micro_batch < 1:
        raise ValueError(f"tensor and micro_batch must be >= 1, got {tensor}, {micro_batch}")
    tokens = micro_batch * dims.seq_len
    rate = tensor * device.peak_flops * device.mfu
    block = dims.block_flops_per_token() * tokens / rate
    head = dims.head_flops_per_token() * tokens / rate
    compute = np.array([0.0] + [block] * dims.n_layers + [head])
    act = tokens * dims.d_model * BYTES_PARAM  # one activation tensor of the micro-batch
    tp_hw = HardwareConfig(link_bw=device.intra_host_bw, link_latency_s=device.link_latency_s)
    # Megatron TP: 2 all-reduces forward + 2 backward per block per micro-batch.
    tp = 4 * ring_allreduce_s(act, tensor, tp_hw)
    tm = compute * device.mem_fraction + np.array([0.0] + [tp] * dims.n_layers + [0.0])
    tc = compute * (1.0 - device.mem_fraction)
    params = [dims.embed_params] + [dims.block_params] * dims.n_layers + [dims.head_params]
    sbh = tokens * dims.d_model
    acts = [2.0 * sbh / tensor] + [34.0 * sbh / tensor] * dims.n_layers
    acts += [4.0 * tokens * dims.vocab_size / tensor]  # fp32 logits shard
    # Pipeline sends: each tensor rank sends its 1/t slice of the activation (scatter-gather),
    # forward, and receives the gradient of the same size backward, over the inter-host link.
    p2p = 2 * (act / tensor / device.inter_host_bw + device.link_latency_s)
    return Workload(
        dims=dims, tensor=tensor, micro_batch=micro_batch,
        tc=tuple(float(x) for x in tc), tm=tuple(float(x) for x in tm),
        params=tuple(int(p) for p in params), act_bytes=tuple(float(a) for a in acts),
        p2p_s=float(p2p), inter_host_bw=device.inter_host_bw,
        link_latency_s=device.link_latency_s,
    )


def workload_from_costs(
    dims: GptDims,
    layer_s: float,
    base_s: float,
    device: Device,
    micro_batch: int,
) -> Workload:
    """A single-device workload from measured costs: `layer_s` per block and `base_s` for the
    embedding + head + loss (put on the head item). Used to predict CPU runs."""
    n = dims.n_layers
    tc = (0.0,) + (float(layer_s),) * n + (float(base_s),)
    params = [dims.embed_params] + [dims.block_params] * n + [dims.head_params]
    return Workload(
        dims=dims, tensor=1, micro_batch=micro_batch, tc=tc, tm=(0.0,) * (n + 2),
        params=tuple(params), act_bytes=(0.0,) * (n + 2), p2p_s=0.0,
        inter_host_bw=device.inter_host_bw, link_latency_s=device.link_latency_s,
    )


__all__ = ["GptDims", "Workload", "build_workload", "workload_from_costs"]
