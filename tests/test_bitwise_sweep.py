"""The bitwise contract swept (`elasjax.bench.bitwise`): every deterministic config, at its own
size and settings, through failures that shrink its data degree to each value the planner
allows and a growth back, ends on the fault-free run's state, bit for bit, step by step.

The runs are `elasjax train` / `elasjax launch` processes with XLA as users compile (the suite's
own compile settings give other kernels: `bitwise.user_env`), so this is the test a change to
the step, the gradient sum or the layout must pass: the norm's tile sums changed the bits after
a shrink while every in-suite test passed (experiments/RESULTS.md, "The bitwise sweep")."""

import pytest

from elasjax import config
from elasjax.bench import bitwise
from elasjax.plan.planner import one_device

pytestmark = pytest.mark.slow

CASES = {c.name: c for c in bitwise.cases()}


def test_every_deterministic_config_is_swept():
    """A config of configs/ whose mode is deterministic as written is a case, and so is each
    documented configuration that turns the mode on; each case's config is deterministic."""
    written = {p.stem for p in (bitwise.ROOT / "configs").glob("*.yaml")
               if config.load(str(p), []).deterministic}
    assert written == {"demo_zero"} and written <= set(CASES)
    assert {"demo_pipeline", "demo"} <= set(CASES)
    for case in CASES.values():
        assert bitwise.load(case, "faults=[]").deterministic, case


def test_the_chains_visit_every_layout_the_planner_allows():
    """The ZeRO demo shrinks through every data degree from 7 to 2 (one device is the end: a
    one-device program has other bits, `planner.one_device`) and grows back to 8; the pipeline
    demo through the data x stage shapes its re-plans reach."""
    faults, steps, after = bitwise.chain_faults(CASES["demo_zero"])
    assert after == ["7", "6", "5", "4", "3", "2", "8"] and "join" in faults
    assert not any(one_device(p) for _, p in bitwise.shrink_path(CASES["demo_zero"]))
    _, _, after = bitwise.chain_faults(CASES["demo_pipeline"])
    assert after[-1] == "2x4 stages" and all("stages" in a for a in after)
    assert {"3x2 stages", "2x2 stages", "1x3 stages"} <= set(after), after


@pytest.fixture(scope="module")
def zero_chain(tmp_path_factory):
    """The ZeRO demo's chain (`bitwise.chain_faults`) and its fault-free run, which the launch
    test below compares with too (the same steps)."""
    case = CASES["demo_zero"]
    faults, steps, after = bitwise.chain_faults(case)
    ref = bitwise.fault_free(case, tmp_path_factory.mktemp("sweep") / "ref", steps)
    assert ref["rc"] == 0, ref["output"]
    return case, faults, steps, after, ref


def _check_chain(case, faults, steps, after, ref, out):
    run = bitwise.train(case, out, f"train.steps={steps}", faults)
    assert run["rc"] == 0, run["output"]
    verdict = bitwise.compare(run, ref)
    assert verdict.bitwise, verdict
    recoveries = [e for e in bitwise._jsonl(out / "events.jsonl") if e["type"] == "recovery"]
    assert len(recoveries) == len(after) - 1  # one per failure; the last entry is the growth
    assert verdict.plans[-1].split("m")[0] == verdict.plans[0].split("m")[0], verdict.plans


def test_the_zero_demo_through_every_shrink_and_back_is_bitwise(zero_chain, tmp_path):
    """One run down every data degree the planner allows (8 to 2, a device at a time) and back
    to 8, against the fault-free run of the same steps: every step's samples, loss, gradient
    norm and state digest, and the final state digest, equal bit for bit."""
    _check_chain(*zero_chain, tmp_path / "run")


def test_the_pipeline_demo_through_every_shrink_and_back_is_bitwise(tmp_path):
    """The pipeline demo with the mode on (`parallel.min_stage=2`), a device at a time through
    its fast paths and cut-overs (data x stages 2x4 -> 1x4 -> 3x2 -> 2x2 -> 1x2 -> 1x3) and back
    to 2x4: bit for bit, step by step. Its ZeRO-0 optimizer, fused with the step, changed
    Adam's moments on the first fast path; the suite's own compile settings did not show it."""
    case = CASES["demo_pipeline"]
    faults, steps, after = bitwise.chain_faults(case)
    ref = bitwise.fault_free(case, tmp_path / "ref", steps)
    assert ref["rc"] == 0, ref["output"]
    _check_chain(case, faults, steps, after, ref, tmp_path / "run")


def test_the_zero_demo_under_launch_is_bitwise_through_kills_and_rejoins(zero_chain, tmp_path):
    """The ZeRO demo as 4 processes of 2 devices: two SIGKILLs in step 3 take it from 8 to 4
    replicas (partitions re-laid over the survivors, the lost ones from buddy copies), both
    processes are started again (while the survivors compile the 4-replica plan) and rejoin,
    and the job grows back to 8; every step and the final state equal the one-process
    fault-free run's, bit for bit. (A newcomer admitted into a ZeRO job skipped the snapshot's
    exchange and the admission timed out: `snapshot._take`.)"""
    case, _, steps, _, ref = zero_chain
    run = bitwise.launch(case, tmp_path / "launch", "--processes", "4", "--devices-per-process",
                         "2", "--kill", "3:1", "--kill", "3:3", "--worker-restarts", "2",
                         sets=(f"train.steps={steps}", "faults=[]"))
    assert run["rc"] == 0, run["output"]
    verdict = bitwise.compare(run, ref)
    assert verdict.bitwise, verdict
    n = [r["n_devices"] for r in run["metrics"]]
    assert n[:3] == [8] * 3 and n[3] == 4 and n[-1] == 8, n  # halved in step 3, whole again
    deaths = [e for e in run["events"] if e["type"] == "recovery" and e["failed_processes"]]
    assert [sorted(e["failed_processes"]) for e in deaths] == [[1, 3]], deaths
    joins = [e for e in run["events"] if e["type"] == "join"]
    assert sorted(p for e in joins for p in e["rejoined"]["processes"]) == [1, 3], joins
