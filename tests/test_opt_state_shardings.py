"""`elasjax.opt_state_shardings`: an optax state gets its parameters' shardings, for chains,
LAMB and Adafactor's factored statistics; a leaf it cannot place is an error naming it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import elasjax

MESH_SHAPE = (4, 2)
PARAMS = {"w": (16, 8), "b": (8,), "sq": (8, 8), "stack": (4, 16, 8)}
SPECS = {"w": P("data", "model"), "b": P("model"), "sq": P(None, "model"),
         "stack": P(None, "data", "model")}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh(MESH_SHAPE, ("data", "model"), devices=jax.devices()[:8])


def _params():
    keys = jax.random.split(jax.random.key(0), len(PARAMS))
    return {k: jax.random.normal(kk, s) for kk, (k, s) in zip(keys, PARAMS.items())}


def _specs(tree):
    return jax.tree.map(lambda s: s.spec, tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def _check_places_and_updates(tx, params, mesh, sh):
    """The state goes onto the shardings, and a jitted update with them computes what the
    unsharded update computes."""
    psh = {k: NamedSharding(mesh, SPECS[k]) for k in PARAMS}
    state = tx.init(params)
    grads = jax.tree.map(lambda x: 0.1 * jnp.cos(x), params)
    ref_u, ref_s = tx.update(grads, state, params)
    step = jax.jit(tx.update, in_shardings=(psh, sh, psh), out_shardings=(psh, sh))
    u, s = step(jax.device_put(grads, psh), jax.device_put(state, sh), jax.device_put(params, psh))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), u, ref_u)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), s, ref_s)


@pytest.mark.parametrize("name", ["chain", "lamb"])
def test_moments_follow_their_parameters_and_counters_are_replicated(name, mesh):
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    tx = {
        "chain": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.1)),
        "lamb": optax.lamb(sched),
    }[name]
    params = _params()
    psh = {k: NamedSharding(mesh, SPECS[k]) for k in PARAMS}
    sh = elasjax.opt_state_shardings(tx, tx.init(params), params, psh)
    adam = sh[1][0] if name == "chain" else sh[0]
    assert _specs(adam.mu) == SPECS and _specs(adam.nu) == SPECS
    moments = {id(x) for x in jax.tree.leaves((adam.mu, adam.nu))}
    rest = [x for x in jax.tree.leaves(sh) if id(x) not in moments]
    assert rest and all(x.spec == P() for x in rest)  # counts: replicated
    _check_places_and_updates(tx, params, mesh, sh)


def test_adafactor_factored_statistics_keep_the_dimensions_they_keep(mesh):
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
    params = _params()
    psh = {k: NamedSharding(mesh, SPECS[k]) for k in PARAMS}
    state = tx.init(params)
    fs = elasjax.opt_state_shardings(tx, state, params, psh)[0]
    shapes = jax.tree.map(lambda x: x.shape, state[0])
    # [16, 8] 'w' (data, model): v_row is [8] (rows reduced), v_col [16]
    assert shapes.v_row["w"] == (8,) and fs.v_row["w"].spec == P("model")
    assert shapes.v_col["w"] == (16,) and fs.v_col["w"].spec == P("data")
    # a stacked [4, 16, 8]: the leading axis kept as it is
    assert shapes.v_row["stack"] == (4, 8) and fs.v_row["stack"].spec == P(None, "model")
    assert shapes.v_col["stack"] == (4, 16) and fs.v_col["stack"].spec == P(None, "data")
    # square [8, 8] (None, model): row and column statistics both [8]; which dimension was left
    # out is ambiguous, so the entry they disagree on is replicated
    assert fs.v_row["sq"].spec == P(None) and fs.v_col["sq"].spec == P(None)
    # unfactored 'b' keeps its full second moment; placeholders of size 1 are replicated
    assert fs.v["b"].spec == P("model") and fs.v_row["b"].spec == P() and fs.v["w"].spec == P()
    assert fs.count.spec == P()
    _check_places_and_updates(tx, params, mesh, elasjax.opt_state_shardings(tx, state, params, psh))


def test_a_leaf_of_another_shape_is_an_error_naming_it_unless_replication_is_asked(mesh):
    history = optax.GradientTransformation(
        lambda p: {"h": jax.tree.map(lambda x: jnp.zeros((3, *x.shape)), p)},
        lambda u, s, p=None: (u, s),
    )
    params = _params()
    psh = {k: NamedSharding(mesh, SPECS[k]) for k in PARAMS}
    with pytest.raises(ValueError, match=r"leaf 'h/b' has shape \(3, 8\).*parameter's shape "
                                         r"\(8,\).*unmatched='replicate'"):
        elasjax.opt_state_shardings(history, history.init(params), params, psh)
    sh = elasjax.opt_state_shardings(history, history.init(params), params, psh,
                                     unmatched="replicate")
    assert all(x.spec == P() for x in jax.tree.leaves(sh))
    with pytest.raises(ValueError, match="unmatched = 'drop'; allowed values: 'error', 'replicate'"):
        elasjax.opt_state_shardings(history, history.init(params), params, psh, unmatched="drop")


def test_abstract_states_work_and_partition_over_composes(mesh):
    """From `jax.eval_shape` alone (no arrays), and ZeRO-1 over `data` on top."""
    tx = optax.adamw(1e-3)
    params = jax.eval_shape(_params)
    psh = {k: NamedSharding(mesh, SPECS[k]) for k in PARAMS}
    state = jax.eval_shape(tx.init, params)
    sh = elasjax.opt_state_shardings(tx, state, params, psh)
    zero1, left = elasjax.partition_over(sh, state, "data")
    assert zero1[0].mu["sq"].spec == P("data", "model")  # its free dimension, over data
    # 'b' [8] is sharded over model already, with no dimension left: it stays, and is listed
    assert zero1[0].mu["b"].spec == P("model") and sorted(left) == ["0/mu/b", "0/nu/b"]


def test_zero_stages_of_the_loop_are_sharding_edits_for_your_own_state(mesh):
    """`zero_shardings` speaks the loop's `zero.stage`: 0 as given, 1 the optimizer state over
    `data`, 3 the parameters too; 2 (the loop's gradient accumulators) is refused by name."""
    tx = optax.adamw(1e-3)
    params = jax.eval_shape(_params)
    psh = {k: NamedSharding(mesh, SPECS[k]) for k in PARAMS}
    state = jax.eval_shape(tx.init, params)
    osh = elasjax.opt_state_shardings(tx, state, params, psh)
    z0 = elasjax.zero_shardings(0, psh, osh, params, state)
    assert (z0.params, z0.opt, z0.left) == (psh, osh, [])
    z1 = elasjax.zero_shardings(1, psh, osh, params, state)
    assert z1.params == psh and z1.opt == elasjax.partition_over(osh, state, "data")[0]
    assert z1.opt[0].mu["sq"].spec == P("data", "model")
    z3 = elasjax.zero_shardings(3, psh, osh, params, state)
    assert z3.opt == z1.opt and z3.params["sq"].spec == P("data", "model")
    assert sorted(z3.left) == ["0/mu/b", "0/nu/b", "b"]  # 'b' has no free dimension left
    for bad, why in ((2, "your step owns its gradients"), (4, "")):
        with pytest.raises(ValueError, match=rf"stage = {bad}{'.*' if why else ''}{why}.*allowed values: 0, 1, 3"):
            elasjax.zero_shardings(bad, psh, osh, params, state)
