"""Data order and random keys are functions of (seed, step, sample id), never of the layout."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import tiny_config
from elasjax import config
from elasjax.plan import planner
from elasjax.core import rng
from elasjax.loop.data import DataPipeline, global_sample_ids
from elasjax.core.mesh import make_mesh
from elasjax.models.gpt import sample_dropout

TOPO = planner.Topology(tuple(range(8)), 2)


def _plans(cfg):
    init = planner.initial_plan(TOPO, cfg)
    out = [init]
    for live in (range(7), range(5), range(3)):
        out.append(planner.replan(list(live), TOPO, cfg, init, init))
    return out


def test_step_samples_independent_of_plan():
    cfg = tiny_config()
    dp = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
    for step in (0, 5, 31):
        gids, idx = dp.step_ids(step)
        np.testing.assert_array_equal(gids, global_sample_ids(step, 32))
        per_plan = []
        for plan in _plans(cfg):
            hb = dp.batch(step, plan)
            real = hb.sample_ids[hb.weights > 0]
            assert sorted(real) == sorted(gids)  # each sample exactly once
            assert (hb.sample_ids[hb.weights == 0] == -1).all()
            order = np.argsort(hb.sample_ids[hb.weights > 0])
            per_plan.append(hb.inputs[hb.weights > 0][order])
        for x in per_plan[1:]:
            np.testing.assert_array_equal(x, per_plan[0])


def test_key_ids_per_sample_vs_per_device():
    base = tiny_config()
    abl = tiny_config("rng.mode=per_device")
    p8, p7 = _plans(base)[:2]
    for cfg, same in ((base, True), (abl, False)):
        dp = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
        maps = []
        for plan in (p8, p7):
            hb = dp.batch(2, plan)
            real = hb.weights > 0
            maps.append(dict(zip(hb.sample_ids[real].tolist(), hb.key_ids[real].tolist())))
        assert (maps[0] == maps[1]) is same


def test_epochs_are_permutations():
    cfg = config.load(None, ["data.source=synthetic", "data.synthetic_samples=64", "train.global_batch=16"])
    dp = DataPipeline(cfg.data, cfg.model, cfg.rng, 16)
    idx = np.concatenate([dp.step_ids(s)[1] for s in range(4)])
    assert sorted(idx) == list(range(64))
    assert not np.array_equal(idx, np.concatenate([dp.step_ids(s)[1] for s in range(4, 8)]))


def test_stdlib_corpus_has_fixed_split():
    cfg = config.load(None, ["data.max_bytes=300000"])
    dp = DataPipeline(cfg.data, cfg.model, cfg.rng, 8)
    src = dp.source
    assert src.n_train > 100 and src.n_val > 5
    w = src.windows(np.array([0, 1]))
    assert w.shape == (2, cfg.model.seq_len + 1) and w.max() < 256
    again = DataPipeline(cfg.data, cfg.model, cfg.rng, 8).source.windows(np.array([0, 1]))
    np.testing.assert_array_equal(w, again)


def test_dropout_masks_bitwise_independent_of_sharding():
    """The same sample ids give the same masks on 1, 4 and 8 devices, in any slot order."""
    ids = jnp.arange(1000, 1016, dtype=jnp.uint32)
    key = rng.step_key(rng.root_key(7), 3)
    x = jnp.ones((16, 8, 32), jnp.float32)

    def masks(ids):
        keys = rng.sample_keys(key, ids)
        return sample_dropout(x, 0.5, keys, 1, 0, False)

    ref = np.asarray(jax.jit(masks)(ids))
    devs = jax.devices()
    for n in (4, 8):
        mesh = make_mesh({"data": n}, devs[:n])
        sh = NamedSharding(mesh, P("data"))
        out = jax.jit(masks, in_shardings=sh, out_shardings=sh)(jax.device_put(ids, sh))
        np.testing.assert_array_equal(np.asarray(out), ref)
    perm = np.random.default_rng(0).permutation(16)
    shuffled = np.asarray(jax.jit(masks)(ids[perm]))
    np.testing.assert_array_equal(shuffled, ref[perm])
    assert 0.3 < (ref == 0).mean() < 0.7
