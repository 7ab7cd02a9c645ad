"""Pipeline failures end to end: asynchronous migration with ZeRO-1, and a background compile
that fails. (Deterministic mode, where async and blocking migrations end bitwise equal to the
fault-free run: test_optimized.py with ZeRO-1, test_bitwise_sweep.py's pipeline demo chain.)

Tolerance (non-deterministic mode): training losses relative 1e-5 per step against the
fault-free run, as in test_trainer.
"""

import pytest

from conftest import PIPE, tiny_config
from elasjax.plan import planner
from elasjax.loop import trainer
from elasjax.observe.metrics import read_jsonl

TOPO = planner.Topology(tuple(range(8)), 2)


@pytest.mark.slow
def test_zero1_pipeline_failure_async_migration_matches_fault_free(exe_cache):
    """Default (non-deterministic) mode, ZeRO-1 on the pipeline (optimizer state partitioned
    over `data` within each stage, buddy snapshots): one device of data 2 x stage 4 fails. The
    run resumes on the fast path (the intact pipeline; the lost partitions come from the buddy
    snapshots) and cuts over to the re-partitioned plan at step 4 or 5 (as soon as it is
    compiled, at most 2 fast-path steps), where a second device fails right after the new plan
    is installed (`phase: cutover`: the pool, re-configured by the cut-over, covers it). Its
    losses stay within 1e-5 of the fault-free ZeRO-0 run. (Blocking migration and bitwise
    equality: test_optimized.py.)"""
    fault = "faults=[{at_step: 3, devices: [3]}, {at_step: 4, devices: [0], phase: cutover}]"
    ref = trainer.run(tiny_config(*PIPE, "faults=[]"), exe_cache=exe_cache)
    asyn = trainer.run(
        tiny_config(*PIPE, "zero.stage=1", fault,  # snapshots: the default protects ZeRO
                    "recovery.migration=async", "recovery.max_fast_path_steps=2"),
        exe_cache=exe_cache,
    )
    assert ref.plans == [planner.initial_plan(TOPO, tiny_config(*PIPE)).name]
    (a_ev, c_ev), mig = asyn.recoveries, asyn.migrations[0]
    flow = [(r.step, r.from_plan, r.to_plan, r.rung) for r in asyn.recoveries] + [
        (m["step"], m["from_plan"], m["to_plan"]) for m in asyn.migrations]
    assert a_ev.migration == "async" and a_ev.to_plan.startswith("d1s4")
    assert a_ev.rung == "buddy" and a_ev.bytes_kept_in_place > 0
    assert mig["to_plan"] == a_ev.optimal_plan and mig["step"] in (4, 5)
    assert mig["verify"]["leaves"] > 0 and a_ev.verify["leaves"] > 0
    # the second failure hits the plan the cut-over just installed, at the cut-over step
    assert c_ev.step == mig["step"] and c_ev.from_plan == a_ev.optimal_plan, flow
    assert c_ev.verify["leaves"] > 0, flow
    assert c_ev.rung in ("replica", "buddy") and c_ev.steps_lost == 0, flow
    assert asyn.final_plan.zero_stage == 1
    assert all(3 not in log.sources() for log in asyn.transfer_logs)
    assert all(0 not in log.sources() for log in asyn.transfer_logs[1:])
    for s in range(10):
        rel = abs(asyn.losses[s] - ref.losses[s]) / ref.losses[s]
        assert rel <= 1e-5, (s, rel)


@pytest.mark.slow
def test_failed_background_compile_keeps_the_fast_path(exe_cache, tmp_path):
    """The optimal plan's background compile fails: the run stays on its fast path (the same
    computation, losses within 1e-5 of the fault-free run), logs the error and says so at the end."""
    fault = "faults=[{at_step: 3, devices: [3]}]"
    ref = trainer.run(tiny_config(*PIPE, "faults=[]"), exe_cache=exe_cache)
    t = trainer.Trainer(
        tiny_config(*PIPE, fault, "recovery.migration=async", "recovery.max_fast_path_steps=2"),
        tmp_path, exe_cache=exe_cache,
    )

    def failing(plan):
        raise RuntimeError(f"injected compile failure of {plan}")

    t.standby.compile_fn = failing
    run = t.run()
    (ev,) = run.recoveries
    assert ev.migration == "async" and run.migrations == []
    assert run.final_plan.name == ev.to_plan and ev.to_plan != ev.optimal_plan
    events = read_jsonl(tmp_path / "events.jsonl")
    (ab,) = [e for e in events if e["type"] == "cutover_abandoned"]
    assert ab["optimal_plan"] == ev.optimal_plan and "injected compile failure" in ab["errors"]["0"]
    (end,) = [e for e in events if e["type"] == "end"]
    assert any("abandoned" in n for n in end["notes"]) and not end["cutover_pending"]
    for s in range(10):
        rel = abs(run.losses[s] - ref.losses[s]) / ref.losses[s]
        assert rel <= 1e-5, (s, rel)
