"""Pipeline parallelism over the `stage` mesh axis: GPipe with `shard_map` + `ppermute`.

Layers live in per-stage *slots*: a stacked layer leaf `[L, ...]` becomes `[S, Lmax, ...]`,
sharded over `stage` on its first axis, where stage `s` holds layers `offset_s .. offset_s +
n_s - 1` in its first `n_s` slots (`StageLayout`). Uneven partitions (13 layers on 3 stages ->
5/4/4) leave empty slots: they hold zeros and are skipped at run time (`lax.cond` per slot), so
their gradients are zero and Adam keeps them zero.

The step (`pipeline_loss`) is one `shard_map` that is manual over `stage` only; `data` and
`tensor` stay automatic inside, so a pipelined plan composes with data and tensor parallelism
(a 3-D mesh) without any other code knowing. A GPipe schedule runs `m + S - 1` ticks: at tick
`i` stage 0 embeds micro-batch `i`, every stage applies its layers to the activation it holds
(micro-batch `i - s`), the last stage computes the head and the weighted token loss of
micro-batch `i - S + 1`, and activations move one stage forward with `ppermute`. The backward
pass is the autodiff transpose of the same loop. The embedding runs only on the first stage and
the head only on the last (`lax.cond` on the stage index); their parameters are replicated over
`stage`, and their gradients are summed over stages by the transpose of that replication.

The model comes as its layer stack (`modelspec.LayerStack`: embed, block, head loss and the
activation shape; the GPT's in `models/gpt.py`), so any model with one can be pipelined.
Random numbers stay layout-independent: a block folds in its *global* layer id and each sample
its global sample id, exactly as in the unpipelined model (`models.gpt.forward`), so the
pipelined loss and gradients equal the unpipelined ones up to floating-point reduction order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from .. import models
from ..config import ModelConfig
from ..core import rng
from ..core.mesh import STAGE

PyTree = Any


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Layers per stage, in stage order."""

    partition: tuple[int, ...]

    def __post_init__(self):
        if not self.partition or min(self.partition) < 1:
            raise ValueError(f"every stage needs at least one layer, got {self.partition}")

    @property
    def stages(self) -> int:
        return len(self.partition)

    @property
    def slots(self) -> int:
        return max(self.partition)

    @property
    def n_layers(self) -> int:
        return sum(self.partition)

    def slot_layer(self) -> np.ndarray:
        """[S, Lmax] global layer id of each slot; -1 for an empty slot."""
        out = np.full((self.stages, self.slots), -1, np.int32)
        off = 0
        for s, n in enumerate(self.partition):
            out[s, :n] = np.arange(off, off + n)
            off += n
        return out

    def layer_slot(self) -> dict[int, tuple[int, int]]:
        table = self.slot_layer()
        return {int(table[s, j]): (s, j) for s, j in zip(*np.nonzero(table >= 0))}

    def layer_flat_slot(self) -> np.ndarray:
        """[L] index of each layer's slot in the flattened `[S * Lmax]` slot axis."""
        where = self.layer_slot()
        return np.array([where[l][0] * self.slots + where[l][1] for l in range(self.n_layers)])


def to_slots(layers: PyTree, layout: StageLayout) -> PyTree:
    """Stacked layer leaves [L, ...] -> slot leaves [S, Lmax, ...] (empty slots zero)."""
    table = layout.slot_layer()
    L = layout.n_layers
    idx = jnp.asarray(np.where(table >= 0, table, L))

    def one(x):
        if x.shape[0] != L:
            raise ValueError(
                f"a stacked layer leaf has {x.shape[0]} layers and the partition "
                f"{layout.partition} {L}; ModelSpec.n_layers must be the stack's length"
            )
        padded = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)
        return jnp.take(padded, idx, axis=0)

    return jax.tree.map(one, layers)


def from_slots(slots: PyTree, layout: StageLayout) -> PyTree:
    """Slot leaves [S, Lmax, ...] -> stacked layer leaves [L, ...]."""
    flat_idx = jnp.asarray(layout.layer_flat_slot())

    def one(x):
        flat = x.reshape((-1,) + x.shape[2:])
        return jnp.take(flat, flat_idx, axis=0)

    return jax.tree.map(one, slots)


def slot_logical(layer_logical: PyTree) -> PyTree:
    """Logical specs of slot leaves: a leading `stages` axis before the `layers` axis."""
    return jax.tree.map(
        lambda spec: PartitionSpec("stages", *spec),
        layer_logical,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


_TRAINER_KEYS = ("weights", "key_ids", "counts")


def _over_stages(local, mesh: Mesh, layer_params, other, batch: dict, key, lead: int):
    """Run `local(layers, other, examples, weights, key_ids, key)` manual over `stage`: layer
    leaves split over `stage` on axis `lead`, everything else whole on every stage (`data` and
    `tensor` stay automatic); the result is replicated. `examples`: the model's batch arrays."""
    whole = PartitionSpec()
    examples = {k: v for k, v in batch.items() if k not in _TRAINER_KEYS}
    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            jax.tree.map(lambda _: PartitionSpec(*([None] * lead), STAGE), layer_params),
            jax.tree.map(lambda _: whole, other),
            jax.tree.map(lambda _: whole, examples),
            whole, whole, whole,
        ),
        out_specs=whole,
        axis_names={STAGE},
        check_vma=False,
    )
    return f(layer_params, other, examples, batch["weights"], batch["key_ids"], key)


def _stack(cfg: ModelConfig):
    spec = models.get(cfg)
    if spec.layers is None:
        raise ValueError(f"model '{spec.name}' has no layer stack (ModelSpec.layers): no pipelines")
    return spec.layers


def pipeline_loss(
    params: PyTree,
    batch: dict,
    key: jax.Array,
    cfg: ModelConfig,
    layout: StageLayout,
    mesh: Mesh,
    deterministic: bool = False,
) -> jax.Array:
    """Summed weighted token loss of a whole global batch `[m, D*b, ...]`, GPipe-pipelined.

    `params['layers']` are slot leaves `[S, Lmax, ...]`; every other parameter is replicated
    over `stage`. Returns the scalar sum (replicated): the schedule of `pipeline_slot_losses`
    with the whole micro-batch as one slot (`data` stays automatic inside it).
    """
    per = pipeline_slot_losses(
        params, batch, key, cfg, layout, mesh, 1, copies=False, deterministic=deterministic
    )
    return jnp.sum(per)


def pipeline_slot_losses(
    params: PyTree,
    batch: dict,
    key: jax.Array,
    cfg: ModelConfig,
    layout: StageLayout,
    mesh: Mesh,
    replicas: int,
    *,
    copies: bool,
    deterministic: bool = False,
) -> jax.Array:
    """The GPipe schedule: summed weighted token loss of every (micro-batch, replica) slot
    separately, `[m, D]`, each slot computed by one replica on its own (`vmap` over the
    `replicas`). `pipeline_loss` runs it with one replica (the whole micro-batch; `data` stays
    automatic); deterministic mode with one replica per data device.

    With `copies=True` every parameter leaf carries two leading axes `[m, D, ...]`: slot `(k, r)`
    reads copy `(k, r)` only, so the gradient with respect to the copies is each slot's own
    gradient, unsummed; the caller adds them in a fixed order. Bubble ticks contribute exact
    zeros (their outputs never reach a loss), so no value depends on the stage count or on
    which tick ran a slot. Layer copies are `[m, D, S, Lmax, ...]`, sharded over `stage` on axis 2.
    """
    S, m, D = layout.stages, batch["weights"].shape[0], replicas
    stack = _stack(cfg)
    assert mesh.shape[STAGE] == S, f"mesh has {mesh.shape[STAGE]} stages, layout {S}"
    table = layout.slot_layer()
    layer_params = params["layers"]
    other = {k: v for k, v in params.items() if k != "layers"}
    lead = 2 if copies else 0

    def split(x):  # [D*b, ...] -> [D, b, ...]
        return x.reshape((D, x.shape[0] // D) + x.shape[1:])

    def local(layers, other, examples, weights, key_ids, key):
        s = jax.lax.axis_index(STAGE)
        layers = jax.tree.map(lambda x: x[(slice(None),) * lead + (0,)], layers)
        ids = jnp.asarray(table)[s]  # [Lmax] global layer ids (-1 empty)
        act_shape = (D, weights.shape[1] // D) + tuple(stack.activation_shape)
        dtype = jax.tree.leaves(other)[0].dtype

        def at(tree, k):
            """(per-replica parameters, vmap axis) for micro-batch `k`."""
            if copies:
                return jax.tree.map(lambda x: x[k], tree), 0
            return tree, None

        def micro_keys(k):
            return split(rng.sample_keys(key, key_ids[k]))

        def run_layers(x, k):
            keys = micro_keys(k)
            lps, ax = at(layers, k)  # copies: [D, Lmax, ...]
            if copies:
                lps = jax.tree.map(lambda v: jnp.moveaxis(v, 1, 0), lps)  # [Lmax, D, ...]

            def body(x, inp):
                lp, lid = inp
                y = jax.lax.cond(
                    lid >= 0,
                    lambda: jax.vmap(
                        lambda p, xi, ki: stack.block(p, xi, ki, lid, deterministic),
                        in_axes=(ax, 0, 0),
                    )(lp, x, keys),
                    lambda: x,
                )
                return y, None

            x, _ = jax.lax.scan(body, x, (lps, ids))
            return x

        def tick(carry, i):
            state, losses = carry
            k_in = jnp.minimum(i, m - 1)

            def embed():
                op, ax = at(other, k_in)
                return jax.vmap(
                    lambda p, ex, kk: stack.embed(p, ex, kk, deterministic),
                    in_axes=(ax, 0, 0),
                )(op, jax.tree.map(lambda v: split(v[k_in]), examples), micro_keys(k_in))

            state = jax.lax.cond((s == 0) & (i < m), embed, lambda: state)
            state = run_layers(state, jnp.clip(i - s, 0, m - 1))
            k_out = jnp.clip(i - (S - 1), 0, m - 1)

            def head_loss():
                op, ax = at(other, k_out)

                return jax.vmap(stack.head_loss, in_axes=(ax, 0, 0, 0))(
                    op, state, jax.tree.map(lambda v: split(v[k_out]), examples),
                    split(weights[k_out]),
                )

            slot = jax.lax.cond(
                (s == S - 1) & (i >= S - 1), head_loss, lambda: jnp.zeros((D,), jnp.float32)
            )
            losses = jax.lax.dynamic_update_index_in_dim(
                losses, losses[k_out] + slot, k_out, axis=0
            )
            state = jax.lax.ppermute(state, STAGE, [(j, j + 1) for j in range(S - 1)])
            return (state, losses), None

        init = (jnp.zeros(act_shape, dtype), jnp.zeros((m, D), jnp.float32))
        (_, losses), _ = jax.lax.scan(tick, init, jnp.arange(m + S - 1))
        return jax.lax.psum(losses, STAGE)  # one stage holds each slot's loss, the rest zeros

    return _over_stages(local, mesh, layer_params, other, batch, key, lead=lead)
