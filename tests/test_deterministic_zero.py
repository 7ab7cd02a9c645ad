"""Deterministic mode at every ZeRO stage: bitwise equal to the fault-free run through failures.

Compiled with XLA optimisations on, as users run it (the FMA contraction that used to change
Adam's moments between layouts is an optimised-compile effect; `step._apply_apart`). The
tensor degree is kept (2), so a device failure and then a host failure take the run from 4 to
3 to 2 replicas (ZeRO-0, and ZeRO-1 whose storage is re-partitioned each time); ZeRO-2 and
ZeRO-3 lose a host (4 to 3 replicas, an uneven partition). The fault-free ZeRO-1 run is every
test's reference (one compile of it for the module): the stage changes no bit. The ZeRO demo
itself, as users compile it, through every data degree and under `elasjax launch`:
tests/test_bitwise_sweep.py."""

import jax
import numpy as np
import pytest
from conftest import optimised_compiles, tiny_config

from elasjax.compilation.executables import ExecutableCache
from elasjax.loop import trainer
from elasjax.layout.state import StateFactory, StateLayout, make_optimizer
from elasjax.plan.planner import Topology, initial_plan
from elasjax.observe.metrics import read_jsonl

pytestmark = pytest.mark.slow

# held-out losses at steps 2, 5 and 8: the eval step is bitwise across meshes too
COMMON = ["train.steps=9", "train.deterministic=true", "zero.stage=1", "train.eval_every=3"]


@pytest.fixture(scope="module")
def exe_cache():
    """Optimised compiles for this module only (shadows conftest's shared cache)."""
    with optimised_compiles(16) as cache:
        yield cache


FAULTS = "faults=[{at_step: 3, devices: [3]}, {at_step: 6, hosts: [0]}]"
# ZeRO-2 and -3 sum the gradient as ZeRO-1 does (one tree, then partitioned): one
# re-partition shows it; the second failure would add two more optimised compiles per stage
ONE_HOST = "faults=[{at_step: 5, hosts: [0]}]"


@pytest.fixture(scope="module")
def reference(exe_cache):
    """The fault-free deterministic ZeRO-1 run."""
    return trainer.run(tiny_config(*COMMON, "faults=[]"), exe_cache=exe_cache)


def _canonical(r, stage: int = 1):
    cfg = tiny_config(*COMMON, f"zero.stage={stage}")
    f = StateFactory(cfg, make_optimizer(cfg))
    return jax.device_get(jax.jit(f.layout(r.final_plan).to_canonical)(r.state))


def _differing_leaves(a, b) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(a)[0]
    assert len(flat) == len(jax.tree.leaves(b)) > 0
    return [jax.tree_util.keystr(path) for (path, x), y in zip(flat, jax.tree.leaves(b))
            if not np.array_equal(np.asarray(x), np.asarray(y))]


# data 8 x tensor 1, every step clipped (grad_clip far below the norm). Clipped steps through
# shrinks to every data degree: the ZeRO demo's chain, tests/test_bitwise_sweep.py.
CLIPPED = ["train.steps=4", "train.deterministic=true", "zero.stage=1", "parallel.data=8",
           "parallel.tensor=1", "train.grad_clip=0.05"]


def test_the_gradient_left_in_storage_chunks_gives_the_gathered_bits(exe_cache, tmp_path,
                                                                     monkeypatch):
    """The tree sum's cross phase leaves each replica the storage part of the leaves whose ZeRO
    storage is their row cut in equal parts (`StateLayout.summed_in_storage`), and the norm sums
    their tiles there; gathered whole first on every replica, as the step did before, the same
    clipped steps give the same norms, losses and state, bit for bit."""
    cfg = tiny_config(*CLIPPED, "faults=[]")
    plan = initial_plan(Topology(tuple(range(8)), 2), cfg)
    layout = StateFactory(cfg, make_optimizer(cfg)).layout(plan)
    assert len(layout.summed_in_storage()) >= 4, layout.summed_in_storage()
    runs = {"chunks": trainer.run(cfg, tmp_path / "chunks", exe_cache=exe_cache)}
    monkeypatch.setattr(StateLayout, "summed_in_storage", lambda self: frozenset())
    runs["gathered"] = trainer.run(cfg, tmp_path / "gathered", exe_cache=ExecutableCache(2))
    norms = {k: [r["grad_norm"] for r in read_jsonl(tmp_path / k / "metrics.jsonl")] for k in runs}
    assert min(norms["chunks"]) > 0.05 and norms["chunks"] == norms["gathered"], norms
    assert runs["chunks"].losses == runs["gathered"].losses
    assert runs["chunks"].checksums == runs["gathered"].checksums
    assert _differing_leaves(_canonical(runs["chunks"]), _canonical(runs["gathered"])) == []


@pytest.mark.parametrize("stage", [2, 3])
def test_deterministic_zero2_and_zero3_add_as_zero1_does_through_a_failure(stage, exe_cache,
                                                                         reference):
    """ZeRO-2 and ZeRO-3 sum the gradient whole in the same tree and partition it after:
    through a host failure (4 replicas to 3) every loss, checksum and state element equals the
    fault-free ZeRO-1 run's, bit for bit."""
    run = trainer.run(tiny_config(*COMMON, f"zero.stage={stage}", ONE_HOST), exe_cache=exe_cache)
    assert [p.split("m")[0] for p in run.plans] == ["d4t2", "d3t2"]
    assert all(f".z{stage}" in p for p in run.plans)
    assert len(run.recoveries) == 1 and run.recoveries[0].verify["leaves"] > 0
    assert sorted(run.losses) == list(range(9)) and run.losses == reference.losses
    assert run.eval_losses == reference.eval_losses
    # ZeRO-3 names its stored parameters by storage unit ("params::embed/embedding"); the
    # element identities, hence the values, are the parameters'
    same_names = {k.replace("params::", "params/"): v for k, v in run.checksums.items()}
    assert same_names == reference.checksums
    assert _differing_leaves(_canonical(run), _canonical(reference)) == []


@pytest.mark.parametrize("stage", [0, 1])
def test_deterministic_mode_is_bitwise_through_failures(stage, exe_cache, reference):
    """8 -> 6 -> 4 devices (a device, then a host; the tensor degree kept), replicated
    optimizer state (ZeRO-0) and partitioned (ZeRO-1): every loss, every held-out loss and
    every element of the final parameters and Adam moments (compared in canonical form: the
    final plans' storage layouts differ) equal the fault-free ZeRO-1 run's bit for bit, and
    ZeRO-1's checksums (taken of its storage form, which ZeRO-0 does not have) too."""
    run = trainer.run(tiny_config(*COMMON, f"zero.stage={stage}", FAULTS), exe_cache=exe_cache)
    assert [p.split("m")[0] for p in run.plans] == ["d4t2", "d3t2", "d2t2"]
    assert all((f".z{stage}" in p) == (stage > 0) for p in run.plans), run.plans
    assert len(run.recoveries) == 2 and all(r.verify["leaves"] > 0 for r in run.recoveries)
    assert sorted(run.losses) == list(range(9)) and run.losses == reference.losses
    assert sorted(run.eval_losses) == [2, 5, 8] and run.eval_losses == reference.eval_losses
    assert stage == 0 or run.checksums == reference.checksums
    assert _differing_leaves(_canonical(run, stage), _canonical(reference)) == []


def test_the_norm_of_chunks_is_the_norm_of_the_whole_leaf(exe_cache):
    """`StateLayout.fixed_order_norm` of the ZeRO demo's gradient shapes: summed from the
    replicas' storage chunks (8, 4 and 2 replicas, `summed_in_storage`) and from whole leaves (8,
    7, 6, 5 and 3 replicas), the same bits, for gradients whose magnitudes spread over decades.
    XLA:CPU's reduce gave a tile's sum different bits for a replica's chunk and for the whole
    leaf (the sums of a `[k, 256]` array's rows depend on k), and so did a multiply fused with
    the additions (FMA contraction for some shapes only): every run that shrank from 8 to 6
    replicas left the fault-free run's bits at its first clipped step after the shrink."""
    from jax.sharding import NamedSharding, PartitionSpec

    from elasjax import config
    from elasjax.core.mesh import make_mesh
    from elasjax.core.sharding import path_str

    cfg = config.load("configs/demo_zero.yaml", ["parallel.data=-1", "standby.enabled=false"])
    factory = StateFactory(cfg, make_optimizer(cfg))
    like = jax.eval_shape(factory._init_params)

    def norm_fn(n: int, chunks: bool):
        plan = initial_plan(Topology(tuple(range(n)), 2), cfg)
        layout = factory.layout(plan)
        mesh = make_mesh(plan.mesh_shape, [jax.devices()[i] for i in plan.device_ids])
        chunked = layout.summed_in_storage() if chunks else frozenset()
        assert not chunks or len(chunked) >= 5, chunked
        shardings = layout.param_shardings(mesh)
        specs = jax.tree.map(lambda sh: sh.spec, shardings)
        fn = jax.jit(lambda g, s: layout.fixed_order_norm(g, mesh, specs, s, chunked))

        def put(path, x, sh):
            if path_str(path) in chunked:  # replica r's chunk: elements [r * c, (r + 1) * c)
                sh = NamedSharding(mesh, PartitionSpec("data", None, None))
                x = x.reshape(plan.data, 1, -1)
            return jax.device_put(x, sh)

        return lambda g: float(fn(jax.tree_util.tree_map_with_path(put, g, shardings),
                                  np.int32(0)))

    fns = {(n, c): norm_fn(n, c) for n, c in
           [(8, True), (4, True), (2, True), (8, False), (7, False), (6, False), (5, False),
            (3, False)]}
    rng = np.random.default_rng(0)
    for trial in range(10):  # each leaf of its own scale: a 1-ulp change shows in the sum
        grads = jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 10.0 ** rng.uniform(
            -4, 0)).astype(np.float32), like)
        norms = {k: f(grads) for k, f in fns.items()}
        assert len(set(norms.values())) == 1, (trial, norms)
