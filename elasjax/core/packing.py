"""Many small arrays through one collective: which to pack together (`groups`), and an
`all_gather` of packed arrays inside a `shard_map` (`all_gather_packed`).

Why: XLA:CPU runs every operand of a collective as a collective of its own, and under
`elasjax launch` each one crosses processes over gloo, paying a few round trips of process
wake-ups whatever its size. With 4 processes of 2 fake devices on 2 cores, one all-reduce of
1 MB took 15 ms and the same megabyte as 30 operands of one all-reduce 196-230 ms
(experiments/RESULTS.md, "One collective per operand under launch"). So the small arrays of one
dtype travel packed into one vector. A large one travels alone: packing copies it (into the
vector and out again), which costs more than a collective's latency (`OWN_EXCHANGE`).
A packed gather gives the same bits. Sums are not packed here: the default mode's ZeRO-0
gradient summed as one packed all-reduce made a survivor's collective wait out gloo's timeout
after a peer's death in 4 of 8 launches (a send that no socket shutdown ends), none of 4
without it (experiments/RESULTS.md, "One collective per operand under launch").
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

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

