"""The pure train and eval steps, and their executables for one plan.

`train_step(state, batch) -> (state, metrics)` is a pure function of its inputs; the plan only
fixes shapes and shardings. Executables are built ahead of time (`lower(...).compile()`) with
explicit in/out shardings and the state donated, once per plan; recovery measures exactly that
compile as its `compile_s` phase.

Every step also returns the checksums of the state it produced (`checksum.tree_checksums`,
computed on device in the same executable), so the host always holds the checksums of the last
good state: recovery verifies the rebuilt state against them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import checksum, rng
from .config import Config
from .mesh import LOGICAL_RULES, make_mesh, replicated
from .microbatch import accumulate
from .planner import Plan
from .sharding import batch_shardings
from .state import StateFactory, TrainState

PyTree = Any


def abstract_batch(plan: Plan, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    m, n = plan.microbatches, plan.data * plan.micro_batch
    return {
        "inputs": jax.ShapeDtypeStruct((m, n, seq_len), jnp.int32),
        "targets": jax.ShapeDtypeStruct((m, n, seq_len), jnp.int32),
        "weights": jax.ShapeDtypeStruct((m, n), jnp.float32),
        "key_ids": jax.ShapeDtypeStruct((m, n), jnp.uint32),
    }


def make_loss_fn(cfg: Config, model, deterministic: bool):
    """(params, micro-batch, step key) -> summed weighted token loss."""

    def loss_fn(params, mb, key):
        keys = rng.sample_keys(key, mb["key_ids"])
        tl = model.token_losses(params, cfg.model, mb["inputs"], mb["targets"], keys, deterministic)
        return jnp.sum(tl * mb["weights"][:, None])

    return loss_fn


def make_grad_fn(cfg: Config, model, mesh: Mesh, param_sh):
    """(params, batch, step) -> (loss, gradient) of the whole global batch: summed over
    micro-batches and replicas, divided once by the real tokens of the global batch."""
    loss_fn = make_loss_fn(cfg, model, deterministic=False)
    micro_sh = NamedSharding(mesh, PartitionSpec(LOGICAL_RULES["batch"]))
    seed = cfg.train.seed

    def constrain_micro(mb):
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, micro_sh), mb)

    def constrain_grads(g):
        return jax.lax.with_sharding_constraint(g, param_sh)

    def grad_fn(params, batch, step):
        key = rng.step_key(rng.root_key(seed), step)
        micro_grad = jax.value_and_grad(lambda p, mb: loss_fn(p, mb, key))
        loss_sum, grads = accumulate(
            micro_grad, params, batch, micro_constraint=constrain_micro, grad_constraint=constrain_grads
        )
        n_tokens = jnp.sum(batch["weights"]) * batch["inputs"].shape[-1]
        return loss_sum / n_tokens, jax.tree.map(lambda g: g / n_tokens, grads)

    return grad_fn


def make_train_step(cfg: Config, tx: optax.GradientTransformation, model, mesh: Mesh, param_sh):
    grad_fn = make_grad_fn(cfg, model, mesh, param_sh)

    def train_step(state: TrainState, batch: dict):
        loss, grads = grad_fn(state.params, batch, state.step)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TrainState(state.step + 1, params, opt_state)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "checksums": checksum.tree_checksums(new),
        }
        return new, metrics

    return train_step


def make_eval_step(cfg: Config, model):
    loss_fn = make_loss_fn(cfg, model, deterministic=True)

    def eval_step(params, batch):
        key = rng.root_key(0)
        total = jax.lax.map(lambda mb: loss_fn(params, mb, key), batch).sum()
        return total, jnp.sum(batch["weights"]) * batch["inputs"].shape[-1]

    return eval_step


@dataclasses.dataclass
class Executables:
    """Compiled functions of one plan on one mesh."""

    plan: Plan
    mesh: Mesh
    state_shardings: TrainState
    batch_shardings: dict
    train: Any
    checksum: Any
    eval: Any
    compile_s: float

    def put_batch(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.device_put(v, self.batch_shardings[k]) for k, v in arrays.items()}


def compile_plan(
    cfg: Config, factory: StateFactory, plan: Plan, devices: dict[int, jax.Device]
) -> Executables:
    """AOT-compile the train, eval and checksum functions of `plan`; time it."""
    t0 = time.perf_counter()
    mesh = make_mesh(plan.mesh_shape, [devices[i] for i in plan.device_ids])
    st_sh = factory.shardings(mesh)
    ab = abstract_batch(plan, cfg.model.seq_len)
    b_sh = batch_shardings(mesh, ab)
    abs_state = factory.abstract
    rep = replicated(mesh)
    train_fn = make_train_step(cfg, factory.tx, factory.model, mesh, st_sh.params)
    metric_sh = {
        "loss": rep,
        "grad_norm": rep,
        "checksums": jax.tree.map(lambda _: rep, abs_state),
    }
    train = (
        jax.jit(
            train_fn,
            in_shardings=(st_sh, b_sh),
            out_shardings=(st_sh, metric_sh),
            donate_argnums=0,
        )
        .lower(abs_state, ab)
        .compile()
    )
    sums = (
        jax.jit(checksum.tree_checksums, in_shardings=(st_sh,), out_shardings=metric_sh["checksums"])
        .lower(abs_state)
        .compile()
    )
    # Evaluation is not on the recovery path: it compiles on first use (see `Executables.eval`).
    ev = jax.jit(
        make_eval_step(cfg, factory.model), in_shardings=(st_sh.params, b_sh), out_shardings=(rep, rep)
    )
    return Executables(plan, mesh, st_sh, b_sh, train, sums, ev, time.perf_counter() - t0)


class ExecutableCache:
    """Compiled plans, keyed by what the executables depend on (model and train config, and the
    plan); bounded, least recently used out first. A trainer owns one; pass a shared one to reuse
    executables across runs in one process (tests, experiment sweeps)."""

    def __init__(self, max_entries: int = 16):
        self.max_entries = max_entries
        self._d: dict = {}

    @staticmethod
    def key(cfg: Config, plan: Plan):
        return (cfg.model, cfg.train, plan)

    def get(self, cfg: Config, factory: StateFactory, plan: Plan, devices) -> tuple[Executables, bool]:
        k = self.key(cfg, plan)
        if k in self._d:
            exe = self._d.pop(k)
            self._d[k] = exe
            return exe, True
        exe = compile_plan(cfg, factory, plan, devices)
        self._d[k] = exe
        while len(self._d) > self.max_entries:
            self._d.pop(next(iter(self._d)))
        return exe, False

    def __contains__(self, item) -> bool:
        return item in self._d
