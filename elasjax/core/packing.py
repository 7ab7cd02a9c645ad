"""Many small arrays through one collective: which to pack together (`groups`), an `all_gather`
of packed arrays inside a `shard_map` (`all_gather_packed`) and a sum over a mesh axis of packed
arrays (`psum_packed`).

Why: XLA:CPU runs every operand of a collective as a collective of its own, and under
`elasjax launch` each one crosses processes over gloo, paying a few round trips of process
wake-ups whatever its size. With 4 processes of 2 fake devices on 2 cores, one all-reduce of
1 MB took 15 ms and the same megabyte as 30 operands of one all-reduce 194 ms
(experiments/RESULTS.md, "One collective per operand under launch"). So the small arrays of one
dtype travel packed into one vector. A large one travels alone: packing copies it (into the
vector and out again), which costs more than a collective's latency (`OWN_EXCHANGE`).
A packed gather gives the same bits; a packed sum may add an element's ranks in another order
(a collective's algorithm may split its buffer by size), which only the default mode allows.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

# Elements from which an array travels alone rather than packed with others: packing copies it
# twice; at 101M parameters exchanging the tree sum's large leaves alone took its cross phase
# from 2.0 to 1.0 s (experiments/RESULTS.md, "The cross phase per large leaf"). The demos'
# arrays are all smaller: their programs pack everything.
OWN_EXCHANGE = 1 << 18


def groups(xs: Sequence) -> list[list[int]]:
    """Indices of `xs` grouped into collectives: each array of `OWN_EXCHANGE` elements or more
    alone, the others of one dtype together."""
    out: list[list[int]] = []
    for dtype in sorted({x.dtype.name for x in xs}):
        idx = [i for i, x in enumerate(xs) if x.dtype.name == dtype]
        small = [i for i in idx if xs[i].size < OWN_EXCHANGE]
        out += [[i] for i in idx if i not in small] + ([small] if small else [])
    return out


def all_gather_packed(xs: Sequence[jax.Array], axis_name: str, axes: Sequence[int]
                      ) -> list[jax.Array]:
    """Inside a `shard_map`: each `xs[i]` gathered over `axis_name`, tiled along its axis
    `axes[i]` (of size 1 here: the result has the mesh axis's size there), as
    `jax.lax.all_gather(xs[i], axis_name, axis=axes[i], tiled=True)` gives it, with the arrays
    of a `groups` group gathered as one vector."""
    out: list = [None] * len(xs)
    for idx in groups(xs):
        if len(idx) == 1:
            (i,) = idx
            out[i] = jax.lax.all_gather(xs[i], axis_name, axis=axes[i], tiled=True)
            continue
        g = jax.lax.all_gather(jnp.concatenate([xs[i].reshape(-1) for i in idx]), axis_name)
        at = 0
        for i in idx:
            x, a = xs[i], axes[i]
            part = g[:, at: at + x.size].reshape((g.shape[0],) + x.shape[:a] + x.shape[a + 1:])
            # [n, *before, *after] -> [*before, n, *after]: the gathered axis back in place
            out[i] = jnp.moveaxis(part, 0, a)
            at += x.size
    return out


def psum_packed(xs: Sequence[jax.Array], mesh, specs: Sequence, axis_name: str
                ) -> list[jax.Array]:
    """Each of `xs` (`[n, *leaf]`: one value per rank of `axis_name`, sharded over it on axis 0
    and laid out as its `specs` entry on the rest) summed over that axis: `[*leaf]`, laid out
    as its spec. Inside one `shard_map`, the small ones of one dtype packed into one `psum`
    (`groups`), the large ones summed alone."""
    def local(*parts):
        parts = [p[0] for p in parts]  # this rank's value: [*local shard of the leaf]
        out: list = [None] * len(parts)
        for idx in groups(parts):
            if len(idx) == 1:
                out[idx[0]] = jax.lax.psum(parts[idx[0]], axis_name)
                continue
            total = jax.lax.psum(jnp.concatenate([parts[i].reshape(-1) for i in idx]), axis_name)
            at = 0
            for i in idx:
                out[i] = total[at: at + parts[i].size].reshape(parts[i].shape)
                at += parts[i].size
        return tuple(out)

    return list(jax.shard_map(
        local, mesh=mesh, in_specs=tuple(PartitionSpec(axis_name, *s) for s in specs),
        out_specs=tuple(specs), check_vma=False)(*xs))
