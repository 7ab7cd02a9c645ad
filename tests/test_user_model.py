"""The loop with a user's model: a `ModelSpec` registered by name trains through the same
planner, ZeRO storage, recovery and consistency contract as elasjax's GPT."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import elasjax
from elasjax import config

from user_models import CLASSES, DIM, SPEC, _data  # noqa: E402  (registers test-mlp)
from conftest import deaths  # noqa: E402

BASE = [
    "model.type=test-mlp", "train.steps=8", "train.global_batch=24", "train.microbatches=2",
    "train.lr=1e-2", "train.warmup_steps=1", "parallel.devices=8", "parallel.devices_per_host=2",
    "parallel.data=4", "parallel.tensor=2", "hardware.name=cpu-fake", "hardware.flops=2.0e9",
    "recovery.prepare_transfers=false",
    "train.deterministic=false",  # written for the default mode, as conftest.TINY
]
FAULTS = "faults=[{at_step: 3, devices: [3]}, {at_step: 5, hosts: [0]}]"
# with a user's optimizer the built-in AdamW's fields must keep their defaults (test_optimizer.py)
CUSTOM = [o for o in BASE if not o.startswith(("train.lr=", "train.warmup_steps="))]


def _run(*overrides, exe_cache=None):
    cfg = config.load(None, [*BASE, *overrides])
    return elasjax.run(cfg, exe_cache=exe_cache)


@pytest.mark.parametrize("zero", [0, 1])
def test_a_registered_model_recovers_with_the_fault_free_computation(zero, exe_cache):
    faulty = _run(FAULTS, f"zero.stage={zero}", exe_cache=exe_cache)
    clean = _run("faults=[]", f"zero.stage={zero}", exe_cache=exe_cache)
    assert [r.failed_devices for r in faulty.recoveries] == [[3], [0, 1]]
    assert all(r.verify["leaves"] > 0 and r.verify["digest_before"] == r.verify["digest_after"]
               for r in faulty.recoveries)
    for s in clean.losses:
        assert faulty.sample_digests[s] == clean.sample_digests[s]
        assert abs(faulty.losses[s] - clean.losses[s]) <= 1e-5 * clean.losses[s], s
    assert faulty.losses[7] < faulty.losses[0]  # it learns


def test_deterministic_mode_is_bitwise_for_a_registered_model():
    """Compiled as users compile (XLA's optimisations on): the suite's unoptimised compiles
    are not bitwise across meshes (test_optimized.py), and the fixed-tree reduction
    (`elasjax.core.treesum`) is bitwise in the optimised build that runs."""
    from conftest import optimised_compiles

    det = ["train.deterministic=true", "parallel.replan=keep_tensor"]
    with optimised_compiles(8) as cache:
        faulty = _run(FAULTS, *det, exe_cache=cache)
        clean = _run("faults=[]", *det, exe_cache=cache)
    assert faulty.losses == clean.losses
    assert faulty.checksums == clean.checksums


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.type=nope", "model.type.*allowed values: gpt"),
        ("model.d_model=128", "model.d_model.*GPT dimension"),
        ("data.source=synthetic", "data.source.*brings its own data"),
        ("parallel.stage=2", "parallel.stage.*no layer stack"),
        ("parallel.tensor=4", "parallel.tensor.*allowed values: -1, 1, 2"),
    ],
)
def test_bad_input_for_a_registered_model_names_the_field(override, match):
    with pytest.raises(config.ConfigError, match=match):
        config.load(None, [*BASE, override])


def test_register_refuses_a_taken_name_and_gpt():
    with pytest.raises(ValueError, match="registered already"):
        elasjax.register_model(elasjax.ModelSpec(**{**SPEC.__dict__}))
    with pytest.raises(ValueError, match="'gpt'"):
        elasjax.register_model(elasjax.ModelSpec(**{**SPEC.__dict__, "name": "gpt"}))


def test_zero_refuses_an_optimizer_whose_meaning_storage_would_change():
    cfg = config.load(None, [*CUSTOM, "zero.stage=1"])
    with pytest.raises(elasjax.OptimizerMeaningError, match=r"not elementwise.*zero_shardings\(1, \.\.\.\)"):
        elasjax.run(cfg, optimizer=optax.adafactor(1e-2, min_dim_size_to_factor=8))


def test_an_elementwise_user_optimizer_passes_the_check_and_trains(exe_cache):
    out = _run("zero.stage=1", "faults=[{at_step: 2, devices: [5]}]", "train.steps=4")
    s = elasjax.run(
        config.load(None, [*CUSTOM, "zero.stage=1", "faults=[{at_step: 2, devices: [5]}]",
                           "train.steps=4"]),
        optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.9)),
    )
    assert s.recoveries[0].verify["leaves"] > 0
    assert s.losses != out.losses  # its own optimizer, not AdamW


def test_a_masked_per_leaf_optimizer_is_refused_under_zero():
    """Weight decay on matrices only (a mask by rank): storage units are flat, so the mask
    would silently change. The numeric probe catches it."""
    tx = optax.chain(
        optax.adam(1e-2),
        optax.masked(optax.add_decayed_weights(0.5), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    )
    with pytest.raises(elasjax.OptimizerMeaningError, match="updates differ"):
        elasjax.run(config.load(None, [*CUSTOM, "zero.stage=1"]), optimizer=tx)


def test_adafactor_trains_a_registered_model_without_zero(exe_cache):
    s = elasjax.run(
        config.load(None, [*CUSTOM, "faults=[{at_step: 2, devices: [5]}]", "train.steps=4"]),
        optimizer=optax.adafactor(1e-2, min_dim_size_to_factor=8), exe_cache=exe_cache,
    )
    assert s.recoveries[0].verify["leaves"] > 0 and s.losses[3] < s.losses[0]


# A user model with a layer stack: residual blocks stacked on a leading layer axis, so it can be
# pipelined (parallel.stage > 1) like the GPT.
L, H = 4, 16


def _deep_init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"embed": {"w": 0.3 * jax.random.normal(k1, (DIM, H))},
            "layers": {"w": 0.3 * jax.random.normal(k2, (L, H, H)), "b": jnp.zeros((L, H))},
            "head": {"w": 0.3 * jax.random.normal(k3, (H, CLASSES))}}


def _embed(p, batch, keys, det):
    return jnp.tanh(batch["x"] @ p["embed"]["w"])


def _block(lp, x, keys, lid, det):
    return x + jnp.tanh(x @ lp["w"] + lp["b"])


def _head_loss(p, x, batch, weights):
    ce = optax.softmax_cross_entropy_with_integer_labels(x @ p["head"]["w"], batch["y"])
    return jnp.sum(ce * weights)


def _deep_loss(params, batch, keys, weights, det, layer_transform=None):
    x = _embed(params, batch, keys, det)

    def body(x, inp):
        lp, lid = inp
        lp = layer_transform(lp) if layer_transform is not None else lp
        return _block(lp, x, keys, lid, det), None

    x, _ = jax.lax.scan(body, x, (params["layers"], jnp.arange(L)))
    return _head_loss(params, x, batch, weights)


DEEP = elasjax.register_model(elasjax.ModelSpec(
    name="test-deep-mlp",
    init_params=_deep_init,
    logical_specs=lambda: {"embed": {"w": P(None, None)},
                           "layers": {"w": P("layers", None, None), "b": P("layers", None)},
                           "head": {"w": P(None, None)}},
    loss=_deep_loss,
    example_shapes=SPEC.example_shapes,
    data=_data,
    layers=elasjax.LayerStack(_embed, _block, _head_loss, activation_shape=(H,)),
    n_layers=L,
), replace=True)


def test_a_registered_model_with_a_layer_stack_is_pipelined_through_a_failure(exe_cache):
    pipe = ["model.type=test-deep-mlp", "parallel.data=4", "parallel.tensor=1",
            "parallel.stage=2", "parallel.max_stage=2", "train.microbatches=2", "train.steps=6"]
    faulty = _run(*pipe, "faults=[{at_step: 2, devices: [3]}]", exe_cache=exe_cache)
    clean = _run(*pipe, "faults=[]", exe_cache=exe_cache)
    assert faulty.plans[0].startswith("d4s2")  # data 4 x stage 2: pipelined
    v = faulty.recoveries[0].verify
    assert v["leaves"] > 0 and v["digest_before"] == v["digest_after"]
    for s in clean.losses:
        assert abs(faulty.losses[s] - clean.losses[s]) <= 1e-5 * clean.losses[s], s


def test_a_masked_sequence_model_states_its_own_normaliser():
    """Variable-length sequences: `count` gives each example its real tokens, so the loop's
    normaliser (sum of the real samples' counts) is per real token, padding slots count 0."""
    from elasjax.plan import planner
    from elasjax.loop.data import DataPipeline
    from elasjax.plan.planner import Topology

    T = 6
    lengths = np.array([1, 6, 3, 4, 2, 5, 6, 1], np.int32)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    tokens = np.arange(8 * T, dtype=np.int32).reshape(8, T) % 7
    elasjax.register_model(elasjax.ModelSpec(
        name="test-masked-seq",
        init_params=lambda key: {"w": jnp.zeros((7, 7))},
        logical_specs=lambda: {"w": P(None, None)},
        loss=lambda params, b, keys, w, det, layer_transform=None: jnp.sum(
            jnp.sum(b["mask"], -1) * w),
        example_shapes={"tokens": jax.ShapeDtypeStruct((T,), jnp.int32),
                        "mask": jax.ShapeDtypeStruct((T,), jnp.float32)},
        data=lambda _: elasjax.ArraySource(train={"tokens": tokens, "mask": mask},
                                           val={"tokens": tokens, "mask": mask}),
        count=lambda ex: ex["mask"].sum(-1),
    ), replace=True)
    cfg = config.load(None, [*BASE[:1], "model.type=test-masked-seq", "train.global_batch=5",
                             "parallel.devices=8", "parallel.data=4", "parallel.tensor=1"])
    dp = DataPipeline(cfg.data, cfg.model, cfg.rng, 5)
    plan = planner.plan_for_shape(list(range(4)), Topology(tuple(range(8)), 1), cfg, data=4,
                                  tensor=1, microbatches=1)
    hb = dp.batch(0, plan)
    _, idx = dp.step_ids(0)
    real = hb.weights > 0
    assert real.sum() == 5 and hb.counts[~real].sum() == 0  # 8 slots, 3 of them padding
    assert hb.counts[real].sum() == lengths[idx].sum()  # the normaliser: real tokens only
    np.testing.assert_array_equal(hb.fields["mask"][real].sum(-1), hb.counts[real])


@pytest.mark.slow
def test_a_registered_model_survives_a_real_process_kill_under_launch(tmp_path, exe_cache):
    """`elasjax launch --import user_models`: every process registers the model; a SIGKILL of
    process 1 is recovered and the losses match the single-process fault-free run."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # the default mode: its plans use every survivor (the deterministic mode's may use fewer)
    sets = [*BASE[:6], "train.steps=6", "train.deterministic=false", "parallel.devices=-1",
            "parallel.data=-1", "parallel.tensor=1", "hardware.name=cpu-fake",
            "hardware.flops=2.0e9", "faults=[]"]
    out = tmp_path / "mp"
    cfg_file = tmp_path / "user.yaml"
    cfg_file.write_text("model: {type: test-mlp}\n")
    cmd = [sys.executable, "-m", "elasjax.cli", "launch", str(cfg_file), "--processes", "3",
           "--devices-per-process", "2", "--kill", "3:1", "--import", "user_models",
           "--out", str(out), "--timeout", "400", "--quiet"]
    for o in sets:
        cmd += ["--set", o]
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               PYTHONPATH=os.pathsep.join([str(root / "tests"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=450, env=env, cwd=root)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    (ev,) = deaths(events)
    assert ev["failed_processes"] == [1] and ev["runtime"] == "multi-controller"
    v = ev["verify"]
    assert v["leaves"] > 0 and v["digest_before"] == v["digest_after"]
    assert [m["n_devices"] for m in metrics] == [6] * 3 + [4] * 3
    ref = elasjax.run(config.load(None, [*sets[:-4], "parallel.devices=6", "parallel.data=-1",
                                         "parallel.tensor=1", "parallel.devices_per_host=2",
                                         "hardware.name=cpu-fake", "hardware.flops=2.0e9",
                                         "faults=[]"]), exe_cache=exe_cache)
    for m in metrics:
        s = m["step"]
        assert abs(m["loss"] - ref.losses[s]) <= 1e-5 * ref.losses[s], s
