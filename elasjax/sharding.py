"""Logical PartitionSpecs -> NamedShardings on a plan's mesh; total and loud.

The storage mapping (where parameters and optimizer state live) is derived here from the model's
logical specs and `mesh.LOGICAL_RULES`. A logical name missing from the table, or a dimension the
mesh axis does not divide, is a `ValueError` naming the parameter path: silent replication would
hide memory blow-ups and wrong accounting.
"""

from __future__ import annotations

from typing import Any

import jax
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


def batch_shardings(mesh: Mesh, batch: dict) -> dict:
    """[microbatch, batch, ...] arrays: the batch dimension over `data`."""
    return {k: NamedSharding(mesh, batch_spec(v.ndim)) for k, v in batch.items()}
