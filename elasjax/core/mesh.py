"""Mesh axes, the one logical-to-mesh axis table, and building a `Mesh` for a `Plan`.

Models name array dimensions with *logical* axes (`embed`, `heads`, `mlp`, `batch`); this module
alone maps them to *mesh* axes (`data`, `stage`, `tensor`). Changing the parallel layout is then a
change of data (the mesh shape in a `Plan`), never of model code. No other module names a mesh
axis string.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA = "data"
STAGE = "stage"
TENSOR = "tensor"
MESH_AXES = (DATA, STAGE, TENSOR)

# Logical axis -> mesh axis (None = replicated). The table is total: a logical name that is not
# here is an error (`sharding.logical_to_mesh`), never a silent replication.
LOGICAL_RULES: dict[str, str | None] = {
    "batch": DATA,
    "microbatch": None,
    "sequence": None,
    "vocab": TENSOR,
    "embed": None,
    "heads": TENSOR,
    "head_dim": None,
    "mlp": TENSOR,
    "layers": None,
    "stages": STAGE,  # pipeline stage slots: [stages, layers per stage, ...]
    "norm": None,
}


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device]) -> Mesh:
    """A mesh over exactly `devices` (in order) with axes (data, stage, tensor).

    The device order is the plan's: position i of the flattened mesh is `devices[i]`, tensor
    fastest. Keeping tensor groups on consecutive devices keeps them inside one host where hosts
    are consecutive device ranges.
    """
    dims = tuple(shape.get(a, 1) for a in MESH_AXES)
    n = int(np.prod(dims))
    if n != len(devices):
        raise ValueError(f"mesh shape {dict(zip(MESH_AXES, dims))} needs {n} devices, got {len(devices)}")
    return Mesh(np.asarray(list(devices), dtype=object).reshape(dims), MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_spec(ndim: int, batch_dim: int = 1) -> PartitionSpec:
    """Spec of a [microbatch, batch, ...] array: the batch dimension over `data`."""
    spec: list[str | None] = [None] * ndim
    spec[batch_dim] = LOGICAL_RULES["batch"]
    return PartitionSpec(*spec)




def devices_by_id(ids: Sequence[int]) -> list[jax.Device]:
    """Devices of this process by id, in the given order; an unknown id is an error."""
    table = {d.id: d for d in jax.devices()}
    missing = [i for i in ids if i not in table]
    if missing:
        raise ValueError(f"device ids {missing} do not exist; available: {sorted(table)}")
    return [table[i] for i in ids]
