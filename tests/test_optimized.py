"""The consistency claims, checked with XLA optimisations on (the rest of the suite compiles
with `jax_disable_most_optimizations` to save compile time, see conftest.py).

Default mode (device and host failure, within 1e-5 of the fault-free run), deterministic mode
across meshes (bitwise), and a pipeline's async and blocking migrations in deterministic mode
(bitwise). The module compiles with its own executable cache and clears JAX's caches on entry
and exit, so nothing compiled unoptimised is used here or leaks out. XLA_FLAGS are process-wide:
here too XLA:CPU emits its older loop kernels instead of its fusion emitters (conftest.py);
`ELASJAX_TEST_XLA_OPT=1` runs every test with XLA exactly as users run it.
"""

import jax
import numpy as np
import pytest
from conftest import PIPE, assert_params_close, assert_same_computation, optimised_compiles, tiny_config

from elasjax.loop import trainer
from elasjax.observe.metrics import read_jsonl
from elasjax.layout.state import StateFactory, make_optimizer

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


def test_deterministic_mode_is_bitwise_across_meshes(exe_cache, tmp_path):
    """8 -> 7 -> 5 live devices (tensor degree kept): every logged loss, every held-out loss and
    the final parameters and optimizer state are bitwise equal to the fault-free run."""
    common = ["train.steps=9", "train.deterministic=true", "train.eval_every=3"]
    ref = trainer.run(tiny_config(*common, "faults=[]"), exe_cache=exe_cache)
    run = trainer.run(
        tiny_config(*common, "faults=[{at_step: 3, devices: [3]}, {at_step: 6, hosts: [0]}]"),
        tmp_path, exe_cache=exe_cache,
    )
    assert [r["n_devices"] for r in read_jsonl(tmp_path / "metrics.jsonl")][::3] == [8, 6, 4]
    assert run.losses == ref.losses and run.eval_losses == ref.eval_losses
    same = jax.tree.map(
        lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
        jax.device_get((run.state.params, run.state.opt_state)),
        jax.device_get((ref.state.params, ref.state.opt_state)),
    )
    assert all(jax.tree.leaves(same))


def test_deterministic_async_and_blocking_migrations_are_bitwise_equal(exe_cache):
    """Deterministic mode on a pipeline (data 2 x stage 4, one device fails): the blocking
    migration goes straight to the re-partitioned plan; the async one runs at most two steps on
    the fast path (one replica, no layer moved) first: it cuts over as soon as the optimal plan
    is compiled. Every loss, every held-out loss and the final
    state of both are bitwise equal to each other and to the fault-free run."""
    det = [*PIPE, "parallel.min_stage=2", "train.deterministic=true", "train.eval_every=3"]
    fault = "faults=[{at_step: 3, devices: [3]}]"
    ref = trainer.run(tiny_config(*det, "faults=[]"), exe_cache=exe_cache)
    blocking = trainer.run(tiny_config(*det, fault), exe_cache=exe_cache)
    asyn = trainer.run(
        tiny_config(*det, fault, "recovery.migration=async", "recovery.max_fast_path_steps=2"),
        exe_cache=exe_cache,
    )
    (b_ev,), (a_ev,), (mig,) = blocking.recoveries, asyn.recoveries, asyn.migrations
    assert b_ev.migration == "blocking" and b_ev.to_plan.split("t")[0] in ("d2s3", "d3s2")
    assert a_ev.migration == "async" and a_ev.to_plan.startswith("d1s4") and a_ev.bytes_moved == 0
    assert mig["to_plan"] == b_ev.to_plan and 3 < mig["step"] <= 5 and mig["bytes_moved"] > 0
    for run in (blocking, asyn):
        assert all(3 not in log.sources() for log in run.transfer_logs)
    assert sum(log.bytes_moved for log in asyn.transfer_logs) == mig["bytes_moved"]
    f = StateFactory(tiny_config(*det), make_optimizer(tiny_config(*det)))

    def canonical(run):  # the final plans differ (4 vs 3 stages): compare layer by layer
        return jax.device_get(jax.jit(f.layout(run.final_plan).to_canonical)(run.state))

    want = canonical(ref)
    for run in (blocking, asyn):
        assert run.losses == ref.losses and run.eval_losses == ref.eval_losses
        assert run.checksums == ref.checksums
        same = jax.tree.map(lambda a, b: np.array_equal(a, b), canonical(run), want)
        assert all(jax.tree.leaves(same))


def test_deterministic_zero1_on_pipelines_is_bitwise_through_failures(exe_cache):
    """Deterministic ZeRO-1 on a pipeline (data 2 x stage 4): a device failure, then a host
    failure (d2s4 -> d3s2 -> d2s2, the optimizer partitions re-partitioned each time), with a
    blocking and with an async migration: every loss, every held-out loss and the final
    checksums bitwise equal to the fault-free run's."""
    det = [*PIPE, "parallel.min_stage=2", "train.deterministic=true", "train.eval_every=3",
           "zero.stage=1"]
    fault = "faults=[{at_step: 3, devices: [3]}, {at_step: 6, hosts: [3]}]"
    ref = trainer.run(tiny_config(*det, "faults=[]"), exe_cache=exe_cache)
    for extra in ([], ["recovery.migration=async", "recovery.max_fast_path_steps=2"]):
        run = trainer.run(tiny_config(*det, fault, *extra), exe_cache=exe_cache)
        assert [r.to_plan.split("t")[0] for r in run.recoveries][-1] == "d2s2"
        assert all(".z1" in r.to_plan for r in run.recoveries)
        assert run.losses == ref.losses and run.eval_losses == ref.eval_losses
        assert run.checksums == ref.checksums
