"""End to end: faulted runs continue on re-planned meshes and compute the fault-free run.

Tolerances: `conftest.LOSS_RTOL` and `assert_params_close`. The GPT has no key bias: its true
gradient is zero and Adam would amplify its round-off noise into lr-sized differences. The
device-and-host consistency test runs with XLA optimisations on: test_optimized.py.
"""

import gc
import shutil

import pytest
from conftest import LOSS_RTOL, assert_params_close, assert_same_computation, tiny_config

import elasjax
from elasjax import config
from elasjax.loop import trainer
from elasjax.config import ConfigError
from elasjax.runtime.faults import FaultEvent
from elasjax.observe.metrics import MTTR_PHASES, read_jsonl
from elasjax.runtime.inprocess import InProcessRuntime
from elasjax.transfer.shards import UnrecoverableStateError

pytestmark = pytest.mark.slow


def _run(exe_cache, out, *overrides):
    return trainer.run(tiny_config("train.steps=12", *overrides), out, exe_cache=exe_cache)


def test_per_device_rng_ablation_diverges(exe_cache):
    """With keys by mesh slot, dropout changes after a re-plan: the consistency check fails."""
    faults = "faults=[{at_step: 4, devices: [3]}]"
    ref = _run(exe_cache, None, "rng.mode=per_device", "faults=[]")
    abl = _run(exe_cache, None, "rng.mode=per_device", faults)
    for s in range(4):  # same layout before the failure: identical
        assert abs(abl.losses[s] - ref.losses[s]) <= LOSS_RTOL * ref.losses[s]
    rel = max(abs(abl.losses[s] - ref.losses[s]) / ref.losses[s] for s in range(4, 12))
    assert rel > 10 * LOSS_RTOL
    with pytest.raises(AssertionError):
        assert_same_computation(abl, ref)


KILL_TENSOR_SLICE = "faults=[{at_step: 6, devices: [0, 2, 4, 6]}]"  # every holder of tensor slice 0


def test_no_live_copy_raises(exe_cache, tmp_path):
    with pytest.raises(UnrecoverableStateError, match=r"state leaf '.+' slice \[.+\] has no live copy"):
        _run(exe_cache, tmp_path, KILL_TENSOR_SLICE)
    last = read_jsonl(tmp_path / "events.jsonl")[-1]
    assert last["type"] == "error" and last["error"] == "UnrecoverableStateError"


def test_checkpoint_rung_equals_restart_from_checkpoint(exe_cache, tmp_path):
    ck = lambda d: [f"checkpoint.dir={d}", "checkpoint.every=4", "checkpoint.keep=10"]
    faulted = _run(exe_cache, tmp_path / "a", *ck(tmp_path / "ck_a"), KILL_TENSOR_SLICE)
    (ev,) = faulted.recoveries
    assert (ev.rung, ev.resumed_at_step, ev.steps_lost) == ("checkpoint", 4, 2)
    assert ev.verify["leaves"] > 0 and ev.verify["digest_before"] == ev.verify["digest_after"]
    redo = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if r.get("redo")]
    assert [r["step"] for r in redo] == [4, 5]
    # A fault-free run's step-4 checkpoint, restarted in a new run:
    _run(exe_cache, None, *ck(tmp_path / "ck_r"), "faults=[]")
    shutil.copytree(tmp_path / "ck_r", tmp_path / "ck_b")
    restarted = _run(exe_cache, None, *ck(tmp_path / "ck_b"), "checkpoint.resume_step=4", "faults=[]")
    assert min(restarted.losses) == 4
    assert_same_computation(faulted, restarted, steps=range(4, 12))
    assert_params_close(faulted, restarted)


@pytest.mark.parametrize(
    "fault,msg",
    [
        ("faults=[{at_step: 2, count: 8}]", "fails every device"),
        ("faults=[{at_step: 2, devices: [0,1,2,3]}, {at_step: 3, hosts: [2, 3]}]", "fails every device"),
        ("faults=[{at_step: 2, devices: [9]}]", r"device 9, which does not exist; allowed values: \[0, 1"),
        ("faults=[{at_step: 2, hosts: [4]}]", r"host 4, which does not exist; allowed values: 0 .. 3"),
        ("faults=[{at_step: 2, devices: [1]}, {at_step: 3, devices: [1]}]", "device 1 has already failed"),
    ],
)
def test_bad_fault_schedules_fail_before_training(fault, msg):
    with pytest.raises(ConfigError, match=msg):
        trainer.Trainer(tiny_config("train.steps=12", fault))


def test_more_devices_than_visible():
    with pytest.raises(ConfigError, match=r"'parallel.devices' = 16 but only 8 devices are visible"):
        trainer.Trainer(tiny_config("parallel.devices=16"))


class _FailsInTheFirstStepAfter(InProcessRuntime):
    """Loses device 5 in the first step after the first scheduled failure's recovery."""

    armed = fired = False

    def inject(self, events, point, trees=()):
        if point == "before_step" and self.armed and not self.fired:
            self.fired = True
            events = [FaultEvent(events[0].at_step if events else -1, (5,), "devices", "devices [5]")]
        elif point == "before_step" and events:
            self.armed = True
        return super().inject(events, point, trees)


def test_no_garbage_collection_runs_from_a_failure_to_its_first_good_step(exe_cache, monkeypatch):
    """Python's cyclic collector is held from the failure to the recovery's first good step
    (a collection there would stop the loop for as long as the recovery), and back on after it:
    garbage made during the recovery (here 20,000 cycles, enough for automatic collections) is
    collected only after the first good step."""
    phase = ["before"]  # -> "recovery" at the failure, -> "after" once its first step is logged
    collections = {"before": 0, "recovery": 0, "after": 0}
    enabled_in_recovery = []

    def callback(when, info):
        if when == "start":
            collections[phase[0]] += 1

    from elasjax.loop.recovery import Recoverer

    orig_recover = Recoverer.recover

    def recover(self, pos, pool, failure, during):
        phase[0] = "recovery"
        enabled_in_recovery.append(gc.isenabled())
        for _ in range(20_000):  # garbage that would trigger the collector
            a = []
            a.append(a)
        return orig_recover(self, pos, pool, failure, during)

    def hook(x):  # the loop emits the recovery event once its first step is good
        if isinstance(x, elasjax.Event) and x.type == "recovery":
            phase[0] = "after"

    monkeypatch.setattr(Recoverer, "recover", recover)
    gc.callbacks.append(callback)
    try:
        out = trainer.run(tiny_config("train.steps=8", "faults=[{at_step: 4, devices: [3]}]"),
                          None, exe_cache=exe_cache, hooks=[hook])
    finally:
        gc.callbacks.remove(callback)
    assert len(out.recoveries) == 1 and enabled_in_recovery == [False] and gc.isenabled()
    assert collections["recovery"] == 0 and collections["after"] > 0, collections


def test_a_failure_in_the_first_step_after_a_recovery_continues_that_recovery(exe_cache, tmp_path):
    """A recovery ends at its first good step: a failure before it (here: device 5 lost in the
    first step after device 3's recovery) is reported in the same event, with both failures and
    an MTTR from the first failure to the first good step, not as a second recovery that hides
    the first."""
    cfg = tiny_config("train.steps=8", "faults=[{at_step: 4, devices: [3]}]")
    rt = _FailsInTheFirstStepAfter(cfg)
    out = trainer.run(cfg, tmp_path, exe_cache=exe_cache, runtime=rt)
    assert rt.fired
    (ev,) = out.recoveries
    assert ev.failed_devices == [3, 5] and ev.step == 4 and ev.attempts == 2
    assert "devices [3]" in ev.fault and "then, in its first step: devices [5]" in ev.fault
    assert ev.from_plan == out.plans[0] and ev.to_plan == out.final_plan.name
    (rec,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "recovery"]
    assert rec["failed_devices"] == [3, 5] and rec["retry_s"] > 0
    assert abs(rec["mttr_s"] - sum(rec[k] for k in MTTR_PHASES)) < 1e-9
    ref = trainer.run(tiny_config("train.steps=8", "faults=[]"), None, exe_cache=exe_cache)
    assert_same_computation(out, ref)


def test_a_default_deterministic_run_goes_on_when_its_tensor_degree_no_longer_fits(
    exe_cache, tmp_path
):
    """Deterministic by default (`train.deterministic` left out) on tensor 2 x data 1: when one
    device is left, no plan keeps the tensor degree; the run re-plans to tensor 1 and warns
    that bitwise equality with the fault-free run ends there, rather than stopping. Its
    config.yaml says "auto", so a rerun from it does the same (had it said `true`, the rerun
    would end in a NoPlanError at the failure)."""
    cfg = tiny_config("train.deterministic=null", "train.steps=4", "parallel.devices=2",
                      "parallel.data=1", "parallel.tensor=2", "faults=[{at_step: 2, devices: [1]}]")
    assert cfg.deterministic
    r = trainer.run(cfg, tmp_path / "run", exe_cache=exe_cache)
    again = config.load(tmp_path / "run" / "config.yaml")
    assert again == cfg and again.train.deterministic == "auto"
    rerun = trainer.run(again, tmp_path / "rerun", exe_cache=exe_cache)
    assert rerun.final_plan == r.final_plan and rerun.losses == r.losses
    assert r.recoveries[0].from_plan.startswith("d1t2") and r.final_plan.tensor == 1
    warns = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl")
             if e["type"] == "warning" and e["field"] == "train.deterministic"]
    assert len(warns) == 1 and "no longer bitwise equal" in warns[0]["message"], warns
    assert sorted(r.losses) == [0, 1, 2, 3]
