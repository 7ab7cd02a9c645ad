"""Small arrays through one collective (`core.packing`): the same values as one collective per
array, and the ZeRO step's parameter gather crosses the data axis in a few collectives whatever
the number of parameter leaves (under `elasjax launch` each collective crosses processes, and one
per leaf was most of a step: experiments/RESULTS.md, "One collective per operand under
launch")."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from jax.sharding import Mesh, PartitionSpec as P

from elasjax.compilation.executables import compile_plan
from elasjax.core import packing
from elasjax.layout.state import StateFactory, make_optimizer
from elasjax.plan import planner


def _arrays(D: int) -> list[np.ndarray]:
    """Per-rank values [D, ...] of mixed shapes and dtypes; the largest over `OWN_EXCHANGE` = 64."""
    rng = np.random.default_rng(0)
    shapes = [(3,), (2, 5), (70,), (1,), (4, 4)]
    out = [rng.standard_normal((D, *s)).astype(np.float32) for s in shapes]
    out.append(rng.integers(0, 100, (D, 6)).astype(np.int32))
    return out


def test_groups_pack_the_small_arrays_of_a_dtype_and_leave_the_large_alone(monkeypatch):
    monkeypatch.setattr(packing, "OWN_EXCHANGE", 64)
    xs = [a[0] for a in _arrays(2)]
    assert sorted(map(sorted, packing.groups(xs))) == [[0, 1, 3, 4], [2], [5]]


@pytest.mark.parametrize("D", [1, 2, 4, 8])
def test_a_packed_gather_equals_one_collective_per_array(D, monkeypatch):
    """`all_gather_packed` gives each array as `all_gather(tiled)` along its own axis does, bit
    for bit."""
    monkeypatch.setattr(packing, "OWN_EXCHANGE", 64)
    mesh = Mesh(np.array(jax.devices()[:D]), ("data",))
    arrays = _arrays(D)

    def gathered(xs, packed):
        # local [1, ...] -> [D, ...] along axis 0; one more array gathered along axis 1
        def local(*xs):
            xs = list(xs) + [jnp.swapaxes(xs[1], 0, 1)]  # [5, 1, ...]: gathered on axis 1
            axis_of = [0] * len(arrays) + [1]
            if packed:
                return tuple(packing.all_gather_packed(xs, "data", axis_of))
            return tuple(jax.lax.all_gather(x, "data", axis=a, tiled=True)
                         for x, a in zip(xs, axis_of))

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * len(xs),
                                     out_specs=(P(),) * (len(xs) + 1), check_vma=False))(*xs)

    for a, b in zip(gathered(arrays, True), gathered(arrays, False)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.dtype == b.dtype


def _collectives(*over: str) -> dict[str, int]:
    """Collectives over the data axis in the initial plan's train program (8 replicas, tensor
    1): the number of operands of each kind, as XLA:CPU runs them (one each)."""
    cfg = tiny_config("parallel.data=8", "parallel.tensor=1", *over)
    topo = planner.Topology(tuple(range(8)), cfg.parallel.devices_per_host)
    plan = planner.initial_plan(topo, cfg)
    exe = compile_plan(cfg, StateFactory(cfg, make_optimizer(cfg)), plan,
                       {d.id: d for d in jax.devices()}, donate=False)
    counts: dict[str, int] = {}
    for line in exe.train.as_text().splitlines():
        m = re.search(r" (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\((.*?)\)",
                      line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + m.group(2).count("%")
    return counts


def test_the_zero_step_gathers_its_parameters_in_a_few_collectives_not_one_per_leaf():
    """Deterministic ZeRO-1 (the tree sum packs its own exchanges: `treesum`). The tiny GPT has
    18 parameter leaves; before packing, the step gathered each from the storage alone."""
    n_leaves = len(jax.tree.leaves(StateFactory(tiny_config(), make_optimizer(tiny_config()))
                                   .abstract.params))
    assert n_leaves > 10
    counts = _collectives("zero.stage=1", "train.deterministic=true")
    assert counts.get("all-reduce", 0) <= 4, counts
    assert counts.get("all-gather", 0) <= 4, counts
