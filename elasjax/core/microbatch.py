"""Gradient accumulation over micro-batches: the one place where per-sample gradients are reduced.

The loss of a step is `sum(token loss * weight) / (real tokens of the global batch)`. Each
micro-batch contributes its *sum* (never a mean), the accumulator adds micro-batches in fp32 with
`lax.scan`, and the data-parallel reduction is the SUM GSPMD derives from the global-view loss;
the division by the global token count happens once, at the end. The gradient is therefore the
same estimator for any number of replicas, micro-batches or padding slots; only the floating-point
reduction order differs between layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def accumulate(
    grad_fn: Callable[[PyTree, dict], tuple[jax.Array, PyTree]],
    params: PyTree,
    batch: dict,
    *,
    micro_constraint: Callable[[dict], dict] = lambda mb: mb,
    grad_constraint: Callable[[PyTree], PyTree] = lambda g: g,
    to_acc: Callable[[PyTree], PyTree] | None = None,
) -> tuple[jax.Array, PyTree]:
    """Sum over the leading (micro-batch) axis of `batch` of `grad_fn(params, micro_batch)`.

    `grad_fn` returns (summed loss, gradient of the summed loss). `to_acc` converts each
    micro-batch's gradient to the accumulator's form (ZeRO-2: the partitioned storage) before it
    is added. Returns the totals in f32.
    """
    conv = to_acc or (lambda g: g)
    zeros = jax.tree.map(
        lambda p: jnp.zeros(p.shape, jnp.float32), jax.eval_shape(lambda: conv(params))
    )

    def body(carry, mb):
        loss_acc, g_acc = carry
        loss, g = grad_fn(params, micro_constraint(mb))
        g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, conv(g))
        return (loss_acc + loss.astype(jnp.float32), grad_constraint(g_acc)), None

    (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), grad_constraint(zeros)), batch)
    return loss, grads
