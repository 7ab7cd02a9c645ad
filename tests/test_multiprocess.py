"""Real process failures on JAX's multi-controller runtime (`elasjax launch`).

Unit tests cover the pure transfer plan, the snapshot placement and the rebuild itself in this
process. The slow tests start real `jax.distributed` jobs (gloo collectives on CPU) and SIGKILL
one of their processes:

- 4 processes x 2 devices, process 2 killed at step 4: the survivors finish; every step is
  logged exactly once; per-step losses equal the single-process fault-free run within relative
  1e-5 (f32, the reduction order differs between meshes; measured <= 1e-7); the recovery event
  carries kill -> `ProcessFailureError` and the MTTR breakdown.
- 4 processes x 1 device with tensor = 4 (each process holds a slice nobody else holds):
  killing process 1 is survived through process 2's host snapshot of its slice, and the
  survivors exchange the other slices across processes.
- Killing process 0 (the coordination service) ends every process with a clear message.

Bounded: each job runs under the launcher's own timeout, inside a subprocess timeout; workers
die with the launcher (PR_SET_PDEATHSIG) and `finally` SIGKILLs any worker pid still alive.
Workers run with `JAX_DISABLE_MOST_OPTIMIZATIONS=1` to halve compile time on 2 cores.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TINY, tiny_config
from jax.sharding import NamedSharding, PartitionSpec

from elasjax import trainer
from elasjax.config import ConfigError
from elasjax.distributed import (
    LeafLayout,
    Membership,
    RuntimeConfig,
    SnapshotCorruptError,
    SnapshotPool,
    execute_rebuild,
    layouts,
    local_shards,
    plan_rebuild,
    unique_shards,
    xla_flags,
)
from elasjax.launch import MTTR_PHASES, KillSpec, kill_schedule
from elasjax.metrics import read_jsonl
from elasjax.reshard import UnrecoverableStateError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multiprocess.yaml"
LOSS_RTOL = 1e-5
STEPS = 12  # the same run as test_trainer's reference, so the compiled plan is shared
COLLECTIVE_TIMEOUT_S = 5
HEARTBEAT_TIMEOUT_S = 5
RECOVERY_FIELDS = {
    "type",
    "step",
    "failed_devices",
    "from_plan",
    "to_plan",
    "rung",
    "bytes_moved",
    "transfers",
    "detect_s",
    "plan_s",
    "compile_s",
    "standby_hit",
    "transfer_s",
    "verify_s",
    "first_step_s",
    "mttr_s",
    "verified",
    "kill_to_error_s",
    "detect_per_process_s",
    "failed_processes",
}


# ---------------------------------------------------------------------------------------------
# Pure parts.


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def _member(n_proc: int, k: int) -> Membership:
    return Membership.of([FakeDevice(p * 100 + i, p) for p in range(n_proc) for i in range(k)])


def _tensor_layout(ids, data: int, tensor: int, shape=(8, 4), path="w") -> LeafLayout:
    """A [8, 4] leaf split over `tensor` along its last axis, replicated over `data`."""
    cols = shape[1] // tensor
    boxes = {
        dev: ((0, shape[0]), ((j % tensor) * cols, (j % tensor + 1) * cols))
        for j, dev in enumerate(ids[: data * tensor])
    }
    return LeafLayout(path, shape, np.float32, boxes)


def test_kill_spec_and_schedule_are_checked():
    cfg = tiny_config("train.steps=12", "faults=[]")
    assert KillSpec.parse("4:2") == KillSpec(4, 2)
    with pytest.raises(ConfigError, match="STEP:PROCESS"):
        KillSpec.parse("4-2")
    assert kill_schedule(cfg, [KillSpec(4, 2), KillSpec(2, 1)], 4) == (
        KillSpec(2, 1),
        KillSpec(4, 2),
    )
    with pytest.raises(ConfigError, match="outside the run"):
        kill_schedule(cfg, [KillSpec(12, 1)], 4)
    with pytest.raises(ConfigError, match="does not exist"):
        kill_schedule(cfg, [KillSpec(3, 4)], 4)
    with pytest.raises(ConfigError, match="killed twice"):
        kill_schedule(cfg, [KillSpec(3, 1), KillSpec(5, 1)], 4)
    with pytest.raises(ConfigError, match="every process"):
        kill_schedule(cfg, [KillSpec(3, 0), KillSpec(5, 1)], 2)
    faulted = tiny_config("train.steps=12", "faults=[{at_step: 3, devices: [1]}]")
    with pytest.raises(ConfigError, match=r"faults\[0\].*--kill STEP:PROCESS"):
        kill_schedule(faulted, [], 4)


def test_xla_flags_replace_device_count_and_timeout():
    rc = RuntimeConfig("127.0.0.1:1234", 4, 1, collective_timeout_s=7)
    flags = xla_flags(
        rc,
        "--xla_force_host_platform_device_count=8 --xla_foo=1 "
        "--xla_cpu_collective_timeout_seconds=99",
    )
    assert flags.split() == ["--xla_foo=1", "--xla_cpu_collective_timeout_seconds=7"]
    with pytest.raises(ValueError, match="process_id"):
        RuntimeConfig("127.0.0.1:1234", 4, 4)
    with pytest.raises(ValueError, match="HOST:PORT"):
        RuntimeConfig("localhost", 4, 0)


def test_rebuild_plan_reads_replicas_in_the_same_process():
    """4 processes x 2 devices, d4t2; process 2 dies; d3t2 and d6t1 on the survivors."""
    m = _member(4, 2)
    old = _tensor_layout(m.ids, data=4, tensor=2)
    live = m.without({200, 201})
    for data, tensor in ((3, 2), (6, 1)):
        new = _tensor_layout(live.ids, data, tensor)
        pieces = plan_rebuild([old], [new], live.process_of())
        assert {p.rung for p in pieces} == {"replica"}
        assert not any(p.remote for p in pieces)  # every survivor holds a full replica
        assert not {p.src for p in pieces} & {200, 201}
        covered = sum(p.nbytes for p in pieces)
        assert covered == sum(
            int(np.prod([b - a for a, b in box])) * 4 for box in new.boxes.values()
        )


def test_rebuild_plan_falls_back_to_the_host_snapshot_or_refuses():
    """2 processes x 2 devices, d1t4: half of every tensor-sharded leaf lives in one process."""
    m = _member(2, 2)
    old = _tensor_layout(m.ids, data=1, tensor=4)
    uniq = unique_shards([old], m)
    assert [box for _, box, _ in uniq[1]] == [((0, 8), (2, 3)), ((0, 8), (3, 4))]
    assert m.successor(1) == 0 and m.predecessor(0) == 1  # process 0 holds process 1's copy
    live = m.without({100, 101})
    new = _tensor_layout(live.ids, data=2, tensor=1)
    with pytest.raises(UnrecoverableStateError, match=r"'w' slice \[0:8, 2:4\] has no live copy"):
        plan_rebuild([old], [new], live.process_of())
    pool = SnapshotPool(5, m, uniq)
    pieces = plan_rebuild([old], [new], live.process_of(), pool.holdings(live.processes))
    rungs = {(p.cell[1], p.rung) for p in pieces}
    assert rungs == {((0, 1), "replica"), ((1, 2), "replica"), ((2, 3), "host"), ((3, 4), "host")}
    assert not any(p.remote for p in pieces)


def test_rebuild_plan_sends_to_a_process_that_holds_nothing():
    """The growth path (a process joining, GPU only): its devices are filled from others."""
    m = _member(3, 2)
    old = _tensor_layout(m.ids[:4], data=2, tensor=2)
    new = _tensor_layout(m.ids, data=3, tensor=2)
    pieces = plan_rebuild([old], [new], m.process_of())
    to_new = [p for p in pieces if p.dst_process == 2]
    assert to_new and all(p.remote and p.rung == "replica" for p in to_new)


def test_execute_rebuild_on_local_devices_with_a_host_snapshot():
    """In one process (8 fake devices, all process 0): rebuild a d1t4 leaf after "losing" two
    devices, from the survivors and a host copy of the lost slices; a corrupted copy is refused."""
    devs = jax.devices()[:4]
    mesh = jax.make_mesh((1, 4), ("data", "tensor"), devices=devs)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    arr = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "tensor")))
    tree = {"w": arr}
    old = layouts(tree, {"w": arr.sharding})
    member = Membership.of(devs)
    dead = {devs[2].id, devs[3].id}
    live = member.without(dead)
    new_mesh = jax.make_mesh((2, 1), ("data", "tensor"), devices=list(live.devices))
    target = {"w": NamedSharding(new_mesh, PartitionSpec(None, "tensor"))}
    new = layouts(tree, target)
    pool = SnapshotPool(7, member, {0: [], 1: []})
    for dev in sorted(dead):
        box = old[0].boxes[dev]
        host = x[:, box[1][0] : box[1][1]].copy()
        pool.held[(0, box)] = (host, zlib.crc32(host.tobytes()))
    snaps = {0: [(0, old[0].boxes[d]) for d in sorted(dead)]}
    pieces = plan_rebuild(old, new, live.process_of(), snaps)
    local = [{d: a for d, a in local_shards(tree)[0].items() if d not in dead}]
    treedef = jax.tree_util.tree_structure(tree)
    out, log = execute_rebuild(pieces, old, local, pool, 7, target, treedef, live.by_id(), None)
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    assert out["w"].sharding == target["w"]
    assert log.rungs() == {"replica", "host"}
    assert not {t.src for t in log.entries} & dead
    with pytest.raises(SnapshotCorruptError, match="step 7, restoring step 8"):
        execute_rebuild(pieces, old, local, pool, 8, target, treedef, live.by_id(), None)
    arr_, crc = pool.held[(0, old[0].boxes[max(dead)])]
    pool.held[(0, old[0].boxes[max(dead)])] = (arr_ + 1, crc)
    with pytest.raises(SnapshotCorruptError, match="fails its checksum"):
        execute_rebuild(pieces, old, local, pool, 7, target, treedef, live.by_id(), None)


# ---------------------------------------------------------------------------------------------
# Real multi-process jobs.


@pytest.fixture(scope="module")
def reference(exe_cache):
    """The single-process fault-free run (8 fake devices in this process)."""
    return trainer.run(tiny_config(f"train.steps={STEPS}", "faults=[]"), None, exe_cache=exe_cache)


def _sets(*extra: str) -> list[str]:
    out = []
    for o in (*TINY, f"train.steps={STEPS}", "faults=[]", *extra):
        out += ["--set", o]
    return out


def _kill_workers(out: Path) -> None:
    """SIGKILL any worker of this launch still alive (pids the launcher recorded)."""
    try:
        pids = json.loads((out / "pids.json").read_text())["workers"]
    except (OSError, ValueError, KeyError):
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _launch(out: Path, *args: str, sets=(), timeout: int = 240) -> tuple[int, str]:
    cmd = [
        sys.executable,
        "-m",
        "elasjax.cli",
        "launch",
        str(CONFIG),
        *_sets(*sets),
        "--out",
        str(out),
        "--timeout",
        str(timeout - 30),
        "--collective-timeout",
        str(COLLECTIVE_TIMEOUT_S),
        "--heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT_S),
        *args,
    ]
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        stdout, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, _ = p.communicate()
        pytest.fail(f"launch did not end within {timeout}s:\n{stdout}")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        _kill_workers(out)
    return p.returncode, stdout


def _assert_matches_reference(metrics: list[dict], ref) -> None:
    assert [r["step"] for r in metrics] == list(range(STEPS)), "a step was lost or repeated"
    for r in metrics:
        s = r["step"]
        assert r["batch_digest"] == ref.sample_digests[s], f"different samples at step {s}"
        rel = abs(r["loss"] - ref.losses[s]) / ref.losses[s]
        assert rel <= LOSS_RTOL, f"step {s}: loss {r['loss']} vs {ref.losses[s]} (rel {rel:.2e})"


def _worker_ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_sigkill_one_of_four_processes_survivors_match_fault_free(reference, tmp_path):
    out = tmp_path / "mp"
    rc, stdout = _launch(out, "--processes", "4", "--devices-per-process", "2", "--kill", "4:2")
    assert rc == 0, stdout
    summary = json.loads((out / "launch.json").read_text())
    assert summary["outcome"] == "finished"
    ends = {s["process"]: (s["signal"] or s["returncode"]) for s in summary["processes"]}
    assert ends == {0: 0, 1: 0, 2: "SIGKILL", 3: 0}
    assert all(_worker_ended(s["pid"]) for s in summary["processes"])
    metrics = read_jsonl(out / "metrics.jsonl")
    _assert_matches_reference(metrics, reference)
    assert [r["n_devices"] for r in metrics] == [8] * 4 + [6] * (STEPS - 4)
    assert [r["n_processes"] for r in metrics] == [4] * 4 + [3] * (STEPS - 4)
    events = read_jsonl(out / "events.jsonl")
    (ev,) = [e for e in events if e["type"] == "recovery"]
    assert RECOVERY_FIELDS <= set(ev)
    assert ev["step"] == 4 and ev["failed_processes"] == [2] and ev["verified"]
    assert ev["rung"] == "replica" and ev["bytes_cross_process"] == 0  # each survivor has a replica
    assert ev["from_plan"].startswith("d4t2") and ev["to_plan"] == metrics[-1]["plan"]
    # Detection: the survivors' collective fails after the timeout at the latest.
    assert 0 < ev["kill_to_error_s"] <= COLLECTIVE_TIMEOUT_S + HEARTBEAT_TIMEOUT_S + 5
    assert sorted(ev["detect_per_process_s"]) == ["0", "1", "3"]
    assert ev["mttr_s"] == pytest.approx(sum(ev[k] for k in MTTR_PHASES))
    assert events[-1]["type"] == "end" and events[-1]["processes"] == [0, 1, 3]
    assert "recovery at step 4: process 2 killed (SIGKILL)" in stdout


@pytest.mark.slow
def test_unique_slices_come_back_from_the_buddy_host_snapshot_across_processes(reference, tmp_path):
    """4 processes x 1 device, tensor = 4: every tensor slice lives in one process only. Process
    1 dies; its slice comes from process 2's host snapshot, the others' slices from their live
    holders, all across processes (one all-gather)."""
    out = tmp_path / "mp_snap"
    sets = ("parallel.devices=-1", "parallel.data=1", "parallel.tensor=4")
    rc, stdout = _launch(
        out, "--processes", "4", "--devices-per-process", "1", "--kill", "4:1", sets=sets
    )
    assert rc == 0, stdout
    events = read_jsonl(out / "events.jsonl")
    assert events[0]["snapshot_unique_bytes"] > 0  # each process holds its predecessor's slices
    (ev,) = [e for e in events if e["type"] == "recovery"]
    assert ev["rung"] == "host" and ev["rungs"] == ["host", "replica"] and ev["verified"]
    assert ev["bytes_cross_process"] > 0
    metrics = read_jsonl(out / "metrics.jsonl")
    _assert_matches_reference(metrics, reference)
    assert all(r["snapshot_bytes"] > 0 for r in metrics[:4])


@pytest.mark.slow
def test_killing_process_0_ends_every_process_with_a_clear_error(tmp_path):
    out = tmp_path / "mp_p0"
    sets = ("parallel.devices=-1", "parallel.data=2", "parallel.tensor=2")
    rc, stdout = _launch(
        out,
        "--processes",
        "2",
        "--devices-per-process",
        "2",
        "--kill",
        "2:0",
        sets=sets,
        timeout=150,
    )
    assert rc == 3, stdout
    assert "process 0 hosts the JAX coordination service" in stdout
    summary = json.loads((out / "launch.json").read_text())
    assert summary["outcome"] == "coordinator_lost"
    p0, p1 = summary["processes"]
    assert p0["signal"] == "SIGKILL" and p0["scheduled_kill"] == "2:0"
    assert p1["returncode"] != 0  # terminated by the runtime, not left running
    assert p1["ended_after_s"] - p0["ended_after_s"] <= HEARTBEAT_TIMEOUT_S + 15
    assert summary["left_running_after_reap"] == []
    assert all(_worker_ended(s["pid"]) for s in summary["processes"])
