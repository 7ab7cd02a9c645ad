"""Logical PartitionSpecs -> NamedShardings on a plan's mesh; total and loud.

The storage mapping (where parameters and optimizer state live) is derived here from the model's
logical specs and `mesh.LOGICAL_RULES`. A logical name missing from the table, or a dimension the
mesh axis does not divide, is a `ValueError` naming the parameter path: silent replication would
hide memory blow-ups and wrong accounting.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .mesh import LOGICAL_RULES, batch_spec

PyTree = Any


def logical_to_mesh(spec: PartitionSpec, path: str = "") -> PartitionSpec:
    out = []
    for name in spec:
        if name is None:
            out.append(None)
        elif isinstance(name, str):
            if name not in LOGICAL_RULES:
                raise ValueError(
                    f"parameter '{path}': logical axis '{name}' has no rule; known axes: "
                    f"{', '.join(LOGICAL_RULES)}"
                )
            out.append(LOGICAL_RULES[name])
        else:
            raise ValueError(f"parameter '{path}': composite logical axis {name!r} is not supported")
    return PartitionSpec(*out)


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _check(shape, spec: PartitionSpec, mesh: Mesh, path: str) -> None:
    if len(spec) > len(shape):
        raise ValueError(f"parameter '{path}': spec {spec} has more axes than shape {shape}")
    for dim, axis in zip(shape, spec):
        if axis is None:
            continue
        n = mesh.shape[axis]
        if dim % n:
            raise ValueError(
                f"parameter '{path}': dimension {dim} is not divisible by mesh axis '{axis}' of "
                f"size {n}"
            )


def named_shardings(abstract: PyTree, logical: PyTree, mesh: Mesh) -> PyTree:
    """NamedSharding per leaf from matching trees of abstract arrays and logical specs."""

    def one(path, x, spec):
        p = path_str(path)
        mspec = logical_to_mesh(spec, p)
        _check(x.shape, mspec, mesh, p)
        return NamedSharding(mesh, mspec)

    return jax.tree_util.tree_map_with_path(
        one, abstract, logical, is_leaf=lambda s: isinstance(s, PartitionSpec)
    )


def opt_state_logical(
    tx: optax.GradientTransformation, opt_state: PyTree, param_logical: PyTree, params: PyTree
):
    """Logical specs of an optimizer state: parameter-shaped parts follow the parameters, the rest
    (counts, schedules, and statistics of another rank such as Adafactor's factored rows and
    columns) is replicated."""
    return optax.tree_map_params(
        tx,
        lambda leaf, spec, p: spec if leaf.shape == p.shape else PartitionSpec(),
        opt_state,
        param_logical,
        params,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def _spec_like_param(shape: tuple, p_shape: tuple, p_spec: PartitionSpec):
    """The PartitionSpec of an optimizer leaf of `shape` that holds statistics of a parameter of
    `p_shape` (sharded `p_spec`), or None if `shape` is no part of `p_shape`: the parameter's
    spec for its own shape; for a reduced shape (Adafactor's per-row and per-column second
    moments: `p_shape` with dimensions left out), the kept dimensions keep their entries. When
    several choices of left-out dimensions give `shape` (a square matrix's row and column
    statistics), an entry on which they disagree is replicated: valid for any of them."""
    if shape == p_shape:
        return p_spec
    drop = len(p_shape) - len(shape)
    if drop <= 0:
        return None
    entries = list(p_spec) + [None] * (len(p_shape) - len(p_spec))
    options = [
        [entries[i] for i in kept]
        for kept in itertools.combinations(range(len(p_shape)), len(shape))
        if tuple(p_shape[i] for i in kept) == tuple(shape)
    ]
    if not options:
        return None
    return PartitionSpec(*(e[0] if len(set(map(repr, e))) == 1 else None for e in zip(*options)))


def opt_state_shardings(
    tx: optax.GradientTransformation,
    opt_state: PyTree,
    params: PyTree,
    param_shardings: PyTree,
    *,
    unmatched: str = "error",
) -> PyTree:
    """The shardings of an optax state, given its parameters' shardings: for any transformation,
    chains included (`optax.tree_map_params` finds the parameter-structured parts).

    Per leaf of `opt_state` (arrays or `jax.ShapeDtypeStruct`s; so are `params`):

    - outside the parameter-structured parts (step counts, schedule and clipping state, empty
      states): replicated;
    - shaped like its parameter (Adam's `mu`/`nu`, momentum, LAMB's moments): the parameter's
      sharding;
    - a reduction of its parameter's shape (Adafactor's factored `v_row`/`v_col`: dimensions
      left out): the parameter's spec on the dimensions it keeps (an entry that two readings of
      a square shape disagree on is replicated);
    - of size 1 (placeholders such as Adafactor's `v` of a factored parameter): replicated;
    - any other shape: `ValueError` naming the leaf and both shapes, or replicated with
      `unmatched="replicate"`.

    For ZeRO-1 over the data axis pass the result to `partition_over`. `param_shardings` are
    `NamedSharding`s on one mesh, in the structure of `params`."""
    if unmatched not in ("error", "replicate"):
        raise ValueError(f"opt_state_shardings: unmatched = {unmatched!r}; allowed values: "
                         "'error', 'replicate'")
    shardings = jax.tree.leaves(param_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if not shardings:
        raise ValueError("opt_state_shardings: param_shardings has no leaves (need its mesh)")
    bad = [type(x).__name__ for x in shardings if not isinstance(x, NamedSharding)]
    if bad:
        raise TypeError(f"opt_state_shardings: param_shardings holds a {bad[0]}; allowed: "
                        "NamedSharding")
    meshes = {x.mesh for x in shardings}
    if len(meshes) > 1:
        raise ValueError(f"opt_state_shardings: param_shardings are on {len(meshes)} meshes; "
                         "allowed: one")
    mesh = shardings[0].mesh
    rep = NamedSharding(mesh, PartitionSpec())
    def one(leaf, p, sh):
        shape, p_shape = tuple(leaf.shape), tuple(p.shape)
        spec = _spec_like_param(shape, p_shape, sh.spec)
        if spec is not None:
            return NamedSharding(mesh, spec)
        if int(np.prod(shape)) == 1 or unmatched == "replicate":
            return rep
        return _Unmatched(shape, p_shape)

    out = optax.tree_map_params(
        tx, one, opt_state, params, param_shardings,
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )
    for path, x in jax.tree_util.tree_flatten_with_path(
        out, is_leaf=lambda x: isinstance(x, (_Unmatched, jax.sharding.Sharding))
    )[0]:
        if isinstance(x, _Unmatched):
            raise ValueError(
                f"opt_state_shardings: optimizer state leaf '{path_str(path)}' has shape "
                f"{x.shape}, which is neither its parameter's shape {x.param_shape} nor a "
                "reduction of it (dimensions left out), so its sharding is unknown; allowed: "
                "build that leaf's sharding yourself, or unmatched='replicate' (it is then "
                "replicated on every device)"
            )
    return out


class _Unmatched:
    """A leaf `opt_state_shardings` could not place (a pytree leaf: a plain object)."""

    def __init__(self, shape: tuple, param_shape: tuple):
        self.shape, self.param_shape = shape, param_shape


def batch_shardings(mesh: Mesh, batch: dict) -> dict:
    """[microbatch, batch, ...] arrays: the batch dimension over `data`."""
    return {k: NamedSharding(mesh, batch_spec(v.ndim)) for k, v in batch.items()}
