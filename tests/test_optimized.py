"""The consistency claims, checked with XLA optimisations on (the rest of the suite compiles
with `jax_disable_most_optimizations` to save compile time, see conftest.py).

Default mode (device and host failure, within 1e-5 of the fault-free run), and deterministic
ZeRO-1 on a pipeline through an async migration (bitwise). The deterministic mode across data
meshes and ZeRO stages: test_deterministic_zero.py; the demos at their own sizes through every
data degree, with XLA exactly as users compile: test_bitwise_sweep.py. The module compiles
with its own executable cache and clears JAX's caches on entry and exit, so nothing compiled unoptimised is used here or leaks out. XLA_FLAGS are process-wide:
here too XLA:CPU emits its older loop kernels instead of its fusion emitters (conftest.py);
`ELASJAX_TEST_XLA_OPT=1` runs every test with XLA exactly as users run it.
"""

import jax
import pytest
from conftest import PIPE, assert_params_close, assert_same_computation, optimised_compiles, tiny_config

from elasjax.loop import trainer
from elasjax.observe.metrics import read_jsonl

pytestmark = pytest.mark.slow

DEFAULT = ["train.steps=12", "train.eval_every=8"]  # held-out loss at steps 7 and 11


@pytest.fixture(scope="module")
def exe_cache():
    """Optimised compiles for this module only (shadows conftest's shared cache)."""
    with optimised_compiles(32) as cache:
        yield cache


def test_xla_optimisations_are_on(exe_cache):
    assert not jax.config.values["jax_disable_most_optimizations"]


@pytest.fixture(scope="module")
def reference(exe_cache, tmp_path_factory):
    return trainer.run(tiny_config(*DEFAULT, "faults=[]"), tmp_path_factory.mktemp("ref"),
                       exe_cache=exe_cache)


RECOVERY_FIELDS = {
    "type", "step", "failed_devices", "from_plan", "to_plan", "rung", "bytes_moved", "transfers",
    "detect_s", "plan_s", "compile_s", "standby_hit", "transfer_s", "verify_s", "first_step_s",
    "mttr_s", "verify", "verified",
}


def test_device_and_host_failure_match_fault_free(exe_cache, reference, tmp_path):
    """Default mode: a device, then a host, fails; the run continues on 7 then 5 devices from
    replicas and matches the fault-free run within the contract's tolerance."""
    out = tmp_path / "faulted"
    s = trainer.run(
        tiny_config(*DEFAULT, "faults=[{at_step: 4, devices: [3]}, {at_step: 8, hosts: [0]}]"),
        out, exe_cache=exe_cache,
    )
    assert [r.to_plan.split("m")[0] for r in s.recoveries] == ["d7t1", "d5t1"]
    assert all(r.verify["leaves"] > 0 and r.rung == "replica" and r.steps_lost == 0
               for r in s.recoveries)
    assert_same_computation(s, reference)
    assert sorted(s.eval_losses) == [7, 11] and 1.0 < s.eval_losses[7] < 10.0  # cross-entropy
    assert_params_close(s, reference)
    events = [e for e in read_jsonl(out / "events.jsonl") if e["type"] == "recovery"]
    assert len(events) == 2 and RECOVERY_FIELDS <= set(events[0])
    assert events[0]["failed_devices"] == [3] and events[1]["failed_devices"] == [0, 1]
    m = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in m] == list(range(12))
    assert {"step", "loss", "global_batch", "tokens", "n_devices", "plan", "step_time_s"} <= set(m[0])
    assert [r["n_devices"] for r in m] == [8] * 4 + [7] * 4 + [5] * 4
    assert (out / "config.yaml").exists()


def test_deterministic_zero1_on_pipelines_is_bitwise_through_failures(exe_cache):
    """Deterministic ZeRO-1 on a pipeline (data 2 x stage 4): a device failure, then a host
    failure, with an async migration (d2s4 -> the fast path d1s4 -> cut over to the
    re-partitioned plan -> d2s2, the optimizer partitions re-partitioned at each move): every
    loss, every held-out loss and the final checksums bitwise equal to the fault-free run's. (A
    blocking migration goes straight to the re-partitioned plan, a move this run makes at its
    cut-over; the pipeline demo's chain makes both kinds at the demo's size:
    tests/test_bitwise_sweep.py.)"""
    det = [*PIPE, "parallel.min_stage=2", "train.deterministic=true", "train.eval_every=3",
           "zero.stage=1"]
    fault = "faults=[{at_step: 3, devices: [3]}, {at_step: 6, hosts: [3]}]"
    ref = trainer.run(tiny_config(*det, "faults=[]"), exe_cache=exe_cache)
    run = trainer.run(tiny_config(*det, fault, "recovery.migration=async",
                                  "recovery.max_fast_path_steps=2"), exe_cache=exe_cache)
    assert run.recoveries[0].to_plan.startswith("d1s4") and len(run.migrations) >= 1
    assert [r.to_plan.split("t")[0] for r in run.recoveries][-1] == "d2s2"
    assert all(".z1" in r.to_plan for r in run.recoveries)
    assert run.losses == ref.losses and run.eval_losses == ref.eval_losses
    assert run.checksums == ref.checksums
