"""Random keys as pure functions of (seed, step, global sample id[, layer, site]).

Randomness is derived, never threaded: `step_key = fold_in(root, step)` and a sample's key is
`fold_in(step_key, global_sample_id)`; model code folds in its layer and site ids. No draw depends
on the mesh, the micro-batch count or the device that runs a sample, so a re-planned step draws
the fault-free step's numbers. Keys use the threefry implementation with
`jax_threefry_partitionable` on, whose bits do not depend on how an array is sharded.

`rng.mode: per_device` is the ablation: the id folded in is the sample's *slot* on the mesh
(replica-major, as rank-seeded frameworks seed by rank and advance a per-device stream), so a
layout change hands every sample a different mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPL = "threefry2x32"


def check_backend_config() -> None:
    """Refuse to run where key derivation would depend on sharding."""
    if not jax.config.jax_threefry_partitionable:
        raise RuntimeError(
            "elasjax needs jax_threefry_partitionable=True so random bits do not depend on "
            "sharding; set jax.config.update('jax_threefry_partitionable', True)"
        )


def root_key(seed: int) -> jax.Array:
    return jax.random.key(seed, impl=IMPL)


def step_key(root: jax.Array, step) -> jax.Array:
    return jax.random.fold_in(root, step)


def sample_keys(key: jax.Array, ids: jax.Array) -> jax.Array:
    """One key per id (any shape of non-negative int ids)."""
    ids = jnp.asarray(ids).astype(jnp.uint32)
    flat = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids.reshape(-1))
    return flat.reshape(ids.shape)
