"""Order-independent per-leaf checksums computed on device.

A leaf's checksum is a pair of wrapping uint32 sums of its bit pattern weighted by odd
position-dependent multipliers. Integer addition modulo 2**32 is associative and commutative, so
the result does not depend on how the array is sharded or in which order XLA reduces it: the same
values give the same checksum on any mesh, and any change of a single bit of a single element
changes it (the multipliers are odd, hence invertible modulo 2**32).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .sharding import path_str

_K1 = np.uint32(0x9E3779B1)
_K2 = np.uint32(0x85EBCA77)


def _bits(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    width = x.dtype.itemsize * 8
    if width == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if width == 16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if width == 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"checksum of dtype {x.dtype} is not supported")


def leaf_checksum(x: jax.Array) -> jax.Array:
    """uint32[2] checksum of one array (any sharding)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = _bits(x).reshape(-1)
    idx = jax.lax.iota(jnp.uint32, bits.size)
    w1 = idx * jnp.uint32(2) * _K1 + jnp.uint32(1)
    w2 = (idx ^ jnp.uint32(0x5BD1E995)) * jnp.uint32(2) * _K2 + jnp.uint32(1)
    h1 = jnp.sum(bits * w1, dtype=jnp.uint32)
    h2 = jnp.sum((bits ^ (bits >> 13)) * w2, dtype=jnp.uint32)
    return jnp.stack([h1, h2])


def tree_checksums(tree: Any) -> Any:
    """A pytree of uint32[2] checksums (traceable; use inside or outside jit)."""
    return jax.tree.map(leaf_checksum, tree)


def to_host(sums: Any) -> dict[str, str]:
    """Device checksums -> {leaf path: 16-hex-digit string}."""
    out = {}
    for path, v in jax.tree_util.tree_flatten_with_path(sums)[0]:
        a = np.asarray(v, dtype=np.uint32)
        out[path_str(path)] = f"{int(a[0]):08x}{int(a[1]):08x}"
    return out


def diff(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Leaf paths whose checksums differ (or are missing on either side)."""
    keys = sorted(set(expected) | set(actual))
    return [k for k in keys if expected.get(k) != actual.get(k)]
