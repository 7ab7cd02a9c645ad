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
