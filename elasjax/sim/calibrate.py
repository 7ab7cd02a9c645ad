"""Per-layer compute of the real elasjax GPT, measured with JAX on this machine's CPU.

This is the simulator's only measured input, and it is optional: the simulator itself is pure
numpy and imports nothing from here. JAX is imported inside the functions, so importing this
module is free.

Method: time `jax.jit(jax.grad(loss))` of `elasjax.models.gpt` (forward + backward, one
micro-batch, dropout off, one device) for two or more layer counts, take the fastest of `reps`
timed calls after a warm-up (round-robin over the depths, so load from other processes on a
shared machine affects every depth alike), and fit `time = base + n_layers * per_layer` by
least squares. The intercept is the embedding, head and loss; the slope is one transformer
block. `load_or_measure` caches results as JSON keyed by the dimensions, micro-batch, layer
counts and machine, so a second run does not re-measure (delete the file to re-measure).

Rejected alternative: timing a single model and dividing by its layer count, which folds the
embedding and head into the per-layer figure and overstates it for shallow models.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .workload import GptDims


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured fwd+bwd times of the real GPT on one CPU device."""

    dims: GptDims  # n_layers is ignored: `layers` lists the measured depths
    micro_batch: int
    layers: tuple[int, ...]
    step_s: tuple[float, ...]  # fastest time per depth
    per_layer_s: float
    base_s: float
    backend: str

    @property
    def flops_per_layer(self) -> float:
        return self.dims.block_flops_per_token() * self.dims.seq_len * self.micro_batch

    @property
    def achieved_flops(self) -> float:
        """FLOP/s of one block on this CPU, by the simulator's FLOP count."""
        return self.flops_per_layer / self.per_layer_s

    def predict(self, n_layers: int) -> float:
        return self.base_s + n_layers * self.per_layer_s

    def describe(self) -> str:
        d = self.dims
        return (
            f"per-layer compute calibrated on this machine's CPU ({self.backend}): "
            f"{self.per_layer_s * 1e3:.2f} ms/layer fwd+bwd (+{self.base_s * 1e3:.2f} ms "
            f"embedding/head/loss) for dims d_model={d.d_model} heads={d.n_heads} "
            f"d_mlp={d.d_mlp} vocab={d.vocab_size} seq={d.seq_len}, micro-batch "
            f"{self.micro_batch}; {self.achieved_flops / 1e9:.1f} GFLOP/s by the FLOP model"
        )


def _model_config(dims: GptDims, n_layers: int):
    from ..config import ModelConfig

    return ModelConfig(
        vocab_size=dims.vocab_size, seq_len=dims.seq_len, d_model=dims.d_model,
        n_heads=dims.n_heads, n_layers=n_layers, d_mlp=dims.d_mlp, dropout=0.0, remat="none",
    )


def grad_step(dims: GptDims, n_layers: int, micro_batch: int) -> Callable[[], None]:
    """A compiled, warmed-up forward + backward of the GPT on one device; each call runs one
    step and blocks until it is done."""
    import jax
    import jax.numpy as jnp

    from ..models import gpt

    cfg = _model_config(dims, n_layers)
    dev = jax.devices()[0]
    params = jax.device_put(gpt.init_params(cfg, jax.random.key(0)), dev)
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(1), (micro_batch, dims.seq_len + 1), 0,
                           dims.vocab_size), dev)
    keys = jax.random.split(jax.random.key(2), micro_batch)

    def loss(p, tok):
        return jnp.mean(gpt.token_losses(p, cfg, tok[:, :-1], tok[:, 1:], keys, True))

    grad = jax.jit(jax.grad(loss))
    jax.block_until_ready(grad(params, tokens))  # compile + warm-up

    def run() -> None:
        jax.block_until_ready(grad(params, tokens))

    return run


def interleaved_times(fns: Sequence[Callable[[], None]], reps: int) -> list[float]:
    """Fastest of `reps` timed calls of each callable, timed round-robin so that load changes
    on a shared machine hit every callable alike. The minimum, not the median: contention from
    other processes only ever adds time, so the fastest run is the least biased estimate."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [float(np.min(t)) for t in times]


def fit(dims: GptDims, micro_batch: int, layers: Sequence[int], step_s: Sequence[float]
        ) -> Calibration:
    """Least-squares `time = base + n_layers * per_layer` over the measured depths."""
    import jax

    if len(set(layers)) < 2:
        raise ValueError(f"layers must hold at least two distinct depths, got {layers}")
    slope, intercept = np.polyfit(np.asarray(layers, dtype=float), np.asarray(step_s), 1)
    backend = f"jax {jax.__version__} {jax.default_backend()} on {platform.machine()}"
    return Calibration(dims, micro_batch, tuple(int(n) for n in layers),
                       tuple(float(t) for t in step_s), float(slope), float(intercept), backend)


def measure(
    dims: GptDims, micro_batch: int, layers: Sequence[int] = (2, 4), reps: int = 7
) -> Calibration:
    """Time the GPT at each depth in `layers` (interleaved) and fit base + n * per_layer."""
    if len(set(layers)) < 2:
        raise ValueError(f"layers must hold at least two distinct depths, got {layers}")
    fns = [grad_step(dims, n, micro_batch) for n in layers]
    return fit(dims, micro_batch, layers, interleaved_times(fns, reps))


def load_or_measure(
    cache: str | Path | None,
    dims: GptDims,
    micro_batch: int,
    layers: Sequence[int] = (2, 4),
    reps: int = 7,
) -> tuple[Calibration, bool]:
    """The cached calibration for these inputs, or a fresh measurement (then cached).

    Returns (calibration, came_from_cache)."""
    key = json.dumps({"dims": dataclasses.asdict(dims), "b": micro_batch,
                      "layers": list(layers), "machine": platform.machine()}, sort_keys=True)
    path = Path(cache) if cache is not None else None
    if path is not None and path.exists():
        stored = json.loads(path.read_text())
        if key in stored:
            c = stored[key]
            return Calibration(GptDims(**c["dims"]), c["micro_batch"], tuple(c["layers"]),
                               tuple(c["step_s"]), c["per_layer_s"], c["base_s"],
                               c["backend"]), True
    cal = measure(dims, micro_batch, layers, reps)
    if path is not None:
        stored = json.loads(path.read_text()) if path.exists() else {}
        stored[key] = dataclasses.asdict(cal)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(stored, indent=1))
    return cal, False


__all__ = ["Calibration", "grad_step", "interleaved_times", "fit", "measure", "load_or_measure"]
