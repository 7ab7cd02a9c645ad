"""Property: any fault schedule ends in the fault-free computation or in a loud, named error.

Hypothesis draws schedules over tiny versions of the demo configs (data x tensor with replicas;
ZeRO-1 on the default snapshot config): one to three failures of a device, a host, or `count`
random devices, at any step including 0, and failures during a recovery (as its plan, transfer
or verification phase begins: `phase: recovery/plan`, `recovery`, `recovery/verify`; an explicit
example fails a device in the recovery's first step, `recovery/first_step`).
Explicit examples add an uneven 8 -> 7 -> 5 -> 3 shrink and the loss of every holder of a
tensor slice. Pipeline schedules (a pipeline with asynchronous migration; they also draw
failures at the cut-over step) compile about 4x longer: they run with
`ELASJAX_FAULT_SCHEDULES=N`, N schedules over all three variants. (In CI, a failure at a
pipeline's cut-over step is test_pipeline_recovery.py's.)

The outcome is decided before the run, from the coverage rules (`recovery.plan_losses`: the
recovery's own check from shapes and shardings, `transfer.coverage`): for each failure in
order, on the plan the loop stands on then, either some slice is left with no copy, and the run
must raise `UnrecoverableStateError` naming a leaf of those slices, or it recovers onto the
plan the planner gives. A run that recovers must match its fault-free run (the same samples,
every loss within 1e-5, every recovery verified) with exactly one recovery per failure step,
each with that step's failed devices (a failure during a recovery joins it). Where the run
decides the plan at run time (a pipeline's asynchronous cut-over: when its compile is ready),
the prediction covers both plans it may stand on, and a failure at the cut-over is matched by
its devices only. Anything else (another exception, a refused recoverable schedule, a skipped
failure, a silent divergence) fails the test.

The schedules are derandomised, so CI tries the same ones each time; `pytest -s` prints each
schedule and its outcome, and a summary of the outcomes.
"""

import collections
import os
import re

import pytest
from conftest import PIPE, assert_same_computation, tiny_config
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import jax

from elasjax.runtime import faults
from elasjax.plan import planner
from elasjax.loop import trainer
from elasjax.config import FaultConfig, standby_on
from elasjax.plan.contingencies import Contingencies
from elasjax.loop.recovery import plan_losses
from elasjax.transfer.shards import UnrecoverableStateError

pytestmark = pytest.mark.slow

VARIANTS = {
    "default": ["train.steps=8"],  # data 4 x tensor 2: every slice has replicas
    "zero1": ["train.steps=8", "parallel.tensor=1", "parallel.data=8", "zero.stage=1"],
    "pipeline": [*PIPE, "recovery.migration=async", "recovery.max_fast_path_steps=2"],
}
# CI draws 3 schedules over the two cheaper variants; ELASJAX_FAULT_SCHEDULES=N draws N over
# all three.
LONG = int(os.environ.get("ELASJAX_FAULT_SCHEDULES", "0"))
DRAWN = sorted(VARIANTS) if LONG else ["default", "zero1"]
CUTOVER_AFTER = 2  # recovery.max_fast_path_steps of the pipeline variant
MAX_FAILED = 4  # at least half the devices survive (the pipeline needs min_stage = 2 of them)
FAILING = (2, 3, 4, 5)  # devices that drawn `devices` failures pick from
TOPO = planner.Topology(tuple(range(8)), 2)
OUTCOMES: collections.Counter = collections.Counter()


def _steps(variant: str) -> int:
    return tiny_config(*VARIANTS[variant]).train.steps


def _live_after(events: list[dict]) -> list[int]:
    """Devices alive after `events`, resolved by the trainer's own schedule resolver."""
    cfgs = tuple(FaultConfig(**e) for e in events)
    gone = {d for ev in faults.resolve_schedule(cfgs, TOPO, 10**6) for d in ev.device_ids}
    return [d for d in TOPO.device_ids if d not in gone]


@st.composite
def schedules(draw):
    """Failures of devices 2-5 (hosts 1 and 2), so that plans repeat across schedules and
    their executables are compiled once: the property is over kinds, sizes and moments."""
    variant = draw(st.sampled_from(DRAWN))
    steps = _steps(variant)
    events: list[dict] = []
    step = draw(st.integers(0, steps - 3))
    for i in range(draw(st.integers(1, 3))):
        live = _live_after(events)
        budget = MAX_FAILED - (len(TOPO.device_ids) - len(live))
        pool = [d for d in live if d in FAILING]
        if budget <= 0 or not pool:
            break
        kinds = ["device", "host", "count"] + (["during recovery"] if i else [])
        if variant == "pipeline" and i == 1 and events[0]["at_step"] + CUTOVER_AFTER < steps:
            kinds.append("at cut-over")
        kind = draw(st.sampled_from(kinds))
        if kind == "during recovery":
            ev = {"at_step": events[-1]["at_step"], "phase": draw(st.sampled_from(
                ["recovery/plan", "recovery", "recovery/verify"]))}
        elif kind == "at cut-over":  # the cut-over comes 1 to CUTOVER_AFTER steps later
            ev = {"at_step": events[0]["at_step"] + 1, "phase": "cutover"}
        else:
            if i:
                if step >= steps - 1:
                    break
                step = draw(st.integers(step + 1, steps - 1))
            ev = {"at_step": step}
        hosts = [h for h in (1, 2) if all(d in live for d in TOPO.host_devices(h))]
        if kind == "host" and hosts and budget >= TOPO.devices_per_host:
            ev["hosts"] = [draw(st.sampled_from(hosts))]
        elif kind == "count":
            ev["count"] = draw(st.integers(1, min(2, budget)))
            ev["seed"] = draw(st.integers(0, 3))
        else:
            ev["devices"] = sorted(draw(st.lists(st.sampled_from(pool), min_size=1,
                                                 max_size=min(2, budget), unique=True)))
        if kind == "at cut-over":
            step = max(step, events[0]["at_step"] + CUTOVER_AFTER)
        events.append(ev)
    events.sort(key=lambda e: (e["at_step"], e.get("phase", "").startswith("recovery")))
    return variant, events


def _yaml(events: list[dict]) -> str:
    def one(e):
        return "{" + ", ".join(f"{k}: {v}" for k, v in e.items()) + "}"

    return "faults=[" + ", ".join(one(e) for e in events) + "]"


def expected(variant: str, events: list[dict]) -> tuple[list, set[str] | None]:
    """The run's outcome by the coverage rules: ([(step or None, failed devices) per recovery],
    the leaves one of which the refusal must name, or None when every failure recovers). A step
    is None where the run decides it (a failure at a pipeline's cut-over)."""
    cfg = tiny_config(*VARIANTS[variant], _yaml(events))
    init = planner.initial_plan(TOPO, cfg)
    plans = Contingencies(cfg, TOPO, init, device_failures=True, can_grow=False,
                          standby=standby_on(cfg, None))
    devices = {d.id: d for d in jax.devices()}
    groups: dict = {}  # (step, at the cut-over) -> the failures of one recovery, in order
    for ev in faults.resolve_schedule(cfg.faults, TOPO, cfg.train.steps):
        key = (None, ev.at_step) if ev.phase == "cutover" else (ev.at_step, None)
        groups.setdefault(key, []).append(ev)
    live, lost = set(TOPO.device_ids), set()
    stands = [init]  # the plans the loop may stand on now (two between a fast path and its cut-over)
    recoveries = []
    for (step, cut), evs in sorted(groups.items(), key=lambda kv: kv[0][0] if kv[0][0] is not None
                                   else kv[0][1] + 0.5):
        dead = {d for e in evs for d in e.device_ids} & live
        for e in evs:
            lost |= TOPO.hosts_lost(e.device_ids)
        on = stands[-1:] if cut is not None else stands  # at the cut-over: on the optimal plan
        missing = [plan_losses(cfg, p, TOPO, live, dead, lost, devices) for p in on]
        leaves = {path for m in missing for path, _ in m}
        if all(missing):
            return recoveries, leaves
        assert not any(missing), f"the outcome depends on the cut-over's timing: {missing}"
        live -= dead
        survivors = plans.survivors(live)
        fast, optimal = plans.recovery_plan(on[-1], survivors)
        stands = [fast, optimal] if fast != optimal else [optimal]
        recoveries.append((step, sorted(dead)))
    return recoveries, None


@pytest.fixture(scope="module")
def references(exe_cache):
    refs = {}

    def get(variant):
        if variant not in refs:
            refs[variant] = trainer.run(tiny_config(*VARIANTS[variant], "faults=[]"),
                                        exe_cache=exe_cache)
        return refs[variant]

    yield get
    print(f"\nfault schedules tried: {sum(OUTCOMES.values())}; outcomes: {dict(OUTCOMES)}")


@given(schedule=schedules())
@example(schedule=("default", [  # uneven survivors: 8 -> 7 -> 5 -> 3 devices
    {"at_step": 2, "devices": [3]}, {"at_step": 4, "hosts": [0]}, {"at_step": 6, "devices": [2, 4]},
]))
@example(schedule=("default", [{"at_step": 5, "devices": [0, 2, 4, 6]}]))  # slice 0 is gone
@example(schedule=("default", [  # a failure in the recovery's first step joins that recovery
    {"at_step": 3, "devices": [2]}, {"at_step": 3, "devices": [4], "phase": "recovery/first_step"},
]))
@settings(max_examples=LONG or 3, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_a_fault_schedule_recovers_exactly_or_names_the_lost_leaf(exe_cache, references,
                                                                   schedule):
    variant, events = schedule
    ref = references(variant)
    recoveries, leaves = expected(variant, events)
    cfg = tiny_config(*VARIANTS[variant], _yaml(events))
    if leaves is not None:
        with pytest.raises(UnrecoverableStateError) as e:
            trainer.run(cfg, exe_cache=exe_cache)
        named = re.findall(r"'([^']+)'", str(e.value))
        assert leaves & set(named), (f"the refusal names {named}, the coverage rules lose "
                                     f"{sorted(leaves)}: {e.value}")
        outcome = "refused as predicted (UnrecoverableStateError naming a lost leaf)"
    else:
        run = trainer.run(cfg, exe_cache=exe_cache)
        assert all(r.verify["leaves"] > 0 for r in run.recoveries)
        got = [(r.step, sorted(r.failed_devices)) for r in run.recoveries]
        assert [d for _, d in got] == [d for _, d in recoveries], (got, recoveries)
        assert all(s is None or s == g for (s, _), (g, _) in zip(recoveries, got)), (got, recoveries)
        assert_same_computation(run, ref)
        assert sorted(run.losses) == sorted(ref.losses)
        outcome = ("recovered as predicted, within 1e-5: "
                   + "/".join(sorted({r.rung for r in run.recoveries})))
    OUTCOMES[outcome] += 1
    print(f"{variant} {_yaml(events)} -> {outcome}")
