"""Pipeline parallelism: GPipe equals the unpipelined model; failures re-partition layers.

Tolerances: loss relative 1e-6 and gradients within 1e-5 of each leaf's scale against the
single-device model (f32 reduction order; measured <= 5e-7); training losses relative 1e-5
per step against the fault-free run, as in test_trainer.
"""

import jax
import numpy as np
import pytest

from conftest import tiny_config
from elasjax import checksum, pipeline, planner, rng, step
from elasjax.data import DataPipeline
from elasjax.faults import inject
from elasjax.mesh import make_mesh
from elasjax.reshard import transition
from elasjax.state import StateFactory, make_optimizer
from elasjax import trainer

DEVS = {d.id: d for d in jax.devices()}
TOPO = planner.Topology(tuple(range(8)), 2)


def test_stage_layout_slots_round_trip():
    lay = pipeline.StageLayout((5, 4, 4))
    assert lay.slots == 5 and lay.slot_layer().tolist() == [
        [0, 1, 2, 3, 4], [5, 6, 7, 8, -1], [9, 10, 11, 12, -1]
    ]
    x = {"w": np.arange(13 * 3, dtype=np.float32).reshape(13, 3)}
    slots = jax.jit(lambda t: pipeline.to_slots(t, lay))(x)
    assert slots["w"].shape == (3, 5, 3) and float(slots["w"][1, 4].sum()) == 0.0
    np.testing.assert_array_equal(jax.jit(lambda t: pipeline.from_slots(t, lay))(slots)["w"], x["w"])


def test_layer_partition_is_minimax_and_prefers_fewer_moves():
    assert planner.layer_partition(13, 3) == (5, 4, 4) or sorted(planner.layer_partition(13, 3)) == [4, 4, 5]
    # 8 layers, 4 -> 3 stages: every optimal split has a 3-layer stage; keep as many layers
    # where they were as possible
    part = planner.layer_partition(8, 3, previous=(2, 2, 2, 2))
    assert max(part) == 3 and sum(part) == 8


@pytest.fixture(scope="module")
def model_and_batch():
    cfg = tiny_config("model.n_layers=5", "parallel.tensor=1", "parallel.data=8")
    f = StateFactory(cfg, make_optimizer(cfg.train))
    params = jax.device_get(jax.jit(f._init_params)())
    dp = DataPipeline(cfg.data, cfg.model, cfg.rng, 32)
    key = rng.step_key(rng.root_key(0), 2)
    one = planner.plan_for_shape([0], TOPO, cfg, data=1, tensor=1, microbatches=4)
    batch = dp.batch(2, one).arrays()
    lf = step.make_loss_fn(cfg, f.model, False)

    def ref(p):
        return sum(lf(p, jax.tree.map(lambda x: x[k], batch), key) for k in range(4))

    return cfg, f, params, dp, key, jax.device_get(jax.jit(jax.value_and_grad(ref))(params))


@pytest.mark.parametrize(
    "data,stages,tensor,part",
    [(2, 2, 2, (3, 2)), (1, 4, 2, (2, 1, 1, 1)), (2, 4, 1, (1, 2, 1, 1))],
)
def test_pipelined_loss_and_grads_equal_unpipelined(model_and_batch, data, stages, tensor, part):
    cfg, f, params, dp, key, (v0, g0) = model_and_batch
    lay = pipeline.StageLayout(part)
    mesh = make_mesh({"data": data, "stage": stages, "tensor": tensor}, jax.devices()[: data * stages * tensor])
    plan = planner.Plan(tuple(range(data)), data, 1, 4, 32 // data // 4, 32)
    batch = dp.batch(2, plan).arrays()
    pp = dict(params, layers=pipeline.to_slots(params["layers"], lay))
    v, g = jax.jit(
        jax.value_and_grad(lambda p: pipeline.pipeline_loss(p, batch, key, cfg.model, lay, mesh))
    )(pp)
    g = dict(g, layers=pipeline.from_slots(g["layers"], lay))
    assert abs(float(v) - float(v0)) <= 1e-6 * abs(float(v0))
    for a, b in zip(jax.tree.leaves(jax.device_get(g)), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))))


PIPE = [
    "model.n_layers=4", "parallel.data=2", "parallel.stage=4", "parallel.tensor=1",
    "parallel.max_stage=4", "parallel.replan=keep_tensor", "train.microbatches=4",
    "parallel.min_stage=2", "train.steps=10",
]


def test_partition_change_moves_layers_exactly():
    cfg = tiny_config(*PIPE)
    f = StateFactory(cfg, make_optimizer(cfg.train))
    plan = planner.initial_plan(TOPO, cfg)
    assert plan.name.startswith("d2s4") and plan.partition == (1, 1, 1, 1)
    lay = f.layout(plan)
    mesh = make_mesh(plan.mesh_shape, [DEVS[i] for i in plan.device_ids])
    state = jax.jit(lay.init_fn, out_shardings=lay.shardings(mesh))()
    before = checksum.to_host(jax.jit(lay.checksums)(state))
    live = [0, 1, 2, 4, 5, 6, 7]
    targets = [
        planner.fast_path_plan(plan, live, cfg),
        planner.plan_for_shape(live, TOPO, cfg, data=3, tensor=1, stage=2),
        planner.plan_for_shape(live, TOPO, cfg, data=7, tensor=1),
    ]
    for new in targets:
        state = jax.jit(lay.init_fn, out_shardings=lay.shardings(mesh))()
        store, _ = inject(state, (3,))
        nl = f.layout(new)
        nm = make_mesh(new.mesh_shape, [DEVS[i] for i in new.device_ids])
        ns, log = transition(store, nl.shardings(nm), devices=DEVS, old_layout=lay, new_layout=nl)
        assert 3 not in log.sources()
        assert checksum.to_host(jax.jit(nl.checksums)(ns)) == before  # layer-identity checksums
    assert targets[0].stage == 4 and targets[0].data == 1  # the fast path moves no layer


@pytest.mark.slow
def test_pipeline_failure_async_migration_matches_fault_free(exe_cache):
    """Default (non-deterministic) mode: one device of data 2 x stage 4 fails; the run resumes on
    the fast path, cuts over to the re-partitioned plan, and its losses stay within 1e-5 of the
    fault-free run (the blocking migration and bitwise equality: the deterministic test below)."""
    fault = "faults=[{at_step: 3, devices: [3]}]"
    ref = trainer.run(tiny_config(*PIPE, "faults=[]"), exe_cache=exe_cache)
    asyn = trainer.run(
        tiny_config(*PIPE, fault, "recovery.migration=async", "recovery.max_fast_path_steps=2"),
        exe_cache=exe_cache,
    )
    assert ref.plans == [planner.initial_plan(TOPO, tiny_config(*PIPE)).name]
    (a_ev,), (mig,) = asyn.recoveries, asyn.migrations
    assert a_ev.migration == "async" and a_ev.to_plan.startswith("d1s4") and a_ev.bytes_moved == 0
    assert mig["to_plan"] == a_ev.optimal_plan and mig["step"] == 5 and mig["verified"]
    assert asyn.final_plan.name == a_ev.optimal_plan and asyn.final_plan.stage in (2, 3)
    assert all(3 not in log.sources() for log in asyn.transfer_logs)
    for s in range(10):
        rel = abs(asyn.losses[s] - ref.losses[s]) / ref.losses[s]
        assert rel <= 1e-5, (s, rel)


@pytest.mark.slow
def test_deterministic_async_and_blocking_migrations_are_bitwise_equal(exe_cache):
    """Deterministic mode on a pipeline (data 2 x stage 4, one device fails): the blocking
    migration goes straight to the re-partitioned plan; the async one runs two steps on the
    fast path (one replica, no layer moved) first. Every loss, every held-out loss and the final
    state of both are bitwise equal to each other and to the fault-free run."""
    det = [*PIPE, "parallel.min_stage=2", "train.deterministic=true", "train.eval_every=3"]
    fault = "faults=[{at_step: 3, devices: [3]}]"
    ref = trainer.run(tiny_config(*det, "faults=[]"), exe_cache=exe_cache)
    blocking = trainer.run(tiny_config(*det, fault), exe_cache=exe_cache)
    asyn = trainer.run(
        tiny_config(*det, fault, "recovery.migration=async", "recovery.max_fast_path_steps=2"),
        exe_cache=exe_cache,
    )
    (b_ev,), (a_ev,), (mig,) = blocking.recoveries, asyn.recoveries, asyn.migrations
    assert b_ev.migration == "blocking" and b_ev.to_plan.split("t")[0] in ("d2s3", "d3s2")
    assert a_ev.migration == "async" and a_ev.to_plan.startswith("d1s4") and a_ev.bytes_moved == 0
    assert mig["to_plan"] == b_ev.to_plan and mig["step"] == 5 and mig["bytes_moved"] > 0
    for run in (blocking, asyn):
        assert all(3 not in log.sources() for log in run.transfer_logs)
    assert sum(log.bytes_moved for log in asyn.transfer_logs) == mig["bytes_moved"]
    f = StateFactory(tiny_config(*det), make_optimizer(tiny_config(*det).train))

    def canonical(run):  # the final plans differ (4 vs 3 stages): compare layer by layer
        return jax.device_get(jax.jit(f.layout(run.final_plan).to_canonical)(run.state))

    want = canonical(ref)
    for run in (blocking, asyn):
        assert run.losses == ref.losses and run.eval_losses == ref.eval_losses
        assert run.checksums == ref.checksums
        same = jax.tree.map(lambda a, b: np.array_equal(a, b), canonical(run), want)
        assert all(jax.tree.leaves(same))
