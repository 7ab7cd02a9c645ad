"""ZeRO-1 (8 -> 7 -> 4 devices) and ZeRO-3 (8 -> 7 -> 5) training, and ZeRO-2 on the
contiguous layout through one failure, match the fault-free run.

Each recovery restores the departed ranks' partitions from buddy snapshots and is verified by
checksums against the pre-failure state (the trainer raises otherwise). Loss tolerance as in
test_trainer: relative 1e-5 per step.
"""

import jax
import numpy as np
import pytest
from conftest import tiny_config

from elasjax.loop import trainer
from elasjax.config import ConfigError, SnapshotConfig
from elasjax.observe.metrics import read_jsonl

pytestmark = pytest.mark.slow

COMMON = ["train.steps=12", "parallel.tensor=1", "parallel.data=8"]
FAULTS = "faults=[{at_step: 3, devices: [3]}, {at_step: 6, hosts: [0]}, {at_step: 9, devices: [5]}]"


@pytest.fixture(scope="module")
def reference(exe_cache):
    return trainer.run(tiny_config(*COMMON, "faults=[]"), exe_cache=exe_cache)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_through_failures_matches_fault_free(exe_cache, reference, stage):
    """ZeRO-1 runs on the default snapshot config (it protects the partitions by itself), loses
    its first device at step 0 (the initial state's snapshot is taken before step 0), then a
    host and a device during its recovery: 8 -> 7 -> 4, its survivors keeping their
    partitions in place (`zero.shrink: in_place`). ZeRO-3 (buddy snapshots) loses a device and a
    host: 8 -> 7 -> 5, each shrink a fresh layout (the default, `zero.shrink: relayout`; both
    kinds of transition through 8 -> 7 -> 5 -> 4, bitwise: test_zero.py)."""
    faults = (
        FAULTS.split(", {at_step: 9")[0] + "]" if stage == 3 else
        FAULTS.replace("at_step: 3,", "at_step: 0,").split(", {at_step: 9")[0]
        + ", {at_step: 6, devices: [5], phase: recovery}]"  # interrupts the host's recovery
    )
    s = trainer.run(
        tiny_config(*COMMON, f"zero.stage={stage}",
                    *(["snapshot.buddy=true"] if stage == 3 else ["zero.shrink=in_place"]), faults),
        exe_cache=exe_cache,
    )
    assert [int(p.split("t")[0][1:]) for p in s.plans] == ([8, 7, 5] if stage == 3 else [8, 7, 4])
    for r in s.recoveries:
        assert r.verify["leaves"] > 0 and r.rung == "buddy" and r.steps_lost == 0
        if stage == 1:
            assert r.bytes_kept_in_place > 0  # surviving partitions never move
    # relayout: every plan one fresh tier (`Plan.name` ends in the tier count)
    assert all(p.endswith("1") for p in s.plans) == (stage == 3), s.plans
    # transitions prepared ahead: test_zero.py (and the CLI demo runs); here every recovery
    # plans at the failure
    assert not any(r.transfer_plan_hit for r in s.recoveries)
    assert [r.attempts for r in s.recoveries] == ([1, 1] if stage == 3 else [1, 2])
    for step in range(12):
        rel = abs(s.losses[step] - reference.losses[step]) / reference.losses[step]
        assert rel <= 1e-5, (step, rel)


def test_zero2_contiguous_trains_through_a_failure(exe_cache, reference):
    """ZeRO-2 (gradients reduce-scattered too) on the contiguous layout: losing a rank shifts
    every partition boundary, so the transition re-partitions all optimizer bytes (the lost
    rank's from its buddy snapshot); the losses still match the fault-free run."""
    s = trainer.run(
        tiny_config(*COMMON, "zero.stage=2", "zero.layout=contiguous",
                    "faults=[{at_step: 4, devices: [3]}]"),
        exe_cache=exe_cache,
    )
    (r,) = s.recoveries
    assert s.plans[-1].startswith("d7") and r.verify["leaves"] > 0 and r.rung == "buddy"
    assert r.steps_lost == 0 and r.bytes_moved > 0
    for step in range(12):
        rel = abs(s.losses[step] - reference.losses[step]) / reference.losses[step]
        assert rel <= 1e-5, (step, rel)


def test_flipped_byte_in_the_newest_snapshot_is_refused_and_the_next_rung_used(
    exe_cache, reference, tmp_path, monkeypatch
):
    """One byte of the newest buddy copy of a partition of the failing device is flipped: the
    copy fails its checksum, the refusal is in the recovery event, and the host copy (the next
    rung) restores it. The loop's pool is fused here (CPU): its copies are its checksums'
    program's own buffers, which the failure spares, so no other copy is refused."""
    from elasjax.transfer.snapshot import SnapshotPool

    sources, flipped = SnapshotPool.sources, []

    def flip_then_sources(pool, dead, dead_hosts, version):
        pool.complete()  # the newest generation, filed
        assert pool.fused
        rec = next(r for r in pool.records if r.holder in dead and r.buddy_data is not None
                   and r.step == version)
        bad = np.array(rec.buddy_data, copy=True)
        bad.view(np.uint8).reshape(-1)[7] ^= 0x10
        rec.buddy_data = bad
        flipped.append(rec.path)
        return sources(pool, dead, dead_hosts, version)

    monkeypatch.setattr(SnapshotPool, "sources", flip_then_sources)
    s = trainer.run(
        tiny_config(*COMMON, "zero.stage=1", "snapshot.buddy=true", "snapshot.host=true",
                    "faults=[{at_step: 4, devices: [3]}]"),
        tmp_path, exe_cache=exe_cache,
    )
    (ev,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "recovery"]
    assert ev["rung"] == "host" and ev["verify"]["leaves"] > 0 and ev["steps_lost"] == 0
    (refused,) = ev["refused_snapshots"]
    assert "checksum" in refused and f"buddy copy of '{flipped[0]}'" in refused
    for step in range(12):
        rel = abs(s.losses[step] - reference.losses[step]) / reference.losses[step]
        assert rel <= 1e-5, (step, rel)


def test_zero_device_and_buddy_lost_falls_back_to_checkpoint(exe_cache, reference, tmp_path):
    """Device 3 and every device of the next host (where its buddy lives) fail together and host
    copies are off: no snapshot rung is left, so the newest Orbax checkpoint is restored onto the
    new plan and the lost steps are redone; the losses still match the fault-free run."""
    ref = reference
    s = trainer.run(
        tiny_config(
            *COMMON, "zero.stage=1", "snapshot.buddy=true", "snapshot.host=false",
            f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=2",
            "faults=[{at_step: 5, devices: [3, 4, 5]}]",
        ),
        exe_cache=exe_cache,
    )
    (ev,) = s.recoveries
    assert (ev.rung, ev.resumed_at_step, ev.steps_lost) == ("checkpoint", 4, 1)
    for step in range(12):
        assert abs(s.losses[step] - ref.losses[step]) <= 1e-5 * ref.losses[step]


def test_opting_out_of_snapshots_with_unique_state_warns(exe_cache, tmp_path):
    cfg = tiny_config(*COMMON, "zero.stage=1", "snapshot.buddy=false", "snapshot.host=false",
                      "faults=[]", "train.steps=2")
    with pytest.warns(trainer.UnprotectedStateWarning, match=r"snapshot.buddy and snapshot.host "
                      r"are false, and this plan holds \d+ shard\(s\) on one host only"):
        trainer.run(cfg, tmp_path, exe_cache=exe_cache)
    (warning,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "warning"]
    assert warning["field"] == "snapshot" and "UnrecoverableStateError" in warning["message"]


def test_buddy_request_on_one_host_is_a_config_error():
    cfg = tiny_config(*COMMON, "zero.stage=1", "parallel.devices_per_host=8", "snapshot.buddy=true")
    with pytest.raises(ConfigError, match=r"'snapshot.buddy' = true needs a buddy device on "
                       r"another host, and this job has one host"):
        trainer.Trainer(cfg)
    # left unset on one host, the pool keeps host copies (they survive a device failure)
    assert SnapshotConfig().resolved(1, 8) == SnapshotConfig(buddy=False, host=True)
    assert SnapshotConfig().resolved(4, 8) == SnapshotConfig(buddy=True, host=False)
    # one device and no spare: nothing would be left to restore a copy to
    assert SnapshotConfig().resolved(1, 1) == SnapshotConfig(buddy=False, host=False)


def test_a_device_that_changes_tensor_rank_keeps_nothing_in_place(exe_cache):
    """Regression (found by experiments/bench_memory.py at 16 and 64 devices): device 5 is tensor
    rank 1 of group (4, 5) on d3t2, then rank 0 of the new group (5, 6) after device 4 fails,
    while its data rank's pieces are the same. Its old storage shard holds the other tensor row,
    so it must not be kept in place (the recovery used to fail verification in every tensor-
    sharded leaf)."""
    s = trainer.run(
        tiny_config("zero.stage=1", "train.steps=6", "parallel.tensor=1", "parallel.data=8",
                    "train.global_batch=8", "train.microbatches=1", "parallel.devices_per_host=4",
                    "faults=[{at_step: 2, devices: [0]}, {at_step: 4, devices: [4]}]"),
        exe_cache=exe_cache,
    )
    assert [r.to_plan.split(".")[0] for r in s.recoveries] == ["d3t2m3b1+1spare", "d3t2m3b1"]
    assert all(r.verify["leaves"] > 0 and r.rung == "buddy" for r in s.recoveries)


def test_host_copies_taken_on_the_training_thread_keep_the_shardings_whole(exe_cache, reference,
                                                                          monkeypatch):
    """The accelerator's path, run on the CPU: the step donates its state and the host copies are
    started on the training thread (`SnapshotPool.fusion_helps` false). Every array's device set
    stays whole (a `.pop()` on `devices()`, the sharding's cached set, once emptied it for every
    array on the mesh and stopped the first snapshot), and a device failure recovers from the
    host copies, matching the fault-free run."""
    from elasjax.transfer.snapshot import SnapshotPool

    monkeypatch.setattr(SnapshotPool, "fusion_helps", staticmethod(lambda rt: False))
    cfg = tiny_config(*COMMON, "zero.stage=1", "snapshot.buddy=false", "snapshot.host=true",
                      "faults=[{at_step: 3, devices: [3]}]")
    run = trainer.run(cfg, exe_cache=exe_cache)
    assert len(run.recoveries) == 1 and run.recoveries[0].verify["leaves"] > 0
    assert run.recoveries[0].rung == "host"
    for x in jax.tree.leaves(run.state):
        assert len(x.sharding.device_set) == x.sharding.num_devices > 0
    for s, loss in reference.losses.items():
        assert abs(run.losses[s] - loss) <= 1e-5 * loss, s


def test_a_job_of_one_device_takes_no_snapshot_and_says_what_a_failure_costs():
    """With no other device, a copy could never be restored: the automatic choice takes none
    (a whole-state host copy each step would only cost; on a GPU's link, many steps' time), and
    the run warns that its device's failure needs a checkpoint."""
    from elasjax.loop.trainer import UnprotectedStateWarning

    cfg = tiny_config("train.steps=3", "parallel.devices=1", "parallel.devices_per_host=1",
                      "parallel.data=1", "parallel.tensor=1", "faults=[]")
    t = trainer.Trainer(cfg)
    with pytest.warns(UnprotectedStateWarning, match="one device and no spare"):
        t.run()
    assert (t.pool.cfg.buddy, t.pool.cfg.host, t.pool.bytes_per_step) == (False, False, 0)
