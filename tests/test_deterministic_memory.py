"""The memory of deterministic mode's fixed-order reduction (`treesum`), from XLA.

Compiled with XLA optimisations on, as users run it: the deterministic step's extra temporary
memory over the default step does not grow from 2 to 8 replicas (at most ceil(log2 K) + 3
gradient-sized registers per device for K canonical micro-batches). Bitwise equality across
meshes through failures is tested in test_deterministic_zero.py (8 -> 6 -> 4 devices, the 8
canonical micro-batches dealt 3/3/2 on 3 replicas), test_growth.py and, at the demos' sizes,
test_bitwise_sweep.py."""

import jax
import pytest
from conftest import optimised_compiles, tiny_config

from elasjax.plan import planner
from elasjax.core import treesum
from elasjax.compilation.executables import compile_plan
from elasjax.layout.state import StateFactory, make_optimizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exe_cache():
    """Optimised compiles for this module only (shadows conftest's shared cache)."""
    with optimised_compiles(16) as cache:
        yield cache


def _temp_bytes(*over: str) -> tuple[int, int]:
    """(temporary bytes of the train executable, gradient bytes per device) of the initial plan."""
    cfg = tiny_config("train.global_batch=64", "train.canonical_micro_batch=4", *over)
    topo = planner.Topology(tuple(range(8)), cfg.parallel.devices_per_host)
    plan = planner.initial_plan(topo, cfg)
    f = StateFactory(cfg, make_optimizer(cfg))
    exe = compile_plan(cfg, f, plan, {d.id: d for d in jax.devices()})
    grad = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(f.abstract.params))
    return exe.train.memory_analysis().temp_size_in_bytes, grad


def test_deterministic_extra_memory_does_not_grow_with_replicas(exe_cache):
    """K = 16 canonical micro-batches of 4 samples, tensor degree 1, on 2 and on 8 replicas.
    The old ordered sum gathered every slot's gradient on every device (K + 1 gradients, 17 here),
    so its extra memory was that whatever D; the tree keeps at most register_bound(16) = 7
    registers (5 at 2 replicas, 3 at 8), and the step adds the broadcast sum and its normalised
    copy. That bound is asserted at both replica counts, and the extra bytes at 8 replicas may not
    exceed those at 2 by more than one gradient (XLA's own buffers vary a little with the
    layout)."""
    extra = {}
    for D in (2, 8):
        # the default step with micro-batches of the same 4 samples, so activations match
        over = [f"parallel.data={D}", "parallel.tensor=1", f"train.microbatches={16 // D}"]
        det, grad = _temp_bytes(*over, "train.deterministic=true")
        base, _ = _temp_bytes(*over)
        extra[D] = det - base
        print(f"D={D}: temp bytes deterministic {det}, default {base}, gradient {grad}")
        # the registers, plus the broadcast sum and its normalised copy
        assert extra[D] <= (treesum.register_bound(16) + 2) * grad, (D, extra[D], grad)
    assert extra[8] <= extra[2] + grad, (extra, grad)
