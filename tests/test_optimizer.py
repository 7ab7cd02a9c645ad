"""A user's optimizer is first-class in the loop: named by the config (`train.optimizer`,
`--optimizer MODULE:ATTR`) or passed to `run`; the built-in optimizer's fields it would leave
unused are refused, and the run records which optimizer ran (config.yaml, the `start` event)."""

import json
from pathlib import Path
from types import SimpleNamespace

import optax
import pytest
import yaml

import elasjax
import user_optim
from conftest import TINY, assert_same_computation, tiny_config
from elasjax import cli, config
from elasjax.config import ConfigError
from elasjax.observe.metrics import read_jsonl
from elasjax.layout.state import BUILTIN_OPTIMIZER, choose_optimizer, load_optimizer

ROOT = Path(__file__).resolve().parents[1]
STEPS = user_optim.STEPS
LAMB = "train.optimizer=user_optim:lamb"


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["train.lr=1e-2"], ["'train.lr' = 0.01"]),
        (["train.warmup_steps=0", "train.weight_decay=0.1"],
         ["'train.warmup_steps' = 0", "'train.weight_decay' = 0.1"]),
        (["train.grad_clip=0.5"], ["'train.grad_clip' = 0.5", "optax.clip_by_global_norm"]),
    ],
)
def test_builtin_optimizer_fields_with_a_custom_optimizer_are_refused(overrides, named):
    with pytest.raises(ConfigError) as e:
        tiny_config(LAMB, *overrides)
    msg = str(e.value)
    assert all(n in msg for n in named), msg
    assert "built-in AdamW" in msg and "'user_optim:lamb' (train.optimizer)" in msg
    # the same rule for an optimizer passed to run() in Python, which the config cannot see
    with pytest.raises(ConfigError, match="passed to run") as e:
        choose_optimizer(tiny_config(*overrides), user_optim.lamb)
    assert all(n in str(e.value) for n in named)


def test_deterministic_mode_uses_grad_clip_with_any_optimizer():
    """There the step clips by train.grad_clip before the optimizer: the field is used."""
    det = ["train.deterministic=true", "parallel.replan=keep_tensor", "train.grad_clip=0.5"]
    cfg = tiny_config(LAMB, *det)
    assert choose_optimizer(cfg)[1:] == ("user_optim:lamb", "config")
    assert "grad_clip: 0.5" in config.dump(cfg)
    with pytest.raises(ConfigError, match="'train.lr'"):
        tiny_config(LAMB, *det, "train.lr=1e-2")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("lamb", r"'train.optimizer' = 'lamb'; allowed values: '' \(the built-in AdamW\) or "
                 "MODULE:ATTR"),
        ("user-optim:lamb", "allowed values"),
        ("user_optim:nope", "module 'user_optim' has no attribute 'nope'"),
        ("no_such_optim_module:x", r"train.optimizer.*no_such_optim_module.*looked in the "
                                   "current directory"),
        ("user_optim:not_an_optimizer", "is a int; allowed: an optax GradientTransformation or "
                                        "a zero-argument callable"),
        ("user_optim:needs_args", r"calling user_optim.needs_args\(\) failed.*optax.lamb\(1e-3\)"),
    ],
)
def test_a_bad_optimizer_name_is_an_error_naming_the_field(spec, match):
    with pytest.raises(ConfigError, match=match):
        cfg = tiny_config(f"train.optimizer={spec}")  # the form is checked at load
        load_optimizer(cfg.train.optimizer)  # the object when the run builds it


def test_an_optimizer_in_the_config_and_one_passed_to_run_are_refused_together():
    with pytest.raises(ConfigError, match="both name the optimizer"):
        choose_optimizer(tiny_config(LAMB), optax.sgd(0.1))


def test_which_optimizer_ran_is_recorded():
    assert choose_optimizer(tiny_config())[1:] == (BUILTIN_OPTIMIZER, "builtin")
    tx, label, source = choose_optimizer(tiny_config(), user_optim.lamb)
    assert source == "python" and label.startswith("python object") and "optax" in label
    # config.yaml: the label in place of the optimizer fields that did not apply; a file that
    # names a Python object refuses to load rather than train the built-in AdamW
    text = config.dump(tiny_config(), label)
    train = yaml.safe_load(text)["train"]
    assert train["optimizer"] == label
    assert not {"lr", "warmup_steps", "weight_decay", "grad_clip"} & set(train)
    with pytest.raises(ConfigError, match="train.optimizer.*allowed values"):
        config.from_dict(yaml.safe_load(text))
    # a config-named optimizer round-trips through its config.yaml
    cfg = tiny_config(LAMB)
    assert config.from_dict(yaml.safe_load(config.dump(cfg))) == cfg
    assert "lr" not in yaml.safe_load(config.dump(cfg))["train"]
    assert "lr" in yaml.safe_load(config.dump(tiny_config()))["train"]


@pytest.mark.slow
def test_a_users_lamb_named_on_the_command_line_recovers_with_its_fault_free_computation(
    tmp_path, exe_cache
):
    """`elasjax train --optimizer user_optim:lamb` with a device failure at step 4 computes
    what `run(cfg, optimizer=lamb)` computes fault-free (each loss within relative 1e-5),
    and records the optimizer; the built-in AdamW computes something else."""
    sets = [a for o in (*TINY, f"train.steps={STEPS}") for a in ("--set", o)]
    out = tmp_path / "cli"
    assert cli.main([
        "train", str(ROOT / "configs" / "multiprocess.yaml"), *sets,
        "--set", "faults=[{at_step: 4, devices: [3]}]", "--optimizer", "user_optim:lamb",
        "--out", str(out), "--quiet",
    ]) == 0
    clean = elasjax.run(tiny_config(f"train.steps={STEPS}", "faults=[]"), tmp_path / "py",
                        optimizer=user_optim.lamb, exe_cache=exe_cache)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    got = SimpleNamespace(losses={r["step"]: r["loss"] for r in rows}, eval_losses={},
                          sample_digests={r["step"]: r["batch_digest"] for r in rows})
    assert_same_computation(got, clean)
    events = read_jsonl(out / "events.jsonl")
    (rec,) = [e for e in events if e["type"] == "recovery"]
    assert rec["failed_devices"] == [3] and rec["verify"]["leaves"] > 0
    (start,) = [e for e in events if e["type"] == "start"]
    assert start["optimizer"] == "user_optim:lamb"
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["optimizer"] == (
        "user_optim:lamb")
    (py_start,) = [e for e in read_jsonl(tmp_path / "py" / "events.jsonl") if e["type"] == "start"]
    assert py_start["optimizer"].startswith("python object")
    adamw = elasjax.run(tiny_config("train.steps=3", "faults=[]"), exe_cache=exe_cache)
    assert all(abs(adamw.losses[s] - clean.losses[s]) > 1e-4 for s in (1, 2)), (
        json.dumps([adamw.losses, clean.losses]))


def test_an_optimizer_object_runs_in_the_default_mode_unless_the_config_asks(tmp_path):
    """`run(cfg, optimizer=tx)`: a deterministic mode that only the default chose is turned
    off (the step would clip before `tx`, whose own reductions are not known to be
    layout-independent), and the start event says so; asked for, it stays on."""
    for det, expect in (("null", False), ("true", True)):
        cfg = tiny_config(f"train.deterministic={det}", "train.steps=2", "faults=[]")
        out = tmp_path / det
        elasjax.run(cfg, out, optimizer=optax.sgd(0.1))
        start = next(e for e in read_jsonl(out / "events.jsonl") if e["type"] == "start")
        assert start["deterministic"] is expect
        assert ("a custom optimizer's own reductions" in start["mode"]) is (not expect)
        assert yaml.safe_load((out / "config.yaml").read_text())["train"]["deterministic"] is expect
