"""The pure train and eval steps, and their executables for one plan.

`train_step(state, batch) -> (state, metrics)` is a pure function of its inputs; the plan only
fixes shapes and shardings. Executables are built ahead of time (`lower(...).compile()`) with
explicit in/out shardings and the state donated, once per plan; recovery measures exactly that
compile as its `compile_s` phase.

Every step also returns the checksums of the state it produced (`StateLayout.stacked_checksums`,
computed on device in the same executable, each element hashed once over the mesh), so the host
always holds the checksums of the last good state: recovery verifies the rebuilt state against
them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..config import Config
from ..core import rng, treesum
from ..core.mesh import DATA, LOGICAL_RULES, replicated
from ..core.microbatch import accumulate
from ..core.sharding import path_str
from ..core.treesum import TreeSum
from ..plan.planner import Plan
from .pipeline import pipeline_loss, pipeline_slot_losses
from .state import StateLayout, TrainState

PyTree = Any


def abstract_batch(plan: Plan, spec) -> dict[str, jax.ShapeDtypeStruct]:
    """The step's batch: the model's example arrays (`ModelSpec.example_shapes`) and the
    trainer's weights, RNG key ids and normaliser counts, each `[micro-batches, samples, ...]`."""
    m, n = plan.microbatches, plan.data * plan.micro_batch
    out = {k: jax.ShapeDtypeStruct((m, n, *a.shape), a.dtype) for k, a in spec.example_shapes.items()}
    out.update(
        weights=jax.ShapeDtypeStruct((m, n), jnp.float32),
        key_ids=jax.ShapeDtypeStruct((m, n), jnp.uint32),
        counts=jax.ShapeDtypeStruct((m, n), jnp.float32),
    )
    return out


def normaliser(batch: dict) -> jax.Array:
    """The step's loss normaliser: the real samples' counts (the GPT: its tokens)."""
    return jnp.sum(batch["weights"] * batch["counts"])


def make_loss_fn(cfg: Config, model, deterministic: bool, layout: StateLayout | None = None,
                 mesh: Mesh | None = None):
    """(params, micro-batch, step key) -> the model's summed weighted loss (`ModelSpec.loss`).
    Under ZeRO-3 `params` is the storage; non-layer parameters are gathered up front and each
    layer inside the layer loop (per device, given the `mesh`)."""
    zero3 = layout is not None and layout.stage == 3

    def loss_fn(params, mb, key):
        keys = rng.sample_keys(key, mb["key_ids"])
        lt = None
        if zero3:
            params, lt = layout.codec.zero3_inputs(params, mesh)
        return model.loss(params, mb, keys, mb["weights"], deterministic, layer_transform=lt)

    return loss_fn


def make_grad_fn(cfg: Config, model, mesh: Mesh, state_sh: TrainState, layout: StateLayout | None = None):
    """(params, batch, step) -> (loss, gradient) of the whole global batch: summed over
    micro-batches and replicas, divided once by the real tokens of the global batch.

    The gradient comes in the optimizer's form: full parameters for ZeRO-0/1, the ZeRO storage
    for ZeRO-2 (each micro-batch's gradient is partitioned before it is accumulated, so the
    accumulator is partitioned) and ZeRO-3 (the gradient of the storage itself)."""
    stage = layout.stage if layout is not None else 0
    if cfg.deterministic:
        summed = _summed_grad_fn(cfg, model, mesh, state_sh, layout)

        def normalised(params, batch, step, plan: Plan):
            loss, grads, n_tokens = summed(params, batch, step, plan)
            return loss, jax.tree.map(lambda g: g / n_tokens, grads)

        return normalised
    if layout is not None and layout.stage_layout is not None:
        return _pipelined_grad_fn(cfg, mesh, layout)
    loss_fn = make_loss_fn(cfg, model, deterministic=False, layout=layout, mesh=mesh)
    if stage == 0:
        return _summed_once_grad_fn(cfg, loss_fn, mesh, state_sh)
    micro_sh = NamedSharding(mesh, PartitionSpec(LOGICAL_RULES["batch"]))
    seed = cfg.train.seed
    if stage == 2:
        acc_sh = jax.tree.map(lambda x: x, layout.codec.storage_shardings(mesh))
        to_acc = functools.partial(layout.codec.to_storage, mesh=mesh)
    else:
        acc_sh, to_acc = state_sh.params, None
    # ZeRO-1: the gradient of a leaf whose storage is annotated (`ZeroCodec.exact_paths`) is
    # left to XLA, which partitions its accumulation as the storage it goes to; constrained
    # whole, every replica would accumulate all of it (1.24x the plain step, RESULTS.md, "The
    # ZeRO-1 step by annotation")
    free = layout.codec.exact_paths if stage == 1 else frozenset()

    def constrain_micro(mb):
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, micro_sh), mb)

    def constrain_grads(g):
        return jax.tree_util.tree_map_with_path(
            lambda p, x, sh: x if path_str(p) in free else jax.lax.with_sharding_constraint(x, sh),
            g, acc_sh)

    def grad_fn(params, batch, step):
        key = rng.step_key(rng.root_key(seed), step)
        micro_grad = jax.value_and_grad(lambda p, mb: loss_fn(p, mb, key))
        loss_sum, grads = accumulate(
            micro_grad,
            params,
            batch,
            micro_constraint=constrain_micro,
            grad_constraint=constrain_grads,
            to_acc=to_acc,
        )
        n_tokens = normaliser(batch)
        return loss_sum / n_tokens, jax.tree.map(lambda g: g / n_tokens, grads)

    return grad_fn


def _summed_once_grad_fn(cfg: Config, loss_fn, mesh: Mesh, state_sh: TrainState):
    """ZeRO-0 outside the deterministic mode: each replica sums its own rows' loss and gradient
    over the micro-batches (a `shard_map` manual over `data`; `tensor` stays automatic), and the
    replicas' sums are added once per step, leaf by leaf (a second `shard_map`, manual over
    every axis, so that each device sums only its own blocks). Left to XLA, with the accumulator
    held whole on every replica, the sum over replicas was taken at every micro-batch, the
    layers' inside the layer loop: the demo's d4t2 step ran 66 cross-replica sums where this
    runs 19, and a CPU collective is one exchange per array (under `elasjax launch`, gloo
    messages between processes of as little as 64 bytes): the demo under launch, median step
    0.45-0.53 s before, 0.26 s after (experiments/RESULTS.md, "Aborts after the process is quiet").

    Two conditions under launch, both in the runtime: the leaves' sums stay apart (XLA's
    all-reduce combiner is off in launch workers, `runtime.startup.ALL_REDUCE_COMBINERS`: joined
    into one all-reduce of arrays of different sizes, a peer's death cost a survivor its life in
    6 of 7 launches of tests/test_user_model.py::
    test_a_registered_model_survives_a_real_process_kill_under_launch), and a survivor shuts its
    sockets down only once it no longer computes (`runtime.aborts`: with the sums at the step's
    end, an abort at the death left a collective posted after it waiting 8 s). Losses stay
    within the consistency contract (tests/test_fault_schedules.py and every default-mode test
    run this path)."""
    seed = cfg.train.seed
    specs = jax.tree.map(lambda sh: sh.spec, state_sh.params)
    for path, spec in jax.tree_util.tree_flatten_with_path(specs)[0]:
        if any(DATA == a or (isinstance(a, tuple) and DATA in a) for a in spec):
            raise ValueError(f"ZeRO-0 parameter {path_str(path)} is partitioned over "
                             f"{DATA!r} ({spec}); ZeRO-0 keeps every parameter whole per replica")
    rep = PartitionSpec(DATA)

    def replica(params, batch, key):
        micro_grad = jax.value_and_grad(lambda p, mb: loss_fn(p, mb, key))
        loss_sum, grads = accumulate(micro_grad, params, batch)
        return loss_sum[None], normaliser(batch)[None], jax.tree.map(lambda g: g[None], grads)

    per_replica = jax.shard_map(
        replica, mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(None, LOGICAL_RULES["batch"]), PartitionSpec()),
        out_specs=(rep, rep, rep), axis_names={DATA}, check_vma=False,
    )

    def add(loss, count, grads):  # every axis manual: each device's own blocks
        totals = jax.lax.psum(jnp.concatenate([loss, count]), DATA)
        return totals[0], totals[1], jax.tree.map(lambda g: jax.lax.psum(g[0], DATA), grads)

    add_replicas = jax.shard_map(
        add, mesh=mesh,
        in_specs=(rep, rep, jax.tree.map(lambda sp: PartitionSpec(DATA, *sp), specs)),
        out_specs=(PartitionSpec(), PartitionSpec(), specs), check_vma=False,
    )

    def grad_fn(params, batch, step):
        key = rng.step_key(rng.root_key(seed), step)
        loss_sum, n_tokens, grads = add_replicas(*per_replica(params, batch, key))
        return loss_sum / n_tokens, jax.tree.map(lambda g: g / n_tokens, grads)

    return grad_fn


def _summed_grad_fn(cfg: Config, model, mesh: Mesh, state_sh: TrainState, layout,
                    in_storage: frozenset[str] = frozenset()):
    """Deterministic mode: (params, batch, step, plan) -> (loss, the gradient's sum over the
    global batch, its normaliser). The division by the normaliser is left to the caller:
    `make_train_step` folds it into the optimizer's one multiply (`_apply_apart`), where a
    division of the whole gradient on its own was an extra pass over it on every replica, its
    divisor broadcast to the gradient's size first (experiments/RESULTS.md, "The dropout masks
    kept")."""
    if layout is not None and layout.stage_layout is not None:
        return _deterministic_pipelined_grad_fn(cfg, mesh, state_sh, layout)
    return _deterministic_grad_fn(cfg, model, mesh, state_sh, layout, in_storage)


def canonical_order(plan: Plan) -> np.ndarray:
    """Flat slot index (k * data + r) of canonical micro-batch 0, 1, ..."""
    slots = plan.canonical_slots()
    order = np.zeros(plan.n_canonical, np.int32)
    for (k, r), c in np.ndenumerate(slots):
        if c >= 0:
            order[c] = k * plan.data + r
    return order


def fixed_order_sum(x: jax.Array, order: np.ndarray, sharding) -> jax.Array:
    """Sum of the per-slot values `x[m, D, ...]` in canonical order (`order[c]` = flat slot of
    canonical micro-batch c), one addition after another: the result does not depend on how
    the slots were laid out. `sharding` is what the gathered `[m*D, ...]` stack may be."""
    x = jax.lax.with_sharding_constraint(x.reshape((-1,) + x.shape[2:]), sharding)
    x = jnp.take(x, jnp.asarray(order), axis=0)
    total, _ = jax.lax.scan(lambda acc, v: (acc + v, None), jnp.zeros_like(x[0]), x)
    return total


def _tree_total(plan: Plan, mesh: Mesh, specs, params, xs, values_of=lambda v: v,
                chunked=None):
    """{"loss", "grads"} summed over the micro-batches in the fixed tree (`treesum`): micro-batch
    k's per-replica values are `values_of(xs[k])` (`xs`: a pytree with a leading axis of m);
    the leaves `chunked` marks come as the replicas' chunks (`TreeSum.finish`)."""
    tree = TreeSum(treesum.schedule(plan.canonical_slots()), mesh, specs)
    like = {"loss": jnp.zeros((), jnp.float32), "grads": params}

    def add(regs, kx):
        k, x = kx
        return tree.step(regs, tree.constrain(values_of(x)), k), None

    m = jax.tree.leaves(xs)[0].shape[0]
    regs, _ = jax.lax.scan(add, tree.init(like), (jnp.arange(m, dtype=jnp.int32), xs))
    return tree.finish(regs, chunked)


def _deterministic_grad_fn(cfg: Config, model, mesh: Mesh, state_sh: TrainState, layout,
                           in_storage: frozenset[str] = frozenset()):
    """Deterministic mode: every canonical micro-batch's summed loss and gradient is computed by
    one replica on its own (a `shard_map` manual over the data axis, so nothing is reduced
    across replicas), and they are added in one fixed binary tree over the canonical indices
    (`treesum`): each replica adds the subtrees it holds whole as its micro-batches come, and
    the nodes spanning replicas are added chunk by chunk on every replica. The result does not
    depend on how many replicas there are or which one ran which micro-batch: runs on different
    meshes are bitwise equal (the tensor degree is kept fixed by the planner). Extra memory: at most
    ceil(log2 K) + 3 gradient-sized registers per device for K canonical micro-batches,
    whatever the replica count (tests/test_deterministic_memory.py measures it).

    The gradient is always summed whole, in parameter form: ZeRO-2 and ZeRO-3 partition it
    after the sum (`make_train_step`), with the same additions as ZeRO-0 and ZeRO-1, and ZeRO-3
    gathers its parameters whole for the step. In this mode their saving is the optimizer
    state (and ZeRO-3's stored parameters), not the gradient's or the step's working memory.

    The leaves named in `in_storage` (`StateLayout.summed_in_storage`) come out as their ZeRO
    storage tier: the tree's cross phase leaves replica r with the sum's elements [r * c, (r +
    1) * c) of each leaf's block, which is what that tier stores, so the sum is not gathered
    whole on every replica only to be cut again (the replicas' parameters are gathered after
    the optimizer, as ZeRO-1 by annotation does). Same bits as the gathered sum: the
    additions are elementwise."""
    loss_fn = make_loss_fn(cfg, model, deterministic=False)
    seed = cfg.train.seed
    D = mesh.shape[DATA]
    per_rep = NamedSharding(mesh, PartitionSpec(DATA))
    zero3 = layout is not None and layout.stage == 3
    param_sh = layout.param_shardings(mesh) if zero3 else state_sh.params
    specs = {"loss": PartitionSpec(), "grads": jax.tree.map(lambda sh: sh.spec, param_sh)}
    chunked = {"loss": False, "grads": jax.tree_util.tree_map_with_path(
        lambda p, _: path_str(p) in in_storage, param_sh)}

    def one(p, mb, key):
        """A replica's canonical micro-batch (its [1, ...] block of the manual `data` axis)."""
        loss, g = jax.value_and_grad(lambda p, m: loss_fn(p, m, key))(
            p, jax.tree.map(lambda x: x[0], mb))
        return loss[None], jax.tree.map(lambda x: x[None], g)

    # each device takes its replica's gradient as a plain `value_and_grad` (manual over `data`
    # only; `tensor` stays automatic): against a `vmap` over the replica axis, whose batched
    # matrix products every device ran on a block of one, the 25.5M model's deterministic step
    # took 3045 ms against 3186 (experiments/RESULTS.md, "Issue 47's first acceptance item
    # again"); the bits differ from the `vmap` form's, not between layouts
    # (tests/test_deterministic_zero.py::test_deterministic_mode_is_bitwise_through_failures)
    per_replica = jax.shard_map(
        one, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(DATA), PartitionSpec()),
        out_specs=(PartitionSpec(DATA), PartitionSpec(DATA)), axis_names={DATA},
        check_vma=False,
    )

    def grad_fn(params, batch, step, plan: Plan):
        if zero3:
            params = jax.lax.with_sharding_constraint(layout.from_storage(params, mesh), param_sh)
        key = rng.step_key(rng.root_key(seed), step)

        def micro(mb):
            mb = jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(
                    x.reshape((D, x.shape[0] // D) + x.shape[1:]), per_rep
                ),
                mb,
            )
            losses, grads = per_replica(params, mb, key)
            return {"loss": losses, "grads": grads}

        total = _tree_total(plan, mesh, specs, params, batch, micro, chunked)
        n_tokens = normaliser(batch)
        return total["loss"] / n_tokens, total["grads"], n_tokens

    return grad_fn


def _deterministic_pipelined_grad_fn(cfg: Config, mesh: Mesh, state_sh: TrainState, layout):
    """Deterministic mode on a pipeline: the gradient is taken with respect to one copy of the
    parameters per (micro-batch, replica) slot (`pipeline_slot_losses(copies=True)`), so every
    canonical micro-batch's gradient comes out on its own; they are added in the fixed tree over
    the canonical indices (`treesum`), as the unpipelined step adds them. Costs one
    gradient-sized buffer per micro-batch slot of a replica on each stage (m of them), and the
    tree's O(log K) registers; neither grows with the replica count."""
    seed = cfg.train.seed
    D = mesh.shape[DATA]
    specs = {"loss": PartitionSpec(), "grads": jax.tree.map(lambda sh: sh.spec, state_sh.params)}

    def spec(sh, *lead):
        return NamedSharding(mesh, PartitionSpec(*lead, *sh.spec))

    def grad_fn(params, batch, step, plan: Plan):
        key = rng.step_key(rng.root_key(seed), step)
        m = batch["weights"].shape[0]
        copies = jax.tree.map(
            lambda x, sh: jax.lax.with_sharding_constraint(
                jnp.broadcast_to(x, (m, D) + x.shape), spec(sh, None, DATA)
            ),
            params,
            state_sh.params,
        )

        def total(c):
            losses = pipeline_slot_losses(
                c, batch, key, cfg.model, layout.stage_layout, mesh, D, copies=True
            )
            return jnp.sum(losses), losses

        (_, losses), grads = jax.value_and_grad(total, has_aux=True)(copies)
        summed = _tree_total(plan, mesh, specs, params, {"loss": losses, "grads": grads})
        n_tokens = normaliser(batch)
        return summed["loss"] / n_tokens, summed["grads"], n_tokens

    return grad_fn


def _pipelined_grad_fn(cfg: Config, mesh: Mesh, layout: StateLayout):
    """GPipe over `stage`: the pipeline itself accumulates the micro-batches."""
    seed = cfg.train.seed

    def grad_fn(params, batch, step):
        key = rng.step_key(rng.root_key(seed), step)
        loss_sum, grads = jax.value_and_grad(
            lambda p: pipeline_loss(p, batch, key, cfg.model, layout.stage_layout, mesh)
        )(params)
        n_tokens = normaliser(batch)
        return loss_sum / n_tokens, jax.tree.map(lambda g: g / n_tokens, grads)

    return grad_fn


def _apply_apart(tx, grads, opt_state, params, step, scale):
    """`tx`'s update applied in kernels of their own, for deterministic mode, the gradient first
    multiplied by `scale` (a scalar: the normaliser's inverse and the clipping's factor,
    `make_train_step`). ZeRO-0 too: on a pipeline the parameters are layer slots whose shape
    changes with the stage count, and fused with the step around it the update's multiply of
    the gradient by `scale` changed Adam's moments by 1 ulp on the pipeline demo's fast path
    (d2s4 -> d1s4 at its first failure: experiments/RESULTS.md, "The bitwise sweep").

    On storage, each device's optimizer arrays change length and provenance with the replica
    count, and XLA fuses the storage conversion into the optimizer's kernels. XLA:CPU contracts
    `b * m + (1 - b) * g` into one FMA, taking whichever product the fused kernel's form
    favours: a gradient gathered from several storage runs and one sliced from a single run led
    to different products being contracted, a 1-ulp change of Adam's moments on about a third
    of their elements (tests/test_deterministic_zero.py). `optimization_barrier` does not stop
    that (XLA removes it before fusion); a conditional's branch is compiled on its own, so its
    kernels read and write plain buffers in every layout and each element sees the same
    operations whatever the partition. The predicate is never false (the step count starts at
    0) but is not known to the compiler, which keeps the branch. The clipping's multiply is in
    the branch too: fused with the storage conversion outside it, it changed 1 ulp of Adam's
    first moment on a few hundred elements between 8 and 6 replicas at a clipped step
    (experiments/RESULTS.md, "Clipping inside the optimizer's branch")."""

    def update(args):
        g, o, p, scale = args
        g = jax.tree.map(lambda x: x * scale.astype(x.dtype), g)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o

    def keep(args):
        _, o, p, _ = args
        return p, o

    return jax.lax.cond(step >= 0, update, keep, (grads, opt_state, params, scale))


def make_train_step(
    cfg: Config, layout: StateLayout, model, mesh: Mesh, state_sh: TrainState, plan: Plan
):
    tx = layout.tx
    stage = layout.stage
    clip = cfg.train.grad_clip
    # deterministic ZeRO-1/2: the leaves whose summed gradient stays in the storage's chunks
    in_storage = layout.summed_in_storage() if cfg.deterministic else frozenset()
    if cfg.deterministic:
        grad_fn = functools.partial(
            _summed_grad_fn(cfg, model, mesh, state_sh, layout, in_storage), plan=plan)
    else:
        grad_fn = make_grad_fn(cfg, model, mesh, state_sh, layout)
    # the deterministic gradient's form (`_deterministic_grad_fn`): the parameters' shardings
    grad_specs = jax.tree.map(
        lambda sh: sh.spec, layout.param_shardings(mesh) if stage == 3 else state_sh.params)

    def train_step(state: TrainState, batch: dict):
        if cfg.deterministic:
            loss, grads, n_tokens = grad_fn(state.params, batch, state.step)
            # the optimizer's own clipping is off in this mode (`make_optimizer`): its global
            # norm reduces in an order that depends on the layout; this one does not. The sum's
            # norm over the normaliser is the mean gradient's (`_summed_grad_fn`)
            with jax.named_scope("grad_norm"):
                norm = layout.fixed_order_norm(grads, mesh, grad_specs, state.step,
                                               in_storage) / n_tokens
            # one scalar factor: the normaliser's inverse, times the clipping's where the norm
            # is above the threshold; applied inside the optimizer's own branch
            # (`_apply_apart`)
            scale = (1.0 / n_tokens).astype(jnp.float32)
            if clip > 0:
                scale = scale * jnp.where(norm < clip, 1.0, clip / norm).astype(jnp.float32)
        else:
            loss, grads = grad_fn(state.params, batch, state.step)
        # the gradient comes in parameter form for ZeRO-0/1 and in deterministic mode
        # (`_deterministic_grad_fn`; the leaves of `in_storage` as their storage tier already),
        # else in the ZeRO storage (`make_grad_fn`)
        whole = stage < 2 or cfg.deterministic
        with jax.named_scope("to_storage"):
            p_opt = state.params if stage in (0, 3) else layout.to_storage(state.params, mesh)
            g_opt = (layout.to_storage(grads, mesh, in_storage) if stage > 0 and whole
                     else grads)
        with jax.named_scope("optimizer"):
            if cfg.deterministic:
                new_p, opt_state = _apply_apart(tx, g_opt, state.opt_state, p_opt, state.step,
                                                scale)
            else:
                updates, opt_state = tx.update(g_opt, state.opt_state, p_opt)
                new_p = optax.apply_updates(p_opt, updates)
        with jax.named_scope("from_storage"):
            params = layout.from_storage(new_p, mesh) if stage in (1, 2) else new_p
        new = TrainState(state.step + 1, params, opt_state)
        with jax.named_scope("checksums"):
            checksums = layout.stacked_checksums(new, mesh)
        metrics = {
            "loss": loss,
            "grad_norm": norm if cfg.deterministic else optax.tree.norm(g_opt),
            "checksums": checksums,
        }
        return new, metrics

    return train_step


def make_eval_step(
    cfg: Config, model, layout: StateLayout | None = None, mesh: Mesh | None = None, plan=None
):
    loss_fn = make_loss_fn(cfg, model, deterministic=True, layout=layout, mesh=mesh)

    pipelined = layout is not None and layout.stage_layout is not None

    def eval_step(params, batch):
        # the key is made in the trace: made here, outside it, it is two small programs
        # (`jnp.asarray`, the threefry seed) compiled on whatever client is current, which on
        # a renewed CPU client are a standby hit's only compiles
        # (tests/test_readme.py::test_the_launch_with_three_kills_runs_as_written)
        key = rng.root_key(0)
        n_tokens = normaliser(batch)
        if cfg.deterministic and pipelined:
            per = pipeline_slot_losses(
                params, batch, key, cfg.model, layout.stage_layout, mesh, mesh.shape[DATA],
                copies=False, deterministic=True,
            )
            return fixed_order_sum(per, canonical_order(plan), replicated(mesh)), n_tokens
        if cfg.deterministic:
            D = mesh.shape[DATA]

            def slot_sums(mb):
                mb = jax.tree.map(lambda x: x.reshape((D, x.shape[0] // D) + x.shape[1:]), mb)
                return jax.vmap(lambda m: loss_fn(params, m, key))(mb)

            per = jax.lax.map(slot_sums, batch)  # [m, D]
            return fixed_order_sum(per, canonical_order(plan), replicated(mesh)), n_tokens
        if pipelined:
            total = pipeline_loss(params, batch, key, cfg.model, layout.stage_layout, mesh, True)
            return total, n_tokens
        total = jax.lax.map(lambda mb: loss_fn(params, mb, key), batch).sum()
        return total, n_tokens

    return eval_step
