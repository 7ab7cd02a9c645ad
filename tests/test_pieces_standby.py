"""The pieces' standby (`ElasticState.standby`): one compile per mesh shape, the other meshes of
that shape rebound to their devices with the same bits; progress, the cap, the expected cost,
and the fallbacks to compiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import elasjax
from elasjax.compilation import executables
from elasjax.core.counters import CompileCounter
from elasjax.compilation.pieces_standby import shape_key

AXES = {"data": -1, "model": (2, 1)}


def _state():
    return {
        "w": jnp.arange(12 * 4, dtype=jnp.float32).reshape(12, 4) / 7.0,
        "n": jnp.int32(3),
        "key": jax.random.key(5),
    }


def _layout(m):
    return {"w": NamedSharding(m, P(None, "model")), "n": NamedSharding(m, P()),
            "key": NamedSharding(m, P())}


def _step(s, b):
    noise = jax.random.normal(jax.random.fold_in(s["key"], s["n"]), s["w"].shape)
    h = jnp.tanh(b["x"] @ s["w"])  # (rows, 4)
    loss = jnp.sum(h * h * b["weight"][:, None]) / jnp.sum(b["weight"])
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(b["x"] @ w) ** 2))(s["w"])
    w = s["w"] - 0.01 * g + 1e-3 * noise
    return {"w": w, "n": s["n"] + 1, "key": s["key"]}, loss


def _batch_like(m):
    n = 2 * m.shape["data"]
    sh = NamedSharding(m, P("data"))
    return {"x": jax.ShapeDtypeStruct((n, 12), jnp.float32, sharding=sh),
            "weight": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sh)}


def _es():
    mesh, _ = elasjax.plan_mesh(jax.devices(), AXES)
    return elasjax.ElasticState(_state(), _layout, mesh, axes=AXES, devices_per_host=2)


def _make_step(es):
    return lambda m: jax.jit(_step, out_shardings=(es.shardings(m), None))


def _batch(m, seed=0):
    like = _batch_like(m)
    rs = np.random.RandomState(seed)  # noqa: NPY002
    x = rs.normal(size=like["x"].shape).astype(np.float32)
    weight = np.ones(like["weight"].shape, np.float32)
    return {"x": jax.device_put(x, like["x"].sharding),
            "weight": jax.device_put(weight, like["weight"].sharding)}


def _expected_builds(es):
    """(compiles, rebinds) the likely meshes need: one compile per shape the current mesh's
    compile does not cover."""
    likely = es.likely_meshes()
    shapes = {shape_key(m) for m in likely} - {shape_key(es.mesh)}
    return len(shapes), len(likely) - len(shapes)


def test_one_compile_per_shape_the_rest_rebound_with_the_same_bits():
    es = _es()
    seen = []
    first = es.standby(_make_step(es), _batch_like, wait=True, progress=seen.append)
    likely = es.likely_meshes()
    compiles, rebinds = _expected_builds(es)
    assert rebinds > 0 and compiles < len(likely)
    # the announcement before building: what will be compiled and rebound, and the cost so far
    assert first.event == "plan" and (first.to_compile, first.to_rebind) == (compiles, rebinds)
    assert first.total == len(likely) + 1 and first.built == 1 and first.left_out == 0
    assert first.expected_s > 0 and "to compile" in first.message
    built = [r for r in seen if r.event == "built"]
    assert [r.built for r in built] == list(range(2, len(likely) + 2))
    assert built[-1].compiled == compiles + 1 and built[-1].rebound == rebinds
    assert built[-1].to_compile == built[-1].to_rebind == 0
    assert es._standby.compiled == compiles and es._standby.rebound == rebinds
    origins = {m: es._standby.get(m).origin for m in likely}
    assert sorted(origins.values()).count("rebound") == rebinds
    for m in likely:
        if origins[m] != "rebound":
            continue
        step, sums = es._standby.get(m)
        native_step, native_sums = (x.compile() for x in es._lower(m))
        state = jax.device_put(es.state, es.shardings(m))
        batch = _batch(m, seed=len(m.devices.flat))
        got, want = step(state, batch), native_step(state, batch)
        ids = {d.id for d in m.devices.flat}
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert {d.id for d in u.sharding.device_set} == ids
            if jnp.issubdtype(u.dtype, jax.dtypes.prng_key):
                u, v = jax.random.key_data(u), jax.random.key_data(v)
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
        got_sums, want_sums = sums(state), native_sums(state)
        assert jax.tree.structure(got_sums) == jax.tree.structure(want_sums)
        for u, v in zip(jax.tree.leaves(got_sums), jax.tree.leaves(want_sums)):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    # a rebind compiles nothing
    m = next(m for m in likely if origins[m] == "rebound")
    with CompileCounter() as cc:
        again = es._standby.build(m)
    assert cc.count == 0 and again.origin == "rebound"
    es.close()


def test_a_recovery_runs_on_a_rebound_executable():
    es = _es()
    es.standby(_make_step(es), _batch_like, wait=True, progress=False)
    rebound = [m for m in es.likely_meshes() if es._standby.get(m).origin == "rebound"]
    gone = sorted(set(es.devices) - {d.id for d in rebound[0].devices.flat})
    es.commit(es.state, 0)
    es.simulate_failure(gone)
    rec = es.recover()
    assert rec.standby_hit is True and es.mesh == rebound[0]
    assert es.executable() is es._standby.get(rebound[0])[0]
    state, loss = es.executable()(es.state, _batch(es.mesh))
    want_state, want_loss = es._lower(es.mesh)[0].compile()(es.state, _batch(es.mesh))
    assert float(loss) == float(want_loss)
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(want_state["w"]))
    es.close()


def test_max_meshes_caps_the_build_and_says_how_many_it_left_out():
    es = _es()
    lines = []
    first = es.standby(_make_step(es), _batch_like, wait=True, max_meshes=2,
                       progress=lambda r: lines.append(str(r)))
    likely = es.likely_meshes()
    assert first.left_out == len(likely) - 2 and first.total == 3
    assert [m for m in likely if es._standby.ready(m)] == likely[:2]
    assert f"leaves {len(likely) - 2} likely meshes out" in lines[0]
    assert lines[-1].startswith("standby: 3/3 meshes built")
    es.close()


@pytest.mark.parametrize("field, value, allowed", [
    ("max_meshes", -1, "None .* or an int >= 0"),
    ("max_meshes", 2.5, "None .* or an int >= 0"),
    ("max_meshes", True, "None .* or an int >= 0"),
    ("rebind", "yes", "True, False"),
    ("progress", "stderr", "True .*False .*or a callable"),
])
def test_bad_standby_settings_name_the_field_and_the_allowed_values(field, value, allowed):
    es = _es()
    with pytest.raises(ValueError, match=rf"standby: {field} = .*; allowed values: {allowed}"):
        es.standby(_make_step(es), _batch_like, **{field: value})
    assert es._standby is None  # nothing started


def test_a_program_that_depends_on_the_devices_is_compiled_not_rebound():
    """A step whose program reads its mesh's device ids differs between meshes of one shape:
    the lowered programs are compared, so such a mesh is compiled, and says why."""
    es = _es()

    def make_step(m):
        first = float(m.devices.flat[0].id)
        return jax.jit(lambda s, b: _step(s, b)[0] | {"w": s["w"] + first},
                       out_shardings=es.shardings(m))

    seen = []
    es.standby(make_step, _batch_like, wait=True, progress=seen.append)
    for m in es.likely_meshes():
        step = es._standby.get(m)[0]
        got = step(jax.device_put(es.state, es.shardings(m)), _batch(m))
        np.testing.assert_array_equal(
            np.asarray(got["w"]), np.asarray(es.state["w"]) + m.devices.flat[0].id)
    differ = [r for r in seen if "its program differs" in r.how]
    assert differ and all(r.how.startswith("compiled: ") for r in differ)
    es.close()


def test_without_loading_onto_other_devices_every_mesh_is_compiled_and_says_why(monkeypatch):
    monkeypatch.setattr(executables, "can_load", lambda: False)
    es = _es()
    seen = []
    first = es.standby(_make_step(es), _batch_like, wait=True, progress=seen.append)
    n = len(es.likely_meshes())
    assert (first.to_compile, first.to_rebind) == (n, 0)
    assert "no rebinding: jax" in first.message and "cannot load an executable" in first.message
    assert es._standby.compiled == n and es._standby.rebound == 0
    es.close()
    es = _es()
    first = es.standby(_make_step(es), _batch_like, rebind=False, progress=False)
    assert (first.to_compile, first.to_rebind) == (len(es.likely_meshes()), 0)
    es.close()
