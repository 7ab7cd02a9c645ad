"""A user's own loop (examples/own_loop.py) under `elasjax launch SCRIPT.py`: real SIGKILLs of
any process, process 0 included, survived in place by `ElasticState` (docs/api.md, "Your own
loop under launch"); and the bad uses refused by name."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import elasjax

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "own_loop.py"


def _launch(tmp_path, name, *flags, script=SCRIPT, args=()):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "elasjax.cli", "launch", str(script), "--processes", "4",
           "--devices-per-process", "2", "--out", str(tmp_path / name), *flags,
           "--", "--out", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ))
    return r, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow
def test_a_users_loop_survives_sigkills_of_any_process_with_the_fault_free_computation(tmp_path):
    r, clean = _launch(tmp_path, "clean")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert clean["recoveries"] == [] and clean["mesh"] == {"data": 4, "model": 2}
    for name, kills, died, meshes, args in [
        # the step compiled before step 0 for every likely failure's mesh, loaded onto the
        # renewed client's devices at the recovery (a load, not a compile)
        ("standby", ["--kill", "6:1"], [[1]], [{"data": 3, "model": 2}], ("--standby",)),
        # without it the redone step compiles for the new mesh; process 0 dies first
        ("two", ["--kill", "3:0", "--kill", "8:2"], [[0], [2]],
         [{"data": 3, "model": 2}, {"data": 2, "model": 2}], ()),
    ]:
        r, run = _launch(tmp_path, name, *kills, args=args)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "finished the run" in r.stdout
        if args:  # each shape's step compiled once in the job, loaded by the other processes
            logs = "".join(p.read_text() for p in (tmp_path / name).glob("worker*.log"))
            shapes = re.findall(r"compiled the step for (.+?) in [\d.]+s and published", logs)
            assert len(shapes) == len(set(shapes)) >= 2, shapes
            assert "data 4 x model 2" in shapes and "loaded the step for" in logs
        recs = run["recoveries"]
        assert [x["failed_processes"] for x in recs] == died
        assert [x["to_mesh"] for x in recs] == meshes
        # the state committed before the killed step, rebuilt from live copies and verified;
        # the killed step redone on it
        assert [x["step"] for x in recs] == [int(k.split(":")[0]) - 1 for k in kills[1::2]]
        for x in recs:
            assert x["verified"] and x["attempts"] == 1 and x["rung"] in ("replica", "buddy")
            assert x["failure_simulation"].startswith("real")
            assert x["detect_s"] < 5 and x["first_step_s"] is not None
            assert x["standby_hit"] is (True if args else None)
        # every step once, on the fault-free run's batch and random numbers: the losses agree
        # to float rounding (a smaller data degree sums in another order)
        assert run["losses"].keys() == clean["losses"].keys()
        dev = max(abs(run["losses"][k] - v) / abs(v) for k, v in clean["losses"].items())
        assert dev < 1e-5, dev


@pytest.mark.slow
def test_a_kill_the_script_never_reaches_and_a_script_that_never_commits_are_refused(tmp_path):
    r, _ = _launch(tmp_path, "past", "--kill", "40:1", args=("--steps", "3"))
    assert r.returncode == 1
    assert "--kill 40:[1] never happened: the script's last commit was step 2" in r.stdout
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import sys\nprint('no loop here', sys.argv[1:])\n")
    r, _ = _launch(tmp_path, "lazy", "--kill", "2:1", script=lazy)
    assert r.returncode == 1
    assert "the script never committed a step" in r.stdout


def test_a_launch_of_a_script_refuses_what_only_the_loop_takes(tmp_path, capsys):
    from elasjax.cli import main

    code = main(["launch", str(SCRIPT), "--processes", "2", "--set", "train.steps=3"])
    assert code == 2
    assert "--set apply to elasjax's own loop" in capsys.readouterr().err
    code = main(["launch", str(SCRIPT), "--processes", "2", "--kill", "3:2"])
    assert code == 2
    assert "process 2 does not exist; allowed processes: 0 .. 1" in capsys.readouterr().err
    code = main(["launch", str(SCRIPT), "--processes", "2", "--kill", "3:1:verify"])
    assert code == 2
    assert "no kill at step 3 starts a recovery for it" in capsys.readouterr().err
    code = main(["launch", str(tmp_path / "nope.py"), "--processes", "2"])
    assert code == 2
    assert "is not a Python file here" in capsys.readouterr().err


def test_elastic_state_refuses_a_distributed_job_elasjax_did_not_start(monkeypatch):
    state = {"w": jnp.ones((8, 4))}
    mesh, _ = elasjax.plan_mesh(jax.devices(), {"data": -1})
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"elasjax launch my_train.py --processes P"):
        elasjax.ElasticState(state, lambda m: {"w": NamedSharding(m, P())}, mesh)


def _tiny(devices_per_host=2):
    state = {"w": jnp.arange(96, dtype=jnp.float32).reshape(24, 4)}
    mesh, _ = elasjax.plan_mesh(jax.devices(), {"data": -1})
    es = elasjax.ElasticState(state, lambda m: {"w": NamedSharding(m, P("data"))}, mesh,
                              devices_per_host=devices_per_host)
    step = jax.jit(lambda s: {"w": s["w"] * 2.0 + 1.0})
    return es, step


def test_the_steps_of_one_process_commit_in_their_block_and_resume_after_a_recovery():
    es, step = _tiny()
    seen = []
    for s in es.steps(6):
        with s:
            if s.n == 3 and not es.recoveries:
                es.simulate_failure([2, 3])  # a host fails between steps 2 and 3
                es.recover()
            es.commit(step(es.state), s.n)
        seen.append((s.n, dict(es.mesh.shape)["data"]))
    assert seen == [(0, 8), (1, 8), (2, 8), (3, 6), (4, 6), (5, 6)]
    want = np.arange(96, dtype=np.float32).reshape(24, 4)
    for _ in range(6):
        want = want * 2 + 1
    np.testing.assert_array_equal(np.asarray(es.state["w"]), want)
    assert es.step == 5 and es.recovery.first_step_s is not None
    assert es.recovery.failure_simulation.startswith("simulated")


def test_a_step_block_that_does_not_commit_its_step_is_an_error():
    es, step = _tiny()
    with pytest.raises(RuntimeError, match=r"step 0: its block ended without `es.commit"):
        for s in es.steps(2):
            with s:
                step(es.state)
    es, step = _tiny()
    with pytest.raises(ValueError, match=r"commit: step 5 inside the block of step 0"):
        for s in es.steps(2):
            with s:
                es.commit(step(es.state), 5)
    assert es.step == -1  # nothing was committed


@pytest.mark.slow
def test_a_script_joins_a_clusters_job_one_process_per_command(tmp_path):
    """`elasjax launch SCRIPT.py --coordinator HOST:PORT --num-processes 2 --process-id I`, as a
    cluster's scheduler would start it on each host (the coordination process started apart):
    process 1 is SIGKILLed after committing step 4 and process 0 trains on alone."""
    import signal
    import socket

    from elasjax.launch.local import _stop_coordinator
    from elasjax.runtime import coordinator

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    coord = coordinator.start_local(port, 2, 30, tmp_path / "coordinator.log", env=env)
    out = tmp_path / "cluster.json"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "elasjax.cli", "launch", str(SCRIPT), "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         "--devices-per-process", "4", "--kill", "4:1", "--", "--steps", "8", "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        _stop_coordinator(coord)
    assert [p.returncode for p in procs] == [0, -signal.SIGKILL], "\n".join(o[-2000:] for o in outs)
    run = json.loads(out.read_text())
    (rec,) = run["recoveries"]
    assert rec["failed_processes"] == [1] and rec["step"] == 3 and rec["verified"]
    assert rec["to_mesh"] == {"data": 2, "model": 2} and sorted(run["losses"]) == [
        str(i) for i in range(8)]


@pytest.mark.slow
def test_a_death_during_the_recovery_starts_another_attempt_or_is_refused_by_name(tmp_path):
    """`--kill 6:1` and, as that recovery's transfer begins, `--kill 6:3:transfer`: the second
    attempt plans over what is left and the state verifies (process 1's ZeRO partitions from
    their buddy copies on process 2). With `6:2:transfer` those copies die too: the recovery
    raises, naming the lost slice, and nothing trains on; with checkpoints (the example's
    `--checkpoint`, every 2 steps), the survivors restore the newest one instead, verified
    against its checksums, and redo the steps since."""
    r, run = _launch(tmp_path, "twice", "--kill", "6:1", "--kill", "6:3:transfer")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (rec,) = run["recoveries"]
    assert rec["attempts"] == 2 and rec["failed_processes"] == [1, 3] and rec["verified"]
    assert rec["step"] == 5 and rec["to_mesh"] == {"data": 2, "model": 2}
    assert sorted(run["losses"], key=int) == [str(i) for i in range(12)]
    twice = run["losses"]
    r, run = _launch(tmp_path, "lost", "--kill", "6:1", "--kill", "6:2:transfer")
    assert r.returncode == 1 and run is None
    assert "UnrecoverableStateError: state leaf 'opt/" in r.stdout
    assert "has no live copy" in r.stdout
    r, run = _launch(tmp_path, "ckpt", "--kill", "6:1", "--kill", "6:2:transfer",
                     args=("--checkpoint", str(tmp_path / "ck")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (rec,) = run["recoveries"]
    assert rec["rung"] == "checkpoint" and rec["verified"] and rec["failed_processes"] == [1, 2]
    assert rec["step"] in (2, 4) and rec["to_mesh"] == {"data": 2, "model": 2}
    assert sorted(run["losses"], key=int) == [str(i) for i in range(12)]
    dev = max(abs(run["losses"][k] - v) / abs(v) for k, v in twice.items())
    assert dev < 2e-5, dev  # both within 1e-5 of the fault-free run


@pytest.mark.slow
def test_a_restarted_process_rejoins_a_users_loop_and_the_job_grows_back(tmp_path):
    """`--kill 3:1 --worker-restarts 1`: process 1 dies after committing step 3; the launcher
    starts it again; it runs the script from its start, is admitted at a step's start, and the
    job grows back onto its devices (the state moved onto the grown mesh and verified), every
    step once. The state holds a typed PRNG key (the example's dropout key), which the newcomer
    receives as any leaf (its empty view made from the key's data: `shards.held_elsewhere`).
    Checkpoints every 2 steps go on over the survivors, then over the grown job, the newcomer
    included (it opens them with the others, its Orbax operations counted as theirs:
    `checkpoint._agree_operation_ids`; before, the first save after the admission hung)."""
    # steps paced while the job is short of process 1 (up to 38 s): the restarted process
    # starts (imports, its own init) within the run even on a loaded machine
    r, run = _launch(tmp_path, "rejoin", "--kill", "3:1", "--worker-restarts", "1",
                     "--restart-backoff", "0.5",
                     args=("--steps", "80", "--pace", "0.5", "--checkpoint", str(tmp_path / "ck")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "p1=SIGKILL" in r.stdout and "p1=0" in r.stdout  # killed, then ended well
    (rec,) = run["recoveries"]
    assert rec["step"] == 2 and rec["to_mesh"] == {"data": 3, "model": 2}
    (join,) = run["joins"]
    # admitted at a step's start after the recovery: the step after it at the earliest
    assert join["processes"] == [1] and join["verified"] and join["step"] > rec["step"], join
    assert join["to_mesh"] == run["mesh"] == {"data": 4, "model": 2}
    assert sorted(run["losses"], key=int) == [str(i) for i in range(80)]
    assert run["key_dtype"] == "key<fry>"
    saved = sorted(int(p.name) for p in (tmp_path / "ck").iterdir() if p.name.isdigit())
    assert saved == [76, 78], saved  # the last two (keep 2), saved by the grown job
    log = (tmp_path / "rejoin" / "worker1.r1.log").read_text()
    assert f"admitted process(es) [1] at step {join['step']}" in log
    assert "done: the script returned" in log


@pytest.mark.slow
def test_a_death_during_an_admission_is_recovered_from_the_state_before_it(tmp_path):
    """`--kill 3:1 --worker-restarts 1 --kill 4:2:admission`: process 1 dies after step 3 and is
    started again; as its admission moves the state, process 2 dies. The admission fails on
    every process (its guards are the job's); the newcomer, which holds nothing yet, leaves
    (exit 1); the survivors recover the state committed before the admission from live copies,
    the newcomer's exit folded into that recovery, and train on: every step once, with the
    losses of the script run alone."""
    # paced until the admission's failure (up to 98 s; the steps after it are not paced): the
    # restarted process arrives within the run even on a loaded machine, or the admission kill
    # never fires (40 steps were too few in CI, 80 beside other launches)
    r, run = _launch(tmp_path, "admission", "--kill", "3:1", "--kill", "4:2:admission",
                     "--worker-restarts", "1", "--restart-backoff", "0.5",
                     args=("--steps", "200", "--pace", "0.5"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "p1=SIGKILL" in r.stdout and "p2=SIGKILL" in r.stdout and "p1=1" in r.stdout
    first, second = run["recoveries"]
    assert first["step"] == 2 and first["failed_processes"] == [1]
    assert second["failed_processes"] == [1, 2] and second["verified"], second
    assert second["step"] > first["step"] and second["to_mesh"] == {"data": 2, "model": 2}
    assert run["joins"] == [] and run["mesh"] == {"data": 2, "model": 2}
    assert sorted(run["losses"], key=int) == [str(i) for i in range(200)]
    log = (tmp_path / "admission" / "worker1.r1.log").read_text()
    assert "a failure interrupted this process's admission" in log
    alone = tmp_path / "alone.json"
    subprocess.run([sys.executable, str(SCRIPT), "--steps", "200", "--out", str(alone)],
                   check=True, capture_output=True, timeout=300, cwd=ROOT, env=dict(os.environ))
    ref = json.loads(alone.read_text())["losses"]
    dev = max(abs(run["losses"][k] - v) / abs(v) for k, v in ref.items())
    assert dev < 1e-5, dev


def test_an_admission_kill_needs_a_restarted_process_to_admit():
    from elasjax.config import ConfigError
    from elasjax.launch.process import KillSpec, resolve_config
    from elasjax.launch.script import kills_by_step

    spec = KillSpec.parse("4:2:admission")
    assert (spec.phase, str(spec)) == ("admission", "4:2:admission")
    with pytest.raises(ValueError, match="no kill at or before step 4 makes a process to restart"):
        kills_by_step([spec, KillSpec.parse("5:1")], 4)
    assert kills_by_step([KillSpec.parse("3:1"), spec], 4) == {
        3: {"step": (1,)}, 4: {"admission": (2,)}}
    # a config's loop: the same phase in its fault schedule, with restarts and a kill before
    cfg = elasjax.config.load("configs/multiprocess.yaml", ["recovery.worker_restarts=1"])
    got = resolve_config(cfg, 4, 2, [KillSpec.parse("3:1"), spec])
    assert [(f.at_step, f.kill_process, f.phase) for f in got.faults] == [
        (3, 1, "step"), (4, 2, "admission")]
    for bad_cfg, kills in ((elasjax.config.load("configs/multiprocess.yaml", []), ["3:1"]),
                           (cfg, ["5:1"])):
        with pytest.raises(ConfigError, match="'admission' needs a restarted process to admit"):
            resolve_config(bad_cfg, 4, 2, [*map(KillSpec.parse, kills), spec])
    with pytest.raises(ConfigError, match="'admission' kills a process as an admission moves"):
        elasjax.config.load(None, ["faults=[{at_step: 3, hosts: [1], phase: admission}]"])
    with pytest.raises(ConfigError, match="or admission: as the first admission"):
        KillSpec.parse("4:2:admit")
    # an admission kill that never fired is reported by its victim, a process of the job's start
    from types import SimpleNamespace

    from elasjax.runtime.job import ScriptJob

    job = ScriptJob(None, kills_by_step([KillSpec.parse("3:1"), spec], 4))
    assert job.unmet_admission_kills(SimpleNamespace(me=2, admission=None)) == [4]
    assert job.unmet_admission_kills(SimpleNamespace(me=1, admission=None)) == []
    assert job.unmet_admission_kills(SimpleNamespace(me=2, admission=object())) == []
