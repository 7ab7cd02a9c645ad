"""Gradient scale: one step's gradient on any plan equals the single-device gradient.

Tolerance: the consistency contract's 1e-5, per leaf: |g - g_ref| <= 1e-5 * max|g_ref| +
1e-5 * |g_ref| (f32, reduction order differs between layouts; measured worst case ~7e-7 of the
leaf's scale).
"""

import jax
import numpy as np
import pytest
from conftest import tiny_config

from elasjax.plan import planner
from elasjax.layout import step
from elasjax.loop.data import DataPipeline
from elasjax.core.mesh import make_mesh
from elasjax.core.sharding import batch_shardings
from elasjax.layout.state import StateFactory, make_optimizer

CFG = tiny_config()
TOPO = planner.Topology(tuple(range(8)), 2)
DEVS = {d.id: d for d in jax.devices()}
STEP = 3


@pytest.fixture(scope="module")
def setup():
    f = StateFactory(CFG, make_optimizer(CFG))
    dp = DataPipeline(CFG.data, CFG.model, CFG.rng, CFG.train.global_batch)
    params = jax.device_get(f.init(make_mesh({"data": 1}, [DEVS[0]])).params)
    return f, dp, params


def _grads(setup, plan, *, count_padding=False):
    f, dp, params = setup
    mesh = make_mesh(plan.mesh_shape, [DEVS[i] for i in plan.device_ids])
    sh = f.shardings(mesh)
    arrays = dp.batch(STEP, plan).arrays()
    if count_padding:
        arrays["weights"] = np.ones_like(arrays["weights"])
    bsh = batch_shardings(mesh, arrays)
    batch = {k: jax.device_put(v, bsh[k]) for k, v in arrays.items()}
    fn = jax.jit(step.make_grad_fn(CFG, f.model, mesh, sh), static_argnums=2)
    return jax.device_get(fn(jax.device_put(params, sh.params), batch, STEP))


def _close(g, ref):
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(b))))


@pytest.fixture(scope="module")
def reference(setup):
    return _grads(setup, planner.plan_for_shape([0], TOPO, CFG, data=1, tensor=1, microbatches=1))


@pytest.mark.parametrize("n,data,tensor", [(8, 4, 2), (7, 7, 1), (3, 3, 1)])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_gradient_matches_single_device(setup, reference, n, data, tensor, micro):
    plan = planner.plan_for_shape(list(range(n)), TOPO, CFG, data=data, tensor=tensor, microbatches=micro)
    assert plan.microbatches == micro
    loss, g = _grads(setup, plan)
    assert abs(loss - reference[0]) <= 1e-5 * reference[0]
    _close(g, reference[1])


def test_counting_padding_breaks_the_scale(setup, reference):
    """Negative control: weight the 7-device plan's padding slots like samples -> not equal."""
    plan = planner.plan_for_shape(list(range(7)), TOPO, CFG, data=7, tensor=1, microbatches=2)
    assert plan.slots > CFG.train.global_batch
    _, g = _grads(setup, plan, count_padding=True)
    with pytest.raises(AssertionError):
        _close(g, reference[1])


def test_the_layer_loop_recomputes_all_but_its_products_and_the_gradient_stays():
    """`model.remat: dots` puts the GPT's layer loop under `jax.checkpoint` keeping its matrix
    products and dropout masks; `none` does not; `auto` (the default) is `dots` in either mode.
    The gradient is the same to the contract's 1e-5 (the elementwise work is recomputed, not
    changed)."""
    from elasjax.models import gpt

    for det, remat in ((True, "dots"), (False, "dots")):
        cfg = tiny_config(f"train.deterministic={str(det).lower()}")
        assert cfg.model.remat == "auto" and cfg.model_in_force.remat == remat
        assert StateFactory(cfg, make_optimizer(cfg)).model is gpt.spec(cfg.model_in_force)
    with pytest.raises(ValueError, match="model.remat = 'auto'"):
        gpt.forward({}, None, None, tiny_config().model, False)

    cfgs = {r: tiny_config(f"model.remat={r}").model for r in ("dots", "none")}
    params = gpt.init_params(cfgs["none"], jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, cfgs["none"].seq_len), 0, 256)
    keys = jax.random.split(jax.random.key(2), 2)

    def grad(cfg):
        def loss(p):
            return gpt.token_losses(p, cfg, tokens, tokens, keys, False).sum()
        return jax.grad(loss)(params), str(jax.make_jaxpr(jax.grad(loss))(params))

    (g_dots, text_dots), (g_none, text_none) = grad(cfgs["dots"]), grad(cfgs["none"])
    assert "remat" in text_dots or "checkpoint" in text_dots
    assert "remat" not in text_none and "checkpoint" not in text_none
    _close(g_dots, g_none)


def test_the_deterministic_step_gives_plain_value_and_grads_numbers(tmp_path):
    """An absolute check of the deterministic mode (the bitwise tests only compare it with
    itself, so a scale error common to every mesh would pass them): its first step on the
    default 4 x 2 mesh, ZeRO-1, clipped, against a plain `jax.value_and_grad` of the same global
    batch on one device (the model's weighted loss over the real tokens, the same per-sample
    keys, `optax.clip_by_global_norm`): the loss and gradient norm within the contract's 1e-5,
    and Adam's moments after the step (0.1 x the clipped gradient and 0.05 x its square: the
    gradient itself, scale included) within 1e-5 of each leaf's largest value."""
    import jax.numpy as jnp
    import optax

    from elasjax.core import rng
    from elasjax.loop import trainer
    from elasjax.observe.metrics import read_jsonl

    cfg = tiny_config("train.deterministic=true", "zero.stage=1", "train.steps=1", "faults=[]",
                      "train.grad_clip=0.5")
    run = trainer.run(cfg, tmp_path)
    met = read_jsonl(tmp_path / "metrics.jsonl")[0]
    f = StateFactory(cfg, make_optimizer(cfg))
    adam = jax.device_get(jax.jit(f.layout(run.final_plan).to_canonical)(run.state)).opt_state[1][0]

    dp = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
    one = planner.plan_for_shape([0], TOPO, cfg, data=1, tensor=1, microbatches=1)
    # the whole global batch as one array (the micro-batches the pipeline deals, side by side)
    mb = {k: v.reshape((-1,) + v.shape[2:]) for k, v in dp.batch(0, one).arrays().items()}
    assert mb["weights"].sum() == cfg.train.global_batch
    params = jax.device_get(f.init(make_mesh({"data": 1}, [DEVS[0]])).params)

    def loss_fn(p):
        keys = rng.sample_keys(rng.step_key(rng.root_key(cfg.train.seed), 0), mb["key_ids"])
        total = f.model.loss(p, mb, keys, mb["weights"], False)
        return total / jnp.sum(mb["weights"] * mb["counts"])

    loss, g = jax.jit(jax.value_and_grad(loss_fn))(params)
    norm = float(optax.tree.norm(g))
    clipped = jax.tree.map(lambda x: x * min(1.0, cfg.train.grad_clip / norm), g)
    assert norm > cfg.train.grad_clip  # the step clipped
    assert abs(met["loss"] - float(loss)) <= 1e-5 * abs(float(loss)), (met["loss"], float(loss))
    assert abs(met["grad_norm"] - norm) <= 1e-5 * norm, (met["grad_norm"], norm)
    for got, want in ((adam.mu, jax.tree.map(lambda x: 0.1 * x, clipped)),
                      (adam.nu, jax.tree.map(lambda x: 0.05 * x * x, clipped))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))))
