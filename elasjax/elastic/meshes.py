"""Meshes over the live devices (`plan_mesh`) and the loop's ZeRO stages as sharding edits of
your own layout (`zero_shardings`, `partition_over`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.sharding import path_str

PyTree = Any


def plan_mesh(
    devices: Sequence[jax.Device], axes: Mapping[str, int | Sequence[int]]
) -> tuple[Mesh, list[jax.Device]]:
    """A mesh over as many of `devices` as the axis sizes allow, and the devices left spare.

    `axes` maps each mesh axis name, in mesh order, to its size: an int, a sequence of allowed
    sizes (first preferred), or -1 for at most one axis that takes the rest. Among the allowed
    sizes, the choice that uses the most devices wins; ties go to the earlier preferences. With
    `{"data": -1, "model": (2, 1)}`, 8 devices give data 4 x model 2 and 7 give data 7 x model 1
    (all 7 used) where `{"data": -1, "model": 2}` gives data 3 x model 2 and one spare.
    Devices keep their given order (the last axis fastest), so keep a host's devices together.
    """
    devices = list(devices)
    if not devices:
        raise ValueError("plan_mesh: no devices")
    names = list(axes)
    rest = [a for a in names if axes[a] == -1]
    if len(rest) > 1:
        raise ValueError(f"plan_mesh: axes {rest} are all -1; at most one axis may take the rest")
    options = []
    for a in names:
        v = axes[a]
        sizes = [-1] if v == -1 else ([int(v)] if isinstance(v, (int, np.integer)) else [int(s) for s in v])
        if not sizes or any(s < 1 and s != -1 for s in sizes):
            raise ValueError(
                f"plan_mesh: axis '{a}' = {v!r}; allowed values: a positive int, a sequence of "
                "positive ints (first preferred), or -1 (the rest)"
            )
        options.append(sizes)
    best = None
    for rank, combo in enumerate(itertools.product(*options)):
        fixed = math.prod(s for s in combo if s != -1)
        if fixed > len(devices):
            continue
        shape = [len(devices) // fixed if s == -1 else s for s in combo]
        used = math.prod(shape)
        if best is None or used > best[0]:
            best = (used, shape)
    if best is None or best[0] == 0:
        raise ValueError(
            f"plan_mesh: no allowed shape of axes {dict(axes)} fits {len(devices)} live device(s)"
        )
    used, shape = best
    mesh = Mesh(np.asarray(devices[:used], dtype=object).reshape(shape), tuple(names))
    return mesh, devices[used:]


def partition_over(
    shardings: PyTree, abstract: PyTree, axis: str = "data"
) -> tuple[PyTree, list[str]]:
    """Shard each leaf over mesh axis `axis` as well (ZeRO-1 for optimizer state): the first
    dimension that is not sharded yet and divides by the axis size gets it. Returns the new
    shardings and the paths of the arrays that could not be partitioned (no free dimension
    divides by the axis size, as happens on an uneven data degree), which stay as they were:
    they are listed, never hidden. Scalars stay as they are."""
    left: list[str] = []

    def one(path, sh, x):
        if not isinstance(sh, NamedSharding):
            raise TypeError(f"partition_over: '{path_str(path)}' has a {type(sh).__name__}; "
                            "allowed: NamedSharding")
        n = sh.mesh.shape[axis]
        spec = list(sh.spec) + [None] * (len(x.shape) - len(sh.spec))
        if n == 1 or len(x.shape) == 0 or axis in jax.tree.leaves(spec):
            return sh  # nothing to do, or a scalar: nothing to partition
        for i, (dim, s) in enumerate(zip(x.shape, spec)):
            if s is None and dim % n == 0:
                spec[i] = axis
                return NamedSharding(sh.mesh, PartitionSpec(*spec))
        left.append(path_str(path))
        return sh

    out = jax.tree_util.tree_map_with_path(
        one, shardings, abstract, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    return out, left


@dataclasses.dataclass(frozen=True)
class ZeroShardings:
    """`zero_shardings`' result: the parameters' and the optimizer state's shardings, and the
    paths of the arrays no dimension of which could be partitioned (left as they were)."""

    params: PyTree
    opt: PyTree
    left: list[str]


def zero_shardings(
    stage: int, params: PyTree, opt: PyTree, abstract_params: PyTree, abstract_opt: PyTree,
    axis: str = "data",
) -> ZeroShardings:
    """The loop's `zero.stage` for your own state, as sharding edits over mesh axis `axis`
    (`partition_over`): stage 0 leaves both as given; 1 partitions the optimizer state; 3 the
    parameters too (XLA gathers them where your step uses them). Stage 2 partitions the loop's
    gradient accumulators, which your step owns: it is refused, use 1 (and constrain your
    accumulators to the optimizer state's shardings if you keep any). `params`/`opt` are
    shardings trees (`opt_state_shardings` gives the optimizer's), `abstract_*` the arrays or
    `jax.eval_shape` results they describe."""
    if stage not in (0, 1, 3):
        why = (" (stage 2 partitions the loop's gradient accumulators; your step owns its "
               "gradients)" if stage == 2 else "")
        raise ValueError(f"zero_shardings: stage = {stage!r}{why}; allowed values: 0, 1, 3")
    if stage == 0:
        return ZeroShardings(params, opt, [])
    opt, left = partition_over(opt, abstract_opt, axis)
    if stage == 3:
        params, left_p = partition_over(params, abstract_params, axis)
        left = left_p + left
    return ZeroShardings(params, opt, left)
