"""Config loading: strict keys, typed values, dotted overrides, clear errors."""

import pytest

from elasjax import config
from elasjax.config import ConfigError


def test_demo_config_loads():
    cfg = config.load("configs/demo.yaml")
    assert cfg.parallel.data == 4 and cfg.parallel.tensor == 2
    assert [f.at_step for f in cfg.faults] == [10, 20]
    assert cfg.faults[1].hosts == (0,)


def test_demo_grow_config_loads_and_resolves():
    import yaml

    from elasjax.runtime import faults
    from elasjax.plan import planner

    cfg = config.load("configs/demo_grow.yaml")
    assert [f.join is not None for f in cfg.faults] == [False, False, True, True]
    assert cfg.faults[2].join.devices == (3,) and cfg.faults[3].join.hosts == (1,)
    assert cfg.recovery.grow_min_gain == 0.05
    topo = planner.Topology(tuple(range(8)), 2)
    events = faults.resolve_schedule(cfg.faults, topo, cfg.train.steps)
    assert [e.device_ids for e in events] == [(3,), (2,), (3,), (2,)]  # 8 -> 7 -> 6 -> 8
    text = config.dump(cfg)
    assert "join:" in text and config.from_dict(yaml.safe_load(text)) == cfg


def test_override_parses_yaml_values():
    cfg = config.load("configs/demo.yaml", ["train.steps=12", "faults=[]", "model.dropout=0.0"])
    assert cfg.train.steps == 12 and cfg.faults == () and cfg.model.dropout == 0.0
    cfg = config.load(None, ["faults=[{at_step: 3, devices: [1, 2]}]", "train.steps=5"])
    assert cfg.faults[0].devices == (1, 2)


def test_round_trip_through_yaml(tmp_path):
    cfg = config.load("configs/demo.yaml")
    p = tmp_path / "c.yaml"
    p.write_text(config.dump(cfg))
    assert config.load(p) == cfg
    assert hash(cfg) == hash(config.load(p))


def test_unknown_key_names_key_and_allowed():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz'.*allowed keys in 'train': steps"):
        config.load(None, ["train.stepz=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'"):
        config.load(None, ["modle.d_model=3"])


def test_bad_literal_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"'rng.mode' = 'foo' is not allowed; allowed values: 'per_sample', 'per_device'"):
        config.load(None, ["rng.mode=foo"])


def test_bad_types():
    with pytest.raises(ConfigError, match=r"'train.steps' must be an integer"):
        config.load(None, ["train.steps=1.5"])
    with pytest.raises(ConfigError, match=r"'model.tie_embeddings' must be true or false"):
        config.load(None, ["model.tie_embeddings=3"])


def test_the_standby_is_auto_by_default_on_where_a_worker_process_builds():
    from elasjax.config import standby_on

    cfg = config.load(None)
    # on exactly where a compile worker process can build the plans (None: no reason it cannot)
    assert cfg.standby.enabled == "auto" and standby_on(cfg, None)
    assert not standby_on(cfg, "under launch") and not standby_on(
        config.load(None, ["standby.compiler=thread"]), None)
    on = config.load(None, ["standby.enabled=true"])
    assert standby_on(on, "under launch")
    assert not standby_on(config.load(None, ["standby.enabled=false"]), None)
    assert "enabled: auto" in config.dump(cfg)  # a run's config.yaml decides the same way again
    with pytest.raises(ConfigError, match=r"'standby.enabled' = 'maybe' is not allowed; allowed "
                                          r"values: true, false, 'auto'"):
        config.load(None, ["standby.enabled=maybe"])


def test_standby_depth_auto_covers_a_second_failure_where_a_job_shares_its_compiles():
    cfg = config.load(None, [])
    assert config.standby_depth(cfg, True) == 2 and config.standby_depth(cfg, False) == 1
    assert config.standby_depth(config.load(None, ["standby.share_compiles=false"]), True) == 1
    assert config.standby_depth(config.load(None, ["standby.depth=1"]), True) == 1
    assert config.standby_depth(config.load(None, ["standby.depth=2"]), False) == 2


def test_standby_depth_and_map_budget_name_their_allowed_values():
    with pytest.raises(ConfigError, match=r"'standby.depth' = 3; allowed values: 1 .*, 2 "):
        config.load(None, ["standby.depth=3"])
    with pytest.raises(ConfigError, match=r"'standby.map_budget' = 1.5; allowed values: 0 < map_budget <= 0.9"):
        config.load(None, ["standby.map_budget=1.5"])


def test_tensor_degree_must_divide_heads():
    with pytest.raises(ConfigError, match=r"'parallel.tensor' = 3 does not divide the model.*allowed values: -1, 1, 2, 4"):
        config.load(None, ["parallel.tensor=3"])


def test_fault_beyond_run():
    with pytest.raises(ConfigError, match=r"'faults\[0\].at_step' = 50 is outside the run; allowed values: 0 .. 39"):
        config.load("configs/demo.yaml", ["faults=[{at_step: 50, devices: [1]}]"])


def test_fault_at_the_cut_over_is_one_process_only():
    from elasjax.runtime import faults
    from elasjax.plan import planner

    cfg = config.load(None, ["faults=[{at_step: 3, hosts: [1], phase: cutover}]"])
    topo = planner.Topology(tuple(range(8)), 2)
    (e,) = faults.resolve_schedule(cfg.faults, topo, cfg.train.steps)
    assert e.phase == "cutover" and e.spec == "hosts [1] (at the cut-over)"
    with pytest.raises(ConfigError, match=r"'faults\[0\].phase' = 'cutover' is not available "
                                          r"under `elasjax launch`.*allowed values: 'step'"):
        faults.resolve_schedule(cfg.faults, topo, cfg.train.steps, faults.MULTI_CONTROLLER)
    with pytest.raises(ConfigError, match=r"allowed values: 'step', 'recovery', 'recovery/plan', "
                                          r"'recovery/transfer', 'recovery/verify', "
                                          r"'recovery/first_step', 'cutover'"):
        config.load(None, ["faults=[{at_step: 3, devices: [1], phase: later}]"])


def test_fault_needs_exactly_one_kind():
    with pytest.raises(ConfigError, match=r"exactly one of 'devices', 'hosts', 'count' \(\+ 'seed'\) or 'kill_process'"):
        config.load(None, ["faults=[{at_step: 3, devices: [1], hosts: [0]}]"])
    with pytest.raises(ConfigError, match=r"'faults\[0\].at_step' is required"):
        config.load(None, ["faults=[{devices: [1]}]"])


def test_features_not_yet_available_are_refused():
    with pytest.raises(ConfigError, match=r"'zero.stage' = 4 is not allowed; allowed values: 0, 1, 2, 3"):
        config.load(None, ["zero.stage=4"])
    with pytest.raises(ConfigError, match=r"'parallel.stage' = 3; allowed values: 1 .. 2"):
        config.load(None, ["parallel.stage=3"])
    with pytest.raises(ConfigError, match=r"'zero.stage' = 3 with pipelines .* allowed values with pipelines: 0, 1"):
        config.load(None, ["parallel.stage=2", "zero.stage=3"])
    with pytest.raises(ConfigError, match=r"'zero.layout' = 'contiguous' with pipelines"):
        config.load(None, ["parallel.stage=2", "zero.stage=1", "zero.layout=contiguous"])
    config.load(None, ["parallel.stage=2", "zero.stage=1"])
    for stage in (2, 3):  # the gradient summed whole in the tree, partitioned after it
        config.load(None, ["train.deterministic=true", f"zero.stage={stage}"])
    # ZeRO-1 on pipelines too (bitwise: test_optimized.py)
    config.load(None, ["train.deterministic=true", "zero.stage=1", "parallel.stage=2",
                       "parallel.min_stage=2"])
    config.load(None, ["train.deterministic=true", "zero.stage=1"])
    # a deterministic run may not mix pipelined and unpipelined plans
    with pytest.raises(ConfigError, match=r"'parallel.min_stage' = 1 with train.deterministic"):
        config.load(None, ["train.deterministic=true", "parallel.stage=2"])
    with pytest.raises(ConfigError, match=r"allowed values: parallel.stage >= 2 and parallel.min_stage >= 2"):
        config.load(None, ["train.deterministic=true", "parallel.max_stage=2"])
    config.load(None, ["train.deterministic=true", "parallel.stage=2", "parallel.min_stage=2"])


def test_the_deterministic_mode_is_the_default_where_a_config_allows_it():
    """`train.deterministic` left out ("auto"; null the same): on, unless the config has an
    obstacle (`config.deterministic_obstacle`), which the run's mode line names. An explicit
    value is kept. config.yaml records what was asked ("auto"), so a rerun from it decides the
    same way (test_trainer.py reruns one where the default gave way)."""
    import yaml

    cfg = config.load(None)
    assert cfg.deterministic is True and config.deterministic_by_default(cfg)
    assert cfg.train.deterministic == "auto"
    assert config.load(None, ["train.deterministic=null"]).train.deterministic == "auto"
    assert "(the default; train.deterministic=false turns it off)" in config.mode_line(cfg)
    assert yaml.safe_load(config.dump(cfg))["train"]["deterministic"] == "auto"
    explicit = config.load(None, ["train.deterministic=false"])
    assert explicit.deterministic is False and not config.deterministic_by_default(explicit)
    with pytest.raises(ConfigError, match=r"'train.deterministic' = 'maybe' is not allowed; "
                       r"allowed values: true, false, 'auto', null"):
        config.load(None, ["train.deterministic=maybe"])
    assert config.mode_line(explicit).endswith("(train.deterministic = false)")

    pipe = ["model.n_layers=4", "parallel.data=2", "parallel.stage=4", "parallel.tensor=1",
            "train.microbatches=4"]
    obstacles = {  # overrides -> the reason the mode line gives
        (*pipe,): "may re-plan to one stage",
        ("recovery.strategy=torchft_like",): "'torchft_like' is implemented for the default",
        ("train.optimizer=optax:sgd",): "a custom optimizer's own reductions",
    }
    for over, why in obstacles.items():
        c = config.load(None, list(over))
        assert c.deterministic is False, over
        assert why in config.mode_line(c), (over, config.mode_line(c))
    for zero in (0, 1):
        assert config.load(None, [*pipe, "parallel.min_stage=2",
                                  f"zero.stage={zero}"]).deterministic is True
    # asked for explicitly, the mode stays on with a named optimizer (the step clips first)
    assert config.load(None, ["train.optimizer=optax:sgd",
                              "train.deterministic=true"]).deterministic is True

    # an optimizer object given to the run turns off only a mode the default chose
    off = config.with_optimizer_object(cfg)
    assert off.deterministic is False
    assert "a custom optimizer's own reductions" in config.mode_line(off, optimizer_object=True)
    on = config.load(None, ["train.deterministic=true"])
    assert config.with_optimizer_object(on) is on

    # the shipped configs: the ZeRO demo trains deterministically by default (its plans are the
    # default mode's); the others state the default mode (their re-plans change the tensor
    # degree); the pipeline demo's pipelines may re-plan to one stage
    assert config.load("configs/demo_zero.yaml").deterministic is True
    for name in ("demo", "demo_grow", "demo_mtbf", "multiprocess", "demo_pipeline"):
        assert config.load(f"configs/{name}.yaml").deterministic is False, name
