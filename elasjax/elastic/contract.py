"""The consistency contract of your own step: the same global batch, loss normalisation and random
numbers on any mesh (`pad_batch`, `sample_keys`), a batch and a value across processes
(`put_batch`, `host_value`), and layout-independent checksums (`state_checksums`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..core import rng
from ..transfer import checksum

PyTree = Any


def pad_batch(batch: Mapping[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """The global batch padded along its first axis to a multiple of `multiple` (the data
    degree), with a `weight` entry: 1 for real rows, 0 for padding. A loss of the form
    `sum(loss_i * weight_i) / sum(weight)` is then the same estimator on any data degree."""
    sizes = {k: np.shape(v)[0] for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"pad_batch: the batch's entries differ in their first axis: {sizes}")
    if "weight" in batch:
        raise ValueError("pad_batch: the batch already has a 'weight' entry")
    n = next(iter(sizes.values()))
    pad = -n % multiple
    out = {k: np.concatenate([v, np.zeros((pad, *np.shape(v)[1:]), np.asarray(v).dtype)])
           for k, v in batch.items()}
    out["weight"] = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
    return out


def sample_keys(root: jax.Array, step, sample_ids) -> jax.Array:
    """One PRNG key per global sample id at `step`: `fold_in(fold_in(root, step), id)`. No draw
    then depends on the mesh or on which device runs the sample."""
    return rng.sample_keys(rng.step_key(root, step), sample_ids)


def put_batch(batch: Mapping[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """The global batch (numpy, the same in every process) as arrays on `sharding`'s mesh:
    each process places the rows of its own devices only (`jax.make_array_from_callback`).
    In one process it is `jax.device_put`; under `elasjax launch` it is how a batch gets onto a
    mesh that spans processes."""
    return {k: jax.make_array_from_callback(np.shape(v), sharding, lambda i, v=v: np.asarray(v)[i])
            for k, v in batch.items()}


def host_value(x: jax.Array) -> np.ndarray:
    """The value of a replicated array (a loss, a metric), read from a device of this process:
    under `elasjax launch` `float(x)` of an array that spans processes is refused by JAX."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError("host_value: the array is sharded over processes; allowed: a "
                         "replicated array (out_shardings=NamedSharding(mesh, P()))")
    return np.asarray(x.addressable_shards[0].data)


@jax.jit
def _checksums(tree):
    return checksum.tree_checksums(tree)


def state_checksums(state: PyTree) -> dict[str, str]:
    """{leaf path: 16 hex digits}: a checksum of each leaf's bits that does not depend on how the
    leaf is sharded (equal values give equal checksums on any mesh)."""
    return checksum.to_host(_checksums(state))
