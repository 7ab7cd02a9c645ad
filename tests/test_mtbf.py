"""The seeded failure-and-repair process (`faults: [{at_step, mtbf: {...}}]`).

It is resolved up front into ordinary failures and joins, so these tests check the resolution
(deterministic per seed, never below `min_live` units, returns `repair_steps` later, merged with
scripted entries, bad fields refused naming the field) and one short run: a generated failure and
return, losses within relative 1e-5 of the fault-free run (`conftest.assert_same_computation`).
"""

import pytest
from conftest import assert_same_computation, tiny_config

from elasjax import config
from elasjax.runtime import faults
from elasjax.plan import planner
from elasjax.loop import trainer
from elasjax.config import ConfigError
from elasjax.observe.metrics import read_jsonl

TOPO = planner.Topology(tuple(range(8)), 2)  # 4 hosts of 2 devices


def _mtbf(steps: int = 200, at: int = 0, scripted: str = "", **m) -> list[faults.FaultEvent]:
    fields = ", ".join(f"{k}: {'null' if v is None else v}" for k, v in m.items())
    entry = f"{{at_step: {at}, mtbf: {{{fields}}}}}"
    sched = f"[{entry}{', ' + scripted if scripted else ''}]"
    cfg = config.load(None, [f"train.steps={steps}", f"faults={sched}"])
    return faults.resolve_schedule(cfg.faults, TOPO, steps)


def _replay(events: list[faults.FaultEvent]) -> list[int]:
    """Live device count after each step's events; asserts every event is runnable (failures of
    live devices only, joins of down devices only, steps in order, joins before failures)."""
    live, counts, last = set(TOPO.device_ids), [], (-1, True)
    for e in events:
        assert (e.at_step, e.is_join) >= (last[0], False) and e.at_step >= last[0]
        if e.at_step == last[0]:
            assert not (e.is_join and not last[1]), "a join after a failure of its step"
        ids = set(e.device_ids)
        assert ids and (ids.isdisjoint(live) if e.is_join else ids <= live), e
        live = live | ids if e.is_join else live - ids
        assert live, "every device failed"
        counts.append(len(live))
        last = (e.at_step, e.is_join)
    return counts


def test_resolution_is_deterministic_per_seed_and_differs_across_seeds():
    a = _mtbf(mtbf_steps=40, repair_steps=15, seed=3)
    assert a == _mtbf(mtbf_steps=40, repair_steps=15, seed=3)
    assert len(a) >= 4 and a != _mtbf(mtbf_steps=40, repair_steps=15, seed=4)
    assert {e.kind for e in a} == {"devices", "join"}
    assert all("(mtbf faults[0]" in e.spec for e in a)
    h = _mtbf(mtbf_steps=40, repair_steps=15, seed=3, unit="host")
    assert {e.kind for e in h} == {"hosts", "join"}
    assert all(set(e.device_ids) == {d for x in e.hosts for d in TOPO.host_devices(x)} for e in h)
    # the failure rate is per unit: mean lifetime + repair time per cycle (ceil adds ~0.5 step)
    n = sum(len(e.device_ids) for s in range(20)
            for e in _mtbf(steps=1000, mtbf_steps=40, repair_steps=15, seed=s) if not e.is_join)
    assert n / 20 == pytest.approx(8 * 1000 / (40.5 + 15), rel=0.1)


def test_returns_come_repair_steps_later_and_stop_and_null_are_kept():
    ev = _mtbf(steps=120, at=10, mtbf_steps=20, repair_steps=7, seed=1, stop=80)
    _replay(ev)
    fails = [e for e in ev if not e.is_join]
    joins = {(e.at_step, d) for e in ev if e.is_join for d in e.device_ids}
    assert fails and all(10 < e.at_step <= 80 for e in fails)
    for e in fails:
        assert all((e.at_step + 7, d) in joins for d in e.device_ids), e
    assert len(joins) == sum(len(e.device_ids) for e in fails)
    # a failure later than steps - repair_steps returns after the run: no join for it
    late = _mtbf(steps=60, mtbf_steps=5, repair_steps=50, seed=0)
    assert max(e.at_step for e in late if e.is_join) < 60
    assert sum(len(e.device_ids) for e in late if not e.is_join) > sum(
        len(e.device_ids) for e in late if e.is_join)
    assert all(not e.is_join for e in _mtbf(mtbf_steps=20, repair_steps=None, seed=0))


def test_never_fails_below_min_live_and_notes_the_kept_units():
    for seed in range(10):
        counts = _replay(_mtbf(mtbf_steps=3, repair_steps=30, seed=seed))
        assert min(counts) == 1  # the process drives the job down to min_live, never below
        hosts = _mtbf(mtbf_steps=3, repair_steps=30, seed=seed, unit="host", min_live=2)
        assert min(_replay(hosts)) == 4  # two hosts of 2 stay up
    ev = _mtbf(mtbf_steps=3, repair_steps=30, seed=0)
    assert any("kept device" in e.spec and "mtbf.min_live = 1" in e.spec for e in ev)


def test_merges_with_scripted_entries_in_step_order():
    # device 0 is scripted down: the process never fails or returns it, a scripted join
    # returns it and the process's clock of it starts there
    base = _mtbf(steps=80, mtbf_steps=30, repair_steps=10, seed=2)
    ev = _mtbf(steps=80, mtbf_steps=30, repair_steps=10, seed=2,
               scripted="{at_step: 1, devices: [0]}, {at_step: 40, join: {devices: [0]}}")
    _replay(ev)
    gen = [e for e in ev if "mtbf" in e.spec]
    assert not any(0 in e.device_ids for e in gen if e.at_step < 40)
    # the other devices' failures do not move (one stream per unit)
    others = [(e.at_step, e.device_ids) for e in base if 0 not in e.device_ids and e.at_step < 40]
    assert others == [(e.at_step, e.device_ids) for e in gen if e.at_step < 40]
    # a scripted failure of a device the process has failed names the process
    (first,) = [e for e in base if not e.is_join][:1]
    d, s = first.device_ids[0], first.at_step
    with pytest.raises(ConfigError, match=rf"'faults\[1\].devices': device {d} has already failed "
                                          rf"\(the mtbf process of faults\[0\] failed it at step {s}\)"):
        _mtbf(steps=80, mtbf_steps=30, repair_steps=10, seed=2,
              scripted=f"{{at_step: {s + 1}, devices: [{d}]}}")


def test_bad_fields_are_refused_naming_the_field():
    bad = [
        ("mtbf_steps: -5, repair_steps: 3",
         r"'faults\[0\].mtbf.mtbf_steps' = -5.0; allowed values: a finite number > 0"),
        ("mtbf_steps: 5, repair_steps: 0",
         r"'faults\[0\].mtbf.repair_steps' = 0; allowed values: null .* or an integer >= 1"),
        ("mtbf_steps: 5, repair_steps: 3, unit: rack",
         r"'faults\[0\].mtbf.unit' = 'rack' is not allowed; allowed values: 'device', 'host'"),
        ("mtbf_steps: 5, repair_steps: 3, stop: 2",
         r"'faults\[0\].mtbf.stop' = 2; allowed values: null \(the run's end\) or 4 .. 19"),
        ("mtbf_steps: 5, repair_steps: 3, min_live: 0", r"'faults\[0\].mtbf.min_live' = 0"),
        ("mtbf_steps: 5", r"'faults\[0\].mtbf.repair_steps' is required"),
        ("mtbf_steps: 5, repair_steps: 3, mtbf: 2", r"unknown config key 'faults\[0\].mtbf.mtbf'"),
    ]
    for fields, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            config.load(None, ["train.steps=20", f"faults=[{{at_step: 4, mtbf: {{{fields}}}}}]"])
    m = "mtbf: {mtbf_steps: 5, repair_steps: 3}"
    with pytest.raises(ConfigError, match=r"'faults\[0\].seed' = 1 with 'mtbf'.*'faults\[0\]."
                                          r"mtbf.seed'"):
        config.load(None, [f"faults=[{{at_step: 1, seed: 1, {m}}}]"])
    with pytest.raises(ConfigError, match=r"'faults\[0\]' must name exactly one of .* or 'mtbf'"):
        config.load(None, [f"faults=[{{at_step: 1, devices: [2], {m}}}]"])
    with pytest.raises(ConfigError, match=r"'faults\[0\].mtbf.repair_steps' = 3 returns units as "
                                          r"joins, which need recovery.strategy = 'elastic'"):
        config.load(None, ["recovery.strategy=torchft_like", f"faults=[{{at_step: 1, {m}}}]"])
    assert config.load(None, ["recovery.strategy=torchft_like",  # no returns: fine
                              "faults=[{at_step: 1, mtbf: {mtbf_steps: 5, repair_steps: null}}]"])
    with pytest.raises(ConfigError, match=r"'faults\[0\].mtbf.min_live' = 4 leaves no host to "
                                          r"fail: the job has 4 hosts; allowed values: 1 .. 3"):
        _mtbf(mtbf_steps=5, repair_steps=3, unit="host", min_live=4)
    # under `elasjax launch` (its returns are joins), before any process starts
    cfg = tiny_config("faults=[{at_step: 1, mtbf: {mtbf_steps: 5, repair_steps: 3, unit: host}}]")
    with pytest.raises(ConfigError, match=r"'faults\[0\].mtbf' is not available under `elasjax "
                                          r"launch`.*run 'mtbf' with `elasjax train`"):
        faults.resolve_schedule(cfg.faults, TOPO, 40, faults.MULTI_CONTROLLER)
    from elasjax.launch import process

    with pytest.raises(ConfigError, match=r"'faults\[0\].mtbf' is not available under `elasjax "
                                          r"launch`"):
        process.resolve_config(cfg, 4, 2)


def test_demo_mtbf_config_resolves_to_the_events_its_header_states():
    import yaml

    cfg = config.load("configs/demo_mtbf.yaml")
    ev = faults.resolve_schedule(cfg.faults, TOPO, cfg.train.steps)
    assert [(e.at_step, e.kind, e.hosts) for e in ev] == [
        (18, "hosts", (3,)), (35, "hosts", (0,)), (38, "join", (3,)), (55, "join", (0,))]
    assert config.from_dict(yaml.safe_load(config.dump(cfg))) == cfg  # round trip


def test_a_generated_failure_and_return_train_like_the_fault_free_run(exe_cache, tmp_path):
    """Seed 1 fails host 3 at step 2 and returns it at step 5 (8 -> 6 -> 8 devices); the run
    grows back (cut-over within `max_fast_path_steps=1`); every loss within 1e-5 of the
    fault-free run's; the start event lists what the process generated, with its steps."""
    # (one growth: no interim cut-over to the start plan first, `recovery.grow_interim`)
    common = ["train.steps=9", "recovery.max_fast_path_steps=1", "recovery.grow_interim=false"]
    sched = ("faults=[{at_step: 1, mtbf: {mtbf_steps: 16, repair_steps: 3, unit: host, seed: 1, "
             "stop: 4}}]")
    cfg = tiny_config(*common, sched)
    ev = faults.resolve_schedule(cfg.faults, TOPO, 9)
    assert [(e.at_step, e.kind, e.device_ids) for e in ev] == [
        (2, "hosts", (6, 7)), (5, "join", (6, 7))]
    ref = trainer.run(tiny_config(*common, "faults=[]"), exe_cache=exe_cache)
    run = trainer.run(cfg, tmp_path / "run", exe_cache=exe_cache)
    assert_same_computation(run, ref)
    (start,) = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["type"] == "start"]
    assert start["faults"] == ["step 2: hosts [3] (mtbf faults[0])",
                               "step 5: join hosts [3] (mtbf faults[0], repaired after 3 steps)"]
    assert [(r.step, r.failed_devices, r.fault) for r in run.recoveries] == [
        (2, [6, 7], "hosts [3] (mtbf faults[0])")]
    (join,) = run.joins
    assert join["devices"] == [6, 7] and "repaired after 3 steps" in join["spec"]
    (grow,) = run.growths
    assert grow["n_devices"] == 8 and grow["step"] <= 6 and grow["verify"]["leaves"] > 0
