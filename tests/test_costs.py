"""The whole cost of a failure (`metrics.failure_costs`): time lost until back at pace, and the
run's goodput, on hand-made timelines whose answer is known, then on a real run."""

import pytest

from conftest import tiny_config
from elasjax.loop import trainer
from elasjax.observe.metrics import RecoveryEvent, Timeline, failure_costs, paces


def _recovery(step, to_plan, *, compile_s=0.5, transfer_s=0.2, first_step_s=3.0):
    return RecoveryEvent(
        step=step, failed_devices=[3], fault="device 3", from_plan="A", to_plan=to_plan,
        rung="buddy", bytes_moved=0, transfers=0, max_transfers_per_device=0, bytes_lost=0,
        steps_lost=0, detect_s=0.1, plan_s=0.1, compile_s=compile_s, standby_hit=False,
        exe_cache_hit=False, transfer_s=transfer_s, verify_s=0.1, runtime="in-process",
        failure_simulation="simulated", first_step_s=first_step_s,
    )


def test_time_lost_counts_phases_slow_first_steps_and_pauses_until_back_at_pace():
    """Plan A runs at 1 s a step; a failure moves the run to B (1.25 s a step): its recovery
    phases (1 s), two slow first steps (3 s and 2 s: 1.75 + 0.75 beyond B's pace) and a 4 s
    standby pause are lost; a slow step after B is back at pace is not charged to it."""
    tl = Timeline(startup_s=10.0)
    for _ in range(4):
        tl.step("A", 1.0, False)
    ev = _recovery(4, "B")
    tl.recovery(ev)
    for dt in (3.0, 2.0, 1.25, 1.25):
        tl.step("B", dt, False)
    tl.pause(4.0)
    for dt in (1.25, 1.25, 5.0, 1.25):
        tl.step("B", dt, False)
    wall = 10.0 + 4 * 1.0 + 1.0 + (3 + 2 + 1.25 * 2) + 4 + (1.25 * 3 + 5) + 0.5  # + 0.5 other
    (cost,), good = failure_costs(tl, "A", wall)
    assert paces(tl) == {"A": 1.0, "B": 1.25}
    assert cost["phases_s"] == pytest.approx(1.0)
    assert cost["slow_steps_s"] == pytest.approx(1.75 + 0.75)
    assert cost["pauses_s"] == pytest.approx(4.0) and cost["steps_to_pace"] == 3
    assert cost["time_lost_s"] == pytest.approx(1.0 + 2.5 + 4.0)
    assert good["useful_steps"] == 12 and good["good_s"] == pytest.approx(12.0)
    assert good["goodput"] == pytest.approx(12.0 / wall)
    b = good["badput"]
    assert b["startup_s"] == 10.0 and b["compile_s"] == 0.5 and b["recovery_s"] == pytest.approx(0.5)
    assert b["capacity_s"] == pytest.approx(8 * 0.25)  # eight steps on B at 1.25 instead of 1.0
    assert b["slow_steps_s"] == pytest.approx(1.75 + 0.75 + 3.75)  # no step below its pace
    # every second of the wall time is accounted for, the rest under "other"
    assert good["good_s"] + sum(b.values()) == pytest.approx(wall)
    assert b["other_s"] == pytest.approx(0.5)


def test_a_plan_faster_than_the_initial_one_is_no_negative_badput():
    """Plan A runs at 1 s a step; a failure moves the run to B at 0.8 s (a smaller plan can be
    faster where devices share cores: issue 80's demo on 2 cores ended on `capacity_s: -1.15`).
    B's steps are no negative capacity badput: `capacity_s` is 0 and the 0.2 s each of its five
    steps gained is reported apart, `gained_s`; every cause is >= 0 and the wall time
    still reconciles, good + badput - gained_s."""
    tl = Timeline(startup_s=2.0)
    for _ in range(4):
        tl.step("A", 1.0, False)
    tl.recovery(_recovery(4, "B", first_step_s=2.0))  # 1 s of phases before its first step
    for dt in (2.0, 0.8, 0.8, 0.8, 0.8):
        tl.step("B", dt, False)
    wall = 2.0 + 4 * 1.0 + 1.0 + (2.0 + 4 * 0.8) + 0.3  # + 0.3 other
    (cost,), good = failure_costs(tl, "A", wall)
    assert paces(tl) == {"A": 1.0, "B": 0.8}
    b = good["badput"]
    assert b["capacity_s"] == 0.0 and good["gained_s"] == pytest.approx(5 * 0.2)
    assert all(v >= 0 for v in b.values()), b
    assert good["good_s"] == pytest.approx(9.0) and b["slow_steps_s"] == pytest.approx(1.2)
    assert b["other_s"] == pytest.approx(0.3)
    assert good["good_s"] + sum(b.values()) - good["gained_s"] == pytest.approx(wall)
    assert cost["time_lost_s"] == pytest.approx(1.0 + 1.2)  # the failure's cost is unchanged


def test_steps_faster_than_their_pace_on_balance_are_no_negative_badput():
    """Steps below their plan's median outweighing those above (-0.8 s net) leave
    `slow_steps_s` at 0 and what they gained in `gained_s`, not in the rest of the wall time:
    `other_s` is the other time itself, more or less than the gain, and the identity holds."""
    tl = Timeline()
    for dt in (1.0, 1.0, 1.0, 1.2, 0.5, 0.5):  # settled: all but the first; median 1.0
        tl.step("A", dt, False)
    for other in (1.0, 0.5):
        wall = 5.2 + other
        _, good = failure_costs(tl, "A", wall)
        b = good["badput"]
        assert all(v >= 0 for v in b.values()), b
        assert b["slow_steps_s"] == 0.0
        assert b["other_s"] == pytest.approx(other) and good["gained_s"] == pytest.approx(0.8)
        assert good["good_s"] + sum(b.values()) - good["gained_s"] == pytest.approx(wall)


def test_fast_path_steps_are_lost_against_the_plan_the_run_cuts_over_to():
    """An asynchronous migration: the run resumes on fast path F (2 s a step) and cuts over
    to O (1 s) after three steps with a 0.5 s stall; each fast-path step loses 1 s against O."""
    tl = Timeline()
    for _ in range(3):
        tl.step("A", 1.0, False)
    tl.recovery(_recovery(3, "F", compile_s=0.0, transfer_s=0.0, first_step_s=2.0))
    for _ in range(3):
        tl.step("F", 2.0, False)
    tl.cutover("O", 0.5)
    for _ in range(4):
        tl.step("O", 1.0, False)
    (cost,), _ = failure_costs(tl, "A", 100.0)
    assert cost["target_plan"] == "O"
    assert cost["fast_path_s"] == pytest.approx(3.0) and cost["pauses_s"] == pytest.approx(0.5)
    assert cost["time_lost_s"] == pytest.approx(0.3 + 3.0 + 0.5)  # phases: detect, plan, verify
    assert "note" not in cost


def test_redone_steps_are_lost_and_a_run_that_ends_slow_says_so():
    tl = Timeline()
    tl.step("A", 1.0, False)
    tl.step("A", 1.0, False)
    tl.recovery(_recovery(2, "A"))
    tl.step("A", 1.0, True)  # redone from a checkpoint
    tl.step("A", 5.0, False)  # the run ends before a step at pace
    (cost,), good = failure_costs(tl, "A", 20.0)
    assert cost["redone_s"] == 1.0 and cost["slow_steps_s"] == pytest.approx(4.0)
    assert "back at pace" in cost["note"]
    assert good["useful_steps"] == 3 and good["badput"]["redone_s"] == 1.0


def test_a_run_reports_time_lost_and_goodput(tmp_path):
    """A real run with a device failure: one `failure_cost` event and a goodput in the end
    event, the same as the summary's; the time lost is at least the recovery's phases before
    its first step."""
    from elasjax.observe.metrics import read_jsonl

    cfg = tiny_config("faults=[{at_step: 3, devices: [3]}]", "train.steps=8")
    run = trainer.run(cfg, tmp_path)
    (rec,) = run.recoveries
    (cost,) = run.failure_costs
    assert cost["step"] == 3 and cost["phases_s"] == pytest.approx(rec.mttr_s - rec.first_step_s)
    assert cost["time_lost_s"] >= cost["phases_s"]
    # the recovery compiled the new plan: its first step was the executable's first run, and a
    # first step slower than the plan's pace says so
    assert rec.first_step_first_run and cost["first_step_x"] > 0
    assert cost["first_step_x"] <= 1.1 or "first run" in cost["first_step_why"]
    events = read_jsonl(tmp_path / "events.jsonl")
    (fc,) = [e for e in events if e["type"] == "failure_cost"]
    (end,) = [e for e in events if e["type"] == "end"]
    assert fc["time_lost_s"] == pytest.approx(cost["time_lost_s"])
    g = end["goodput"]
    assert 0 < g["goodput"] < 1 and g["useful_steps"] == 8
    assert g["badput"]["compile_s"] == pytest.approx(rec.compile_s)
    assert g["goodput"] == pytest.approx(run.goodput["goodput"])


def test_step_clock_notes_when_a_step_finished_not_when_it_was_read():
    """A step read later than it finished is timed at its end; one whose devices failed has no
    end (None); reading a step forgets the ones before it. Ordered, not timed: the step is
    read once the clock's thread has noted it (a sleep "long enough" for that failed beside
    other load), and each wait for the thread is bounded generously."""
    import time

    import jax
    import jax.numpy as jnp

    from elasjax.observe.metrics import StepClock

    def noted(seq):  # the clock's thread has noted step `seq` (its time, or None)
        with clock._cv:
            return clock._cv.wait_for(lambda: seq in clock._done, timeout=60)

    clock = StepClock()
    try:
        f = jax.jit(lambda a: (a @ a).sum())
        t0 = time.perf_counter()
        y = f(jnp.ones((256, 256)))
        clock.watch(1, y)
        y.block_until_ready()
        assert noted(1)  # read late: after the thread noted its end
        t_read = time.perf_counter()
        t = clock.finished(1)
        assert t is not None and t0 <= t < t_read  # its end, noted before it was read
        z = jnp.ones(4) + 1
        z.delete()
        clock.watch(2, z)
        assert clock.finished(2, wait_s=60.0) is None  # noted with no end (a hang is bounded)
        clock.watch(3, jnp.zeros(2))
        clock.watch(4, jnp.zeros(2))
        assert clock.finished(4, wait_s=60.0) is not None
        assert clock.finished(3, wait_s=0.0) is None  # forgotten once 4 was read
    finally:
        clock.close()
