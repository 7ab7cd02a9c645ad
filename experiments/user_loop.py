"""The training loop a JAX/Flax user writes for elasjax's GPT: `bench_scale.py`'s `plain JAX` rows.

It takes from elasjax only the model, `elasjax.models.gpt` (the flax module `GPT`, its
`init_params` and its parameters' logical axis names, `logical_specs`), and reads sizes and
hyper-parameters off the run's config. Everything else is written out below as a user writes
it, with none of elasjax's step, loss, data, state, optimizer or placement code:

- a `Mesh` of the devices as (data, tensor), and the logical -> mesh axis rules (the layout
  elasjax uses: heads, MLP and vocabulary over `tensor`, the batch over `data`);
- ZeRO by annotation, nothing else: ZeRO-0 lays the optimizer state out like its parameters,
  ZeRO-1 splits it over `data` too (on the first dimension `data` divides that is not split
  yet), ZeRO-3 the parameters as well; XLA inserts the collectives;
- optax's AdamW after global-norm clipping, with elasjax's built-in optimizer's settings;
- the loss: the model's logits, `softmax_cross_entropy_with_integer_labels`, the mean over the
  step's tokens, accumulated over micro-batches by a `lax.scan` of `value_and_grad`;
- dropout keys per sample: `fold_in(fold_in(key(seed), step), global sample index)`;
- batches of random tokens from numpy, placed with `device_put` over `data`.

What it deliberately does not have (elasjax's step and loop do): per-sample weights and loss
normalisers, sharding constraints inside the step, a ZeRO storage layout of its own, a gradient
norm metric, state checksums, snapshots, failure handling. `bench_scale.py --check` runs this
step and elasjax's on the same parameters and batches and compares them.

With `elastic=True` (bench_scale's `plain JAX ZeRO-1 undonated + ElasticState`) the same loop
also hands each step's state to `elasjax.ElasticState.commit`, as a user of elasjax's pieces
does: that row measures what the pieces cost a loop that is otherwise the user's own.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elasjax.models import gpt

# the model's logical axes -> mesh axes (None: replicated)
RULES = (
    ("batch", "data"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", None),
    ("sequence", None),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("microbatch", None),
)


def make_mesh(data: int = 4, tensor: int = 2) -> Mesh:
    return Mesh(np.array(jax.devices()[: data * tensor]).reshape(data, tensor), ("data", "tensor"))


def make_optimizer(t) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay, after global-norm clipping (`t`: the config's
    `train` section)."""
    lr = optax.warmup_cosine_decay_schedule(
        0.0, t.lr, max(t.warmup_steps, 1), max(t.steps, t.warmup_steps + 1), t.lr * 0.1
    )
    clip = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    return optax.chain(*clip, optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=t.weight_decay))


def over_data(sh: NamedSharding, shape) -> NamedSharding:
    """`sh` also split over `data`, on the first dimension not split yet that `data` divides."""
    spec = list(sh.spec) + [None] * (len(shape) - len(sh.spec))
    for i, n in enumerate(shape):
        if spec[i] is None and n % sh.mesh.shape["data"] == 0:
            spec[i] = "data"
            return NamedSharding(sh.mesh, P(*spec))
    return sh


def init_state(cfg, tx) -> dict:
    params = gpt.init_params(cfg.model, jax.random.key(cfg.train.seed))
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt": tx.init(params)}


def state_shardings(cfg, mesh: Mesh, tx, zero: int) -> dict:
    """The state's shardings for ZeRO stage `zero` (0, 1 or 3)."""
    params = nn.logical_to_mesh_sharding(gpt.logical_specs(cfg.model), mesh, RULES)
    shapes = jax.eval_shape(functools.partial(init_state, cfg, tx))
    split = jax.tree.map(lambda s, a: over_data(s, a.shape), params, shapes["params"])
    rep = NamedSharding(mesh, P())
    opt = optax.tree_map_params(  # Adam's moments like their parameters, the rest replicated
        tx, lambda _, s: s, shapes["opt"], split if zero >= 1 else params,
        transform_non_params=lambda _: rep,
    )
    return {"step": rep, "params": split if zero >= 3 else params, "opt": opt}


def make_step(cfg, tx):
    model = gpt.GPT(cfg.model)
    m = cfg.train.microbatches
    root = jax.random.key(cfg.train.seed)

    def loss_sum(params, inputs, targets, keys):
        logits = model.apply({"params": params}, inputs, keys, deterministic=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()

    def step(state, batch):
        B, T = batch["inputs"].shape
        step_key = jax.random.fold_in(root, state["step"])
        sample_ids = state["step"] * B + jnp.arange(B)  # global sample indices
        keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(sample_ids)

        def micro(x):
            # [B, ...] -> [m, B/m, ...]: micro-batch k is every m-th sample from k, so each
            # device's samples stay on it (a plain reshape makes XLA all-gather the batch)
            return x.reshape(B // m, m, *x.shape[1:]).swapaxes(0, 1)

        def add(acc, mb):
            loss, grads = jax.value_and_grad(loss_sum)(state["params"], *mb)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state["params"]))
        (loss, grads), _ = jax.lax.scan(
            add, zeros, (micro(batch["inputs"]), micro(batch["targets"]), micro(keys))
        )
        grads = jax.tree.map(lambda g: g / (B * T), grads)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"step": state["step"] + 1, "params": params, "opt": opt}, loss / (B * T)

    return step


def make_batch(cfg, step: int) -> dict:
    B, T = cfg.train.global_batch, cfg.model.seq_len
    tokens = np.random.default_rng([cfg.data.seed, step]).integers(
        0, cfg.model.vocab_size, (B, T + 1), dtype=np.int32
    )
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


class UserLoop:
    """The loop, compiled once per run length (the learning-rate schedule depends on it):
    `cfgs` maps a run length to its config. `zero`: 0, 1 or 3; `donate`: donate the state;
    `elastic`: the loop also hands each step's state to elasjax's `ElasticState.commit` (its
    checksums and snapshots, hosts of 2 devices), as `docs/api.md` tells a user of the pieces
    to."""

    def __init__(self, cfgs: dict, zero: int = 1, donate: bool = True, mesh: Mesh | None = None,
                 elastic: bool = False):
        self.runs = {n: self._build(cfg, zero, donate, mesh, elastic) for n, cfg in cfgs.items()}

    @staticmethod
    def _build(cfg, zero: int, donate: bool, mesh: Mesh | None, elastic: bool = False) -> dict:
        mesh = mesh or make_mesh(cfg.parallel.data, cfg.parallel.tensor)
        tx = make_optimizer(cfg.train)
        state_sh = state_shardings(cfg, mesh, tx, zero)
        batch_sh = NamedSharding(mesh, P("data"))
        tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len), jnp.int32)
        t0 = time.perf_counter()
        train = jax.jit(
            make_step(cfg, tx), in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, NamedSharding(mesh, P())),
            donate_argnums=0 if donate else (),
        ).lower(jax.eval_shape(functools.partial(init_state, cfg, tx)),
                {"inputs": tokens, "targets": tokens}).compile()
        compile_s = time.perf_counter() - t0
        init = jax.jit(functools.partial(init_state, cfg, tx), out_shardings=state_sh)
        es = None
        if elastic:
            import elasjax  # only here: the rest of this loop uses none of elasjax's code

            es = elasjax.ElasticState(init(), lambda m: state_shardings(cfg, m, tx, zero), mesh,
                                      devices_per_host=2)
        return {"cfg": cfg, "train": train, "compile_s": compile_s, "init": init,
                "state_sh": state_sh, "batch_sh": batch_sh, "elastic": es}

    def wall(self, steps: int) -> float:
        """Seconds for a whole run of `steps` steps (`timed_run`)."""
        r = self.runs[steps]
        train, es = r["train"], r["elastic"]
        if es is not None:
            done = iter(range(steps))

            def train(state, batch):
                state, loss = r["train"](state, batch)
                es.commit(state, next(done))
                return state, loss

        return timed_run(r["init"], train,
                         lambda s: jax.device_put(make_batch(r["cfg"], s), r["batch_sh"]), steps)

    @property
    def compile_s(self) -> float:
        return max(r["compile_s"] for r in self.runs.values())

    def memory(self) -> dict:
        return memory_mb(next(iter(self.runs.values()))["train"])


def timed_run(init, train, batch_at, steps: int) -> float:
    """Seconds for a whole run of `steps` steps: a fresh state (`init()`), each step's batch
    built and placed (`batch_at(step)`), `train(state, batch) -> (state, loss)`, the losses
    read two steps late."""
    t0 = time.perf_counter()
    state = init()
    pending = []
    for s in range(steps):
        state, loss = train(state, batch_at(s))
        pending.append(loss)
        if len(pending) > 2:
            float(pending.pop(0))
    [float(x) for x in pending]
    jax.block_until_ready(state)
    return time.perf_counter() - t0


def memory_mb(compiled) -> dict:
    """XLA's per-device bytes of a compiled program, in MB."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return {"args_mb": m.argument_size_in_bytes / 2**20,
            "out_mb": m.output_size_in_bytes / 2**20,
            "temp_mb": m.temp_size_in_bytes / 2**20,
            "alias_mb": m.alias_size_in_bytes / 2**20}
