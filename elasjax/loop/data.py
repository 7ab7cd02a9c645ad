"""Deterministic, step-indexed global batches, independent of the mesh.

Step `s` of a run with global batch `B` consumes the global sample ids `s*B .. s*B+B-1`; a
global id maps to a training window through a per-epoch permutation seeded by `data.seed`. That
is a function of (seed, step) only, so a run with failures feeds exactly the fault-free run's
samples at every step, whatever the plan. `layout_batch` then places the step's samples into a
plan's slots (weight-0 padding where the plan has more slots than samples).

The examples come from the model's `DataSource` (`ModelSpec.data`): for the GPT, token windows
(`elasjax.models.text_data`).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from .. import models
from ..config import DataConfig, ModelConfig, RngConfig
from ..plan.planner import Plan


def global_sample_ids(step: int, global_batch: int) -> np.ndarray:
    """The global sample ids of a step: a function of (step, B) only."""
    ids = step * global_batch + np.arange(global_batch, dtype=np.int64)
    if ids[-1] >= 2**32:
        raise OverflowError("global sample ids exceed 2**32; they are folded into uint32 keys")
    return ids


class Sampler:
    """Global sample id -> dataset window index, via one seeded permutation per epoch."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def __call__(self, gids: np.ndarray) -> np.ndarray:
        out = np.empty_like(gids)
        epochs = gids // self.n
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[gids[sel] % self.n]
        return out


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """One step's batch laid out for a plan: arrays [microbatches, data * micro_batch, ...]."""

    fields: dict[str, np.ndarray]  # the model's example arrays, [m, D*b, ...]; 0 in padding
    weights: np.ndarray  # f32 [m, D*b]; 1 = real sample, 0 = padding
    key_ids: np.ndarray  # uint32 [m, D*b]; the id folded into the sample's RNG key
    sample_ids: np.ndarray  # int64 [m, D*b]; global sample id, -1 = padding
    counts: np.ndarray  # f32 [m, D*b]; each sample's share of the loss normaliser

    @property
    def inputs(self) -> np.ndarray:
        return self.fields["inputs"]

    @property
    def targets(self) -> np.ndarray:
        return self.fields["targets"]

    def arrays(self) -> dict[str, np.ndarray]:
        return {**self.fields, "weights": self.weights, "key_ids": self.key_ids, "counts": self.counts}

    def columns(self, cols: np.ndarray) -> "HostBatch":
        """These sample columns only (every micro-batch)."""
        return HostBatch(
            {k: v[:, cols] for k, v in self.fields.items()}, self.weights[:, cols],
            self.key_ids[:, cols], self.sample_ids[:, cols], self.counts[:, cols],
        )


def layout_batch(
    examples: dict[str, np.ndarray], counts: np.ndarray, gids: np.ndarray, plan: Plan,
    rng: RngConfig,
) -> HostBatch:
    """Place a step's B examples (with their global ids and normaliser counts) into the plan's
    slots."""
    pos = plan.slot_positions()
    real = pos >= 0
    safe = np.where(real, pos, 0)
    fields = {}
    for k, v in examples.items():
        a = v[safe]
        a[~real] = 0
        fields[k] = a
    sample_ids = np.where(real, gids[safe], -1)
    if rng.mode == "per_sample":
        key_ids = np.where(real, gids[safe], 0).astype(np.uint32)
    else:  # per_device: the slot's position on the mesh, replica-major
        m, Db = pos.shape
        b = plan.micro_batch
        k = np.arange(m)[:, None]
        r, j = np.divmod(np.arange(Db)[None, :], b)
        key_ids = (r * m * b + k * b + j).astype(np.uint32)
    return HostBatch(
        fields=fields,
        weights=real.astype(np.float32),
        key_ids=key_ids,
        sample_ids=sample_ids,
        counts=np.where(real, np.asarray(counts, np.float32)[safe], 0.0).astype(np.float32),
    )


class DataPipeline:
    """Step -> global batch for a plan, and fixed validation batches."""

    def __init__(self, cfg: DataConfig, model: ModelConfig, rng: RngConfig, global_batch: int):
        self.spec = models.get(model)
        self.source = self.spec.data(cfg)
        self.sampler = Sampler(self.source.n_train, cfg.seed)
        self.rng, self.global_batch = rng, global_batch

    def _layout(self, idx: np.ndarray, gids: np.ndarray, plan: Plan, split: str) -> HostBatch:
        ex = self.source.examples(idx, split)
        return layout_batch(ex, self.spec.count(ex), gids, plan, self.rng)

    def step_ids(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(global sample ids, dataset window indices) of a step."""
        gids = global_sample_ids(step, self.global_batch)
        return gids, self.sampler(gids)

    def batch(self, step: int, plan: Plan) -> HostBatch:
        gids, idx = self.step_ids(step)
        return self._layout(idx, gids, plan, "train")

    def eval_batch(self, i: int, plan: Plan) -> HostBatch:
        B = self.global_batch
        idx = (np.arange(B, dtype=np.int64) + i * B) % self.source.n_val
        return self._layout(idx, idx, plan, "val")

    @staticmethod
    def digest(idx: np.ndarray) -> str:
        """Short digest of a step's dataset indices, written to metrics for comparisons."""
        return f"{zlib.crc32(np.ascontiguousarray(idx, dtype=np.int64).tobytes()):08x}"
