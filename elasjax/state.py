"""TrainState, the optimizer, and state built shape-first onto any plan's mesh.

`abstract = eval_shape(init)` -> `shardings(abstract, mesh)` -> `jit(init, out_shardings)`: the
same functions give the fresh state, the restore target of a checkpoint on a new mesh and the
target layout of a transition, so resharding after a failure is not a special code path.
Initial values depend on `train.seed` only (threefry is partitionable), never on the mesh.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from . import models
from .config import Config, TrainConfig
from .rng import root_key
from .sharding import named_shardings, opt_state_logical

PyTree = Any


@flax.struct.dataclass
class TrainState:
    """Only arrays: the step counter, parameters and optimizer state."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay, after global-norm clipping."""
    sched = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=max(t.warmup_steps, 1),
        decay_steps=max(t.steps, t.warmup_steps + 1),
        end_value=t.lr * 0.1,
    )
    parts = []
    if t.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(t.grad_clip))
    parts.append(optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=t.weight_decay))
    return optax.chain(*parts)


class StateFactory:
    """Builds abstract, logical and concrete train states for a config and optimizer."""

    def __init__(self, cfg: Config, tx: optax.GradientTransformation):
        self.cfg, self.tx = cfg, tx
        self.model = models.get(cfg.model.type)
        self.abstract = jax.eval_shape(self._init)
        param_logical = self.model.logical_specs(cfg.model)
        self.logical = TrainState(
            step=PartitionSpec(),
            params=param_logical,
            opt_state=opt_state_logical(tx, self.abstract.opt_state, param_logical),
        )

    def _init(self) -> TrainState:
        key = jax.random.fold_in(root_key(self.cfg.train.seed), 0x1A17)
        params = self.model.init_params(self.cfg.model, key)
        return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params))

    def shardings(self, mesh: Mesh) -> TrainState:
        return named_shardings(self.abstract, self.logical, mesh)

    def abstract_on(self, mesh: Mesh) -> TrainState:
        """Abstract state carrying the target shardings (restore targets)."""
        sh = self.shardings(mesh)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract, sh
        )

    def init(self, mesh: Mesh) -> TrainState:
        return jax.jit(self._init, out_shardings=self.shardings(mesh))()

    @property
    def n_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.abstract.params))
