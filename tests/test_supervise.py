"""Supervision under `elasjax launch` (`--max-restarts N`, `elasjax/launch/supervisor.py`).

Pure parts first: the policy and its refusals, which checkpoint a restart resumes from, which
fault-schedule entries a restarted job keeps. Then the CLI's refusals (no process starts).

The slow tests start real `jax.distributed` jobs of 2 processes x 2 CPU devices (the launch
helpers of tests/test_multiprocess.py):

- the coordination process SIGKILLed after step 2 with checkpoints every 2 steps under
  `--max-restarts 1` (the resumed job must start at its first attempt): the launcher reaps every process, starts a new job on a fresh coordinator
  port resuming from the newest checkpoint; every step's loss,
  before and after the restart, equals the single-process fault-free run within 1e-5; the
  restart is recorded with its reason;
- an error that recurs in every attempt (a user hook raising in every process) under
  `--max-restarts 1`: one restart, then the launch stops with the reason (the budget is spent).
"""

import json
import signal
from pathlib import Path

import pytest
from conftest import tiny_config
from test_multiprocess import (
    CONFIG,
    LOSS_RTOL,
    ROOT,
    _kill_workers,
    _launch,
    _worker_ended,
)

from elasjax import cli
from elasjax.loop import trainer
from elasjax.config import ConfigError, FaultConfig, load
from elasjax.observe.metrics import read_jsonl
from elasjax.launch.supervisor import (
    COMMIT_MARKER,
    RestartPolicy,
    check_out,
    check_supervisable,
    committed_checkpoints,
    faults_override,
    plan_restart,
    reached_step,
    remaining_faults,
    set_aside,
    stop_reason,
)

# ---------------------------------------------------------------------------------------------
# Pure parts.


def test_the_policy_is_checked_and_its_backoff_doubles():
    p = RestartPolicy(3, 1.5)
    assert [p.delay(r) for r in (1, 2, 3)] == [1.5, 3.0, 6.0]
    assert not RestartPolicy().enabled and p.enabled
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ConfigError, match=r"--max-restarts .*allowed values: an integer >= 0"):
            RestartPolicy(bad)
    for bad in (-0.5, float("nan")):
        with pytest.raises(ConfigError, match=r"--restart-backoff .*allowed values: seconds >= 0"):
            RestartPolicy(1, bad)


def test_a_supervised_launch_needs_a_checkpoint_dir_of_its_own(tmp_path):
    policy = RestartPolicy(1)
    check_supervisable(tiny_config(), RestartPolicy(0))  # unsupervised: nothing asked
    with pytest.raises(ConfigError, match=r"--max-restarts 1 .*'checkpoint.dir' is not set"):
        check_supervisable(tiny_config(), policy)
    ck = tmp_path / "ck"
    check_supervisable(tiny_config(f"checkpoint.dir={ck}"), policy)  # absent: fine
    _commit(ck / "4")
    with pytest.raises(ConfigError, match=r"already holds checkpoints \(steps \[4\]\)"):
        check_supervisable(tiny_config(f"checkpoint.dir={ck}"), policy)
    # resuming from them on purpose is allowed
    check_supervisable(tiny_config(f"checkpoint.dir={ck}", "checkpoint.resume_step=-1"), policy)


def _commit(step_dir: Path) -> None:
    step_dir.mkdir(parents=True)
    (step_dir / COMMIT_MARKER).write_text("committed")


def test_only_committed_checkpoints_count(tmp_path):
    assert committed_checkpoints(tmp_path / "absent") == []
    for name in ("0", "2", "10", "12.orbax-checkpoint-tmp-1700000000"):
        _commit(tmp_path / name)
    (tmp_path / "14").write_text("a file, not a checkpoint")
    (tmp_path / "16").mkdir()  # no commit marker: not finished
    assert committed_checkpoints(tmp_path) == [0, 2, 10]  # numeric order, unfinished ones out


def test_a_fault_that_fired_does_not_fire_again_after_a_restart():
    kill0 = FaultConfig(3, kill_process=0)
    kill2 = FaultConfig(1, kill_process=2)
    later = FaultConfig(5, kill_process=1)
    stall = FaultConfig(3, stall_process=1, stall_s=2.0)
    during = FaultConfig(3, kill_process=3, phase="recovery")
    kept, dropped = remaining_faults((kill2, kill0, during, stall, later), 3, {0, 2})
    assert kept == (stall, later)  # at the reached step, not seen to fire: kept
    why = {f: w for f, w in dropped}
    assert set(why) == {kill2, kill0, during}
    assert "went past step 1" in why[kill2]
    assert "killed as scheduled" in why[kill0]
    assert "failure at step 3 that its recovery needs fired" in why[during]
    # the override carries exactly the kept entries to the restarted job's config
    cfg = load(CONFIG, [faults_override(kept)])
    assert cfg.faults == kept
    # a kill of process 0 the job never reached stays
    assert remaining_faults((kill0,), 2, set()) == ((kill0,), ())
    # an admission's kill needs a process killed (to be restarted) at or before its step
    admit = FaultConfig(4, kill_process=1, phase="admission")
    assert remaining_faults((kill0, admit), 3, set()) == ((kill0, admit), ())
    kept, dropped = remaining_faults((kill0, admit), 3, {0})
    assert kept == () and "nobody restarts to be admitted" in dict(dropped)[admit]


def test_the_reached_step_is_the_first_unlogged_step_or_a_kill_seen_to_fire(tmp_path):
    m = tmp_path / "metrics.jsonl"
    assert reached_step(m) == 0
    m.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(3)))
    assert reached_step(m) == 3
    assert reached_step(m, [5]) == 5


def test_restart_or_stop_says_why():
    p = RestartPolicy(2)
    assert stop_reason("coordinator_lost", -9, 0, p) is None
    assert stop_reason("failed", 1, 1, p) is None
    assert "budget is spent (2 of --max-restarts 2 used)" in stop_reason("failed", 1, 2, p)
    assert "config or usage error" in stop_reason("failed", 2, 0, p)
    assert "--timeout" in stop_reason("timeout", None, 0, p)
    assert stop_reason("finished", 0, 0, p) == "the job finished"


def test_an_ended_attempts_files_are_set_aside_and_directories_stay(tmp_path):
    for name in ("metrics.jsonl", "events.jsonl", "worker0.log", "supervisor.jsonl"):
        (tmp_path / name).write_text(name)
    (tmp_path / "ckpt" / "2").mkdir(parents=True)
    dest = set_aside(tmp_path, 0)
    assert sorted(p.name for p in dest.iterdir()) == ["events.jsonl", "metrics.jsonl", "worker0.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt0", "ckpt", "supervisor.jsonl"]


def test_a_restart_resumes_from_the_newest_checkpoint_with_what_is_left_of_the_schedule(tmp_path):
    out, ck = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    for step in (0, 2, 4):
        _commit(ck / str(step))
    (ck / "6.orbax-checkpoint-tmp-1").mkdir()  # the save the death cut off
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(5)))
    (out / "worker0.log").write_text("attempt 0")
    faults = (FaultConfig(5, kill_process=0), FaultConfig(7, kill_process=1))
    policy = RestartPolicy(2, 0.5)
    rs = plan_restart(out, 0, "coordinator_lost", "process 0 was killed", faults, {0}, {0: 5},
                      ck, [f"checkpoint.dir={ck}", "train.steps=10"], 2, policy)
    assert rs.overrides[:2] == (f"checkpoint.dir={ck}", "train.steps=10")
    resumed = load(CONFIG, list(rs.overrides))
    assert resumed.faults == faults[1:] and resumed.checkpoint.resume_step == -1
    r = rs.record
    assert (r["restart"], r["attempt"], r["from_step"], r["reached_step"]) == (2, 1, 4, 5)
    assert r["backoff_s"] == policy.delay(2) and r["reason"] == "coordinator_lost"
    assert r["kept_faults"] == ["step 7: kill process 1"]
    assert [d["fault"] for d in r["dropped_faults"]] == ["step 5: kill process 0"]
    assert (out / "attempt0" / "worker0.log").read_text() == "attempt 0"
    assert not (out / "metrics.jsonl").exists()
    assert "resuming from checkpoint step 4" in rs.line and "kill process 0" in rs.line
    # the same output directory cannot take a second supervised launch's attempts
    with pytest.raises(ConfigError, match=r"holds attempt0 of an earlier supervised launch"):
        check_out(out, policy)
    check_out(out, RestartPolicy(0))
    # nothing committed yet: a fresh start, said
    empty = tmp_path / "out2"
    empty.mkdir()
    rs = plan_restart(empty, 0, "failed", "x", (), set(), {}, tmp_path / "none", [], 1, policy)
    assert not any(o.startswith("checkpoint.resume_step") for o in rs.overrides)
    assert rs.record["from_step"] == 0 and not rs.record["resumed_from_checkpoint"]
    assert "from step 0 (no checkpoint was committed" in rs.line


def test_the_cli_refuses_what_supervision_cannot_do(tmp_path, capsys):
    """Refused before any process starts (exit code 2, the flag named)."""
    base = ["launch", str(CONFIG), "--processes", "4", "--out", str(tmp_path / "o")]
    assert cli.main([*base, "--max-restarts", "1"]) == 2
    assert "--max-restarts 1 restarts the job from its newest checkpoint" in capsys.readouterr().err
    assert cli.main([*base, "--max-restarts", "-1"]) == 2
    assert "--max-restarts -1: allowed values" in capsys.readouterr().err
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    assert cli.main([*base, "--set", ck, "--max-restarts", "1", "--restart-backoff", "-1"]) == 2
    assert "--restart-backoff -1.0: allowed values" in capsys.readouterr().err
    joined = ["launch", str(CONFIG), "--coordinator", "127.0.0.1:1", "--num-processes", "2",
              "--process-id", "1", "--max-restarts", "1"]
    assert cli.main(joined) == 2
    assert "allowed values with --coordinator: 0" in capsys.readouterr().err
    # the staged loss of the coordination process: a step the run has, and a local launch only
    assert cli.main([*base, "--set", "train.steps=6", "--kill-coordinator", "5"]) == 2
    assert "--kill-coordinator 5: allowed values: a step from 0 to 4" in capsys.readouterr().err
    assert cli.main([*joined[:-2], "--kill-coordinator", "1"]) == 2
    assert "--kill-coordinator is for a local launch" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing started


# ---------------------------------------------------------------------------------------------
# Real jobs.

STEPS = 6
EVERY = 2
_JOB = ("parallel.devices=-1", "parallel.data=2", "parallel.tensor=2", f"train.steps={STEPS}")


@pytest.fixture(scope="module")
def reference(exe_cache):
    """The single-process fault-free run of the same 4-device job."""
    cfg = tiny_config("faults=[]", "parallel.devices=4", "parallel.data=2", "parallel.tensor=2",
                      f"train.steps={STEPS}")
    return trainer.run(cfg, None, exe_cache=exe_cache)


def _supervised(out: Path, ck: Path, *args: str, sets=(), env=None, timeout=420):
    try:
        return _launch(
            out, "--processes", "2", "--devices-per-process", "2", "--restart-backoff", "0.5",
            *args, sets=(*_JOB, f"checkpoint.dir={ck}", f"checkpoint.every={EVERY}", *sets),
            env=env, timeout=timeout,
        )
    finally:
        for d in out.glob("attempt*"):
            _kill_workers(d)


def _all_reaped(summary: dict) -> None:
    for att in [*summary["attempts"], summary]:
        assert att["left_running_after_reap"] == []
        assert all(_worker_ended(s["pid"]) for s in att["processes"]), att


def _assert_losses(rows: list[dict], ref, steps) -> None:
    assert [r["step"] for r in rows] == list(steps), "a step was lost or repeated"
    for r in rows:
        s = r["step"]
        assert r["batch_digest"] == ref.sample_digests[s], f"different samples at step {s}"
        rel = abs(r["loss"] - ref.losses[s]) / ref.losses[s]
        assert rel <= LOSS_RTOL, f"step {s}: loss {r['loss']} vs {ref.losses[s]} (rel {rel:.2e})"


def _worker_logs(out: Path, lines: int = 40) -> str:
    """The last lines of every worker log of every attempt, for a failure's report."""
    parts = []
    for log in sorted(out.glob("**/worker*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.relative_to(out)}\n" + "\n".join(tail))
    return "\n".join(parts)


@pytest.mark.slow
def test_losing_the_coordination_process_restarts_the_job_from_its_newest_checkpoint(
        reference, tmp_path):
    """The coordination process is SIGKILLed once step 2 is logged (`--kill-coordinator 2`, in
    the first attempt only): every worker loses the service, the job is restarted once (a
    budget of one restart: the resumed job must start at its first attempt), a new job on a
    fresh coordinator, from the newest checkpoint committed before the loss (Orbax commits
    asynchronously: the save after step 2 may not have landed, and then the one after step 0
    is the newest), and finishes with the fault-free run's losses. Each start barrier's
    arrivals are logged: the resumed job's skew is printed."""
    out, ck = tmp_path / "sup", tmp_path / "ck"
    rc, stdout = _supervised(out, ck, "--max-restarts", "1", "--kill-coordinator", "2")
    print(stdout)
    assert rc == 0, f"{stdout}\n{_worker_logs(out)}"
    summary = json.loads((out / "launch.json").read_text())
    assert summary["outcome"] == "finished"
    (first,) = summary["attempts"]
    assert first["outcome"] == "coordinator_lost"
    assert first["coordination"]["returncode"] == -signal.SIGKILL
    assert first["coordinator"] != summary["coordinator"]  # a new job, not a rejoin
    _all_reaped(summary)
    # recorded, with its reason and where it resumed from
    records = read_jsonl(out / "supervisor.jsonl")
    assert [r["type"] for r in records] == ["restart", "end"]
    r = records[0]
    assert r["restart"] == 1 and r["reason"] == "coordinator_lost"
    assert "killed as scheduled after step 2 (--kill-coordinator" in r["message"]
    assert "it hosts the JAX coordination service" in r["message"]
    reached = r["reached_step"]
    assert reached >= 3  # step 2 was logged before the kill
    newest = (reached - 1) // EVERY * EVERY  # the last checkpoint saved before the loss
    assert r["from_step"] <= newest and r["from_step"] % EVERY == 0
    assert r["resumed_from_checkpoint"] and r["dropped_faults"] == []
    assert records[-1]["outcome"] == "finished" and records[-1]["restarts"] == 1
    assert "restart 1 of 1 in 0.5s: coordinator_lost" in stdout
    assert f"resuming from checkpoint step {r['from_step']}" in stdout
    log = (out / "worker0.log").read_text()
    assert "start/verify entry barrier: arrivals at the entry barrier: " in log
    print("resumed job's start skews:", [ln.split("entry barrier: ", 1)[1] for ln in
                                         log.splitlines() if "entry barrier: arrivals" in ln])
    restarts = records[:1]
    # the last job resumed from a checkpoint and ran with no fault left
    resumed = restarts[-1]["from_step"]
    (start,) = [e for e in read_jsonl(out / "events.jsonl") if e["type"] == "start"]
    assert start["resumed_from_checkpoint"] == resumed and start["faults"] == []
    # every step's loss equals the fault-free run's: before the loss, and after the restart
    before = read_jsonl(out / "attempt0" / "metrics.jsonl")
    _assert_losses(before, reference, range(len(before)))
    _assert_losses(read_jsonl(out / "metrics.jsonl"), reference, range(resumed, STEPS))


@pytest.mark.slow
def test_a_lone_survivors_checkpoints_resume_the_job(reference, tmp_path):
    """Process 0 is SIGKILLed after step 1 (`--kill 1:0`): process 1 trains on alone, on its own
    two devices, and saves the next checkpoints itself (a single-process child
    writes them: transfer/lone_writer.py). Then the coordination process is killed after step 2:
    the job restarts on two processes from the newest checkpoint, one that the lone survivor
    wrote, and finishes with the fault-free losses. Until the writer existed such a checkpoint
    was a commit marker over no data and every such resume failed (experiments/RESULTS.md,
    2026-11-28: 10 of 20 supervised resumes)."""
    out, ck = tmp_path / "lone", tmp_path / "ck"
    rc, stdout = _supervised(out, ck, "--max-restarts", "1", "--kill", "1:0",
                             "--kill-coordinator", "2")
    print(stdout)
    assert rc == 0, f"{stdout}\n{_worker_logs(out)}"
    records = read_jsonl(out / "supervisor.jsonl")
    assert [r["type"] for r in records] == ["restart", "end"], records
    resumed = records[0]["from_step"]
    assert resumed >= 2 and records[0]["resumed_from_checkpoint"], records[0]
    # the checkpoint resumed from was written after process 0's death, by process 1 alone
    before = read_jsonl(out / "attempt0" / "metrics.jsonl")
    assert any(e["type"] == "recovery" for e in read_jsonl(out / "attempt0" / "events.jsonl"))
    _assert_losses(before, reference, range(len(before)))
    _assert_losses(read_jsonl(out / "metrics.jsonl"), reference, range(resumed, STEPS))
    assert records[-1]["outcome"] == "finished"


@pytest.mark.slow
def test_a_failure_that_recurs_spends_the_budget_and_the_launch_stops_with_the_reason(tmp_path):
    fail_step = 2  # checkpoint 2 holds the state before step 2: each attempt fails there again
    out, ck = tmp_path / "spent", tmp_path / "ck"
    rc, stdout = _supervised(
        out, ck, "--max-restarts", "1", "--hook", "user_failing_hook:fail",
        env={"PYTHONPATH": str(ROOT / "tests"), "ELASJAX_TEST_FAIL_STEP": str(fail_step)},
    )
    print(stdout)
    assert rc == 1, stdout
    summary = json.loads((out / "launch.json").read_text())
    assert summary["outcome"] == "failed" and len(summary["attempts"]) == 1
    assert "not restarted: the restart budget is spent (1 of --max-restarts 1 used)" in (
        summary["message"])
    _all_reaped(summary)
    records = read_jsonl(out / "supervisor.jsonl")
    assert [r["type"] for r in records] == ["restart", "stop", "end"]
    assert records[0]["reason"] == "failed" and "user_failing_hook" in records[0]["message"]
    assert records[0]["from_step"] == fail_step
    assert "budget is spent" in records[1]["why"] and records[2]["outcome"] == "failed"
    assert "elasjax launch: failed: " in stdout and "budget is spent" in stdout
    log = (out / "attempt0" / "worker0.log").read_text()
    assert "user_failing_hook: process 0 fails after step 2" in log
    # the restarted attempt resumed and failed at the hook again: a failure the budget does not
    # cover, which is what this test is about
    last = (out / "worker0.log").read_text()
    assert "user_failing_hook: process 0 fails after step 2" in _last_error_line(last), last[-2000:]


def _last_error_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if "training stopped" in ln]
    return lines[-1][:300] if lines else "(no error line)"
