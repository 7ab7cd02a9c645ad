"""Every move of the loop's state ends in a verification that a test can see fail.

A recovery, a cut-over (an async migration, a growth) and an admission under `elasjax launch`
each rebuild the state on other devices and compare its checksums with those of the state it
came from before anything trains on it (`recovery.protect_moved` -> `transfer.verified.
verify_and_protect` -> `checksum.verify`). Here one element of one leaf of the moved state is
changed after the move and before that comparison (tests/user_corrupt_move.py wraps the function
that returns the moved state), and each test asserts:

- `StateMismatchError` naming that leaf (and only it) is raised: the run is refused;
- nothing trained on the bad state: `metrics.jsonl` has no step at or after the move's step;
- the refused move left no event (`recovery`, `migration`, `growth`); the `error` event names
  the leaf.

Switching the check off (`checksum.verify` returning without comparing, or the call removed
from `protect_moved`) makes every one of these tests fail: the run then goes on.
"""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import PIPE, deaths, tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import user_corrupt_move
from elasjax import StateMismatchError
from elasjax.loop import trainer
from elasjax.observe.metrics import read_jsonl
from elasjax.transfer import checksum
from elasjax.transfer.verified import verify_and_protect

ROOT = Path(__file__).resolve().parents[1]
LEAF = user_corrupt_move.LEAF


def _assert_refused(err: str, out: Path, seen: list, what: str, no_event: str) -> None:
    """The move at `seen`'s one step was refused with `what`'s StateMismatchError naming
    `LEAF`, nothing trained after it, and no `no_event` event exists for it."""
    (step, leaf), = seen  # exactly one move was corrupted
    assert f"{what}: 1 leaves differ from " in err and f"['{leaf}']" in err, err
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(step)), step  # every step before it only
    events = read_jsonl(out / "events.jsonl")
    assert events[-1]["type"] == "error" and events[-1]["error"] == "StateMismatchError", events[-1]
    assert f"['{leaf}']" in events[-1]["message"]
    assert not [e for e in events if e["type"] == no_event and e.get("step") == step], events


def test_a_verified_move_records_what_it_compared():
    """`verify_and_protect` reports the comparison it made (the events' `verify`): as many
    leaves as checksums, the bytes of every leaf, the digests of both sides; one element changed
    raises `StateMismatchError` naming its leaf."""

    class Pool:
        def fresh(self):
            return self

        def take(self, state, step):
            pass

    mesh = jax.make_mesh((8,), ("data",))
    sh = NamedSharding(mesh, P("data"))
    state = {"a": jax.device_put(jnp.arange(64, dtype=jnp.float32), sh),
             "b": jnp.ones((3, 5), jnp.bfloat16), "k": jax.random.key(0)}

    def sums(s):
        return checksum.to_host(checksum.tree_checksums(s))

    good = sums(state)
    done = verify_and_protect(state, checksums=sums, expected=good, what="moved", against="it",
                              pool=Pool(), configure=lambda p: None, step=0)
    c = done.compared
    assert (c.leaves, c.bytes) == (3, 64 * 4 + 15 * 2 + 2 * 4)  # a key is two uint32 words
    assert c.digest_before == c.digest_after == checksum.digest(good) and c.verified
    assert c.as_dict() == {"leaves": 3, "bytes": 294, "digest_before": c.digest_before,
                           "digest_after": c.digest_after}
    bad = user_corrupt_move.flip_one({"params": {"embed": {"embedding": state["a"]}}})
    state_bad = {**state, "a": bad["params"]["embed"]["embedding"]}
    with pytest.raises(StateMismatchError, match=r"moved: 1 leaves differ from it, e\.g\. \['a'\]"):
        verify_and_protect(state_bad, checksums=sums, expected=good, what="moved", against="it",
                           pool=Pool(), configure=lambda p: None, step=0)


def test_a_corrupted_recovery_is_refused_naming_the_leaf(exe_cache, tmp_path, monkeypatch):
    """Device 3 fails in step 3; the state rebuilt on the 7 survivors has one element changed:
    the recovery raises instead of resuming."""
    seen = user_corrupt_move.install("recovery", monkeypatch.setattr)
    cfg = tiny_config("train.steps=6", "faults=[{at_step: 3, devices: [3]}]")
    with pytest.raises(StateMismatchError) as e:
        trainer.run(cfg, tmp_path, exe_cache=exe_cache)
    assert seen == [(3, LEAF)]
    _assert_refused(str(e.value), tmp_path, seen, "recovered state", "recovery")
    assert not [x for x in read_jsonl(tmp_path / "events.jsonl") if x["type"] == "recovery"]


@pytest.mark.slow
def test_a_corrupted_migration_cut_over_is_refused_naming_the_leaf(exe_cache, tmp_path,
                                                                   monkeypatch):
    """A pipeline resumes on its fast path after device 3 fails in step 3
    (`recovery.migration=async`) and cuts over to the optimal plan once it is compiled (at most
    one step later); the cut-over's moved state has one element changed: it raises instead of
    training on the optimal plan. The recovery before it is recorded, with its comparison."""
    seen = user_corrupt_move.install("cutover", monkeypatch.setattr)
    cfg = tiny_config(*PIPE, "train.steps=7", "faults=[{at_step: 3, devices: [3]}]",
                      "recovery.migration=async", "recovery.max_fast_path_steps=1")
    with pytest.raises(StateMismatchError) as e:
        trainer.run(cfg, tmp_path, exe_cache=exe_cache)
    _assert_refused(str(e.value), tmp_path, seen, "cut-over", "migration")
    events = read_jsonl(tmp_path / "events.jsonl")
    (rec,) = [x for x in events if x["type"] == "recovery"]
    assert rec["migration"] == "async" and seen[0][0] in (4, 5)
    v = rec["verify"]
    assert v["leaves"] > 0 and v["bytes"] > 0 and v["digest_before"] == v["digest_after"]
    assert not [x for x in events if x["type"] == "migration"]


def test_a_corrupted_growth_is_refused_naming_the_leaf(exe_cache, tmp_path, monkeypatch):
    """Device 3 fails in step 2 and returns before step 4 (`join`); the growth back onto 8
    devices (a plan the run stood on, compiled: at once) moves a state with one element
    changed: it raises instead of training on 8 devices."""
    seen = user_corrupt_move.install("cutover", monkeypatch.setattr)
    cfg = tiny_config("train.steps=6", "recovery.max_fast_path_steps=1",
                      "faults=[{at_step: 2, devices: [3]}, {at_step: 4, join: {devices: [3]}}]")
    with pytest.raises(StateMismatchError) as e:
        trainer.run(cfg, tmp_path, exe_cache=exe_cache)
    _assert_refused(str(e.value), tmp_path, seen, "cut-over", "growth")
    events = read_jsonl(tmp_path / "events.jsonl")
    (join,) = [x for x in events if x["type"] == "join"]
    assert join["grow"] and seen[0][0] >= join["step"] == 4
    assert not [x for x in events if x["type"] == "growth"]


@pytest.mark.slow
@pytest.mark.parametrize("move", ["recovery", "admission"])
def test_a_corrupted_move_under_launch_stops_every_process_naming_the_leaf(move, tmp_path):
    """Under `elasjax launch` (real processes, SIGKILL): every worker imports
    tests/user_corrupt_move.py with ELASJAX_TEST_CORRUPT_MOVE set, which changes one element of
    the moved state on the processes that hold it. `recovery`: process 2 of 4 is killed in step
    4 and the survivors' rebuilt state is changed. `admission`: process 0 of 2 is killed in
    step 4 and restarted; the state the survivor moves onto the new client when it admits it is
    changed. Each process raises `StateMismatchError` naming the leaf, the launch exits non-zero,
    and no step after the move is recorded."""
    from test_multiprocess import REJOIN, REJOIN_STEPS, _launch

    out = tmp_path / move
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
           "ELASJAX_TEST_CORRUPT_MOVE": move}
    if move == "recovery":
        args = ("--processes", "4", "--devices-per-process", "2", "--kill", "4:2")
        sets, logs, what = (), ["worker0", "worker1", "worker3"], "recovered state"
    else:
        args = ("--processes", "2", "--devices-per-process", "2", "--kill", "4:0",
                "--worker-restarts", "1", "--restart-backoff", "0.5")
        # the survivor and the restarted process (its second incarnation's log)
        sets, logs, what = (f"train.steps={REJOIN_STEPS}", *REJOIN), ["worker1", "worker0.r1"], (
            "admission")
    rc, stdout = _launch(out, *args, "--import", "user_corrupt_move", sets=sets, env=env,
                         timeout=480)
    assert rc != 0, stdout
    summary = json.loads((out / "launch.json").read_text())
    assert summary["outcome"] == "failed" and "StateMismatchError" in summary["message"]
    assert f"{what}: 1 leaves differ" in summary["message"] and LEAF in summary["message"]
    steps = set()
    for name in logs:
        log = (out / f"{name}.log").read_text()
        found = [ln for ln in log.splitlines() if ln.startswith(f"CORRUPTED {move} at step ")]
        assert found, log[-3000:]
        steps |= {int(ln.split(" at step ")[1].split(":")[0]) for ln in found}
        assert "StateMismatchError" in log and f"{what}: 1 leaves differ" in log, log[-3000:]
        assert f"['{LEAF}']" in log, log[-3000:]
    (step,) = steps  # one move, at one step on every process
    if move == "recovery":
        assert step == 4
    metrics = read_jsonl(out / "metrics.jsonl")
    assert metrics and all(r["step"] < step for r in metrics), (step, metrics)
    events = read_jsonl(out / "events.jsonl")
    err = [e for e in events if e["type"] == "error"]
    assert err and err[0]["error"] == "StateMismatchError" and LEAF in err[0]["message"], events
    if move == "recovery":  # the killed process's recovery is the refused move
        assert not deaths(events), events
    else:  # the kill's recovery went through; the admission's `join` never came
        (rec,) = deaths(events)
        v = rec["verify"]
        assert v["leaves"] > 0 and v["bytes"] > 0 and v["digest_before"] == v["digest_after"]
        assert not [e for e in events if e["type"] == "join"], events
