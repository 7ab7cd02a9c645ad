"""TensorBoard scalars (`elasjax.observe.tensorboard`, `--tensorboard DIR`,
`metrics.tensorboard_dir`): read back from the event file and compared with the run's jsonl files."""

import json
import os
import signal
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TINY, deaths, tiny_config

from elasjax import cli
from elasjax.loop import trainer
from elasjax.config import ConfigError
from elasjax.observe.events import Event, StepInfo
from elasjax.observe.metrics import MTTR_PHASES, read_jsonl

tensorboardX = pytest.importorskip("tensorboardX")
from tensorboardX.proto.event_pb2 import Event as EventProto
from tensorboardX.record_writer import masked_crc32c

from elasjax.observe.tensorboard import INSTALL_HINT, TensorBoardWriter


def read_records(path: Path):
    """The records of a TFRecord file: each is a little-endian u64 length, the length's masked
    CRC-32C (u32), the data, the data's masked CRC-32C (u32)."""
    buf = path.read_bytes()
    pos = 0
    while pos < len(buf):
        header = buf[pos:pos + 8]
        (n,) = struct.unpack("<Q", header)
        (crc_n,) = struct.unpack("<I", buf[pos + 8:pos + 12])
        assert crc_n == masked_crc32c(header), f"{path}: bad length checksum at byte {pos}"
        data = buf[pos + 12:pos + 12 + n]
        (crc_d,) = struct.unpack("<I", buf[pos + 12 + n:pos + 16 + n])
        assert len(data) == n and crc_d == masked_crc32c(data), f"{path}: bad record at {pos}"
        yield data
        pos += 16 + n


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in file order, from the one event file in `logdir`."""
    (path,) = list(logdir.glob("events.out.tfevents.*"))
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for data in read_records(path):
        ev = EventProto()
        ev.ParseFromString(data)
        for v in ev.summary.value:
            out[v.tag].append((ev.step, v.simple_value))
    return dict(out)


def f32(x: float) -> float:
    """What an event file holds for `x` (`simple_value` is a 32-bit float)."""
    return float(np.float32(x))


@pytest.mark.slow
def test_train_flag_writes_the_runs_scalars(tmp_path, capsys):
    """`elasjax train --tensorboard DIR` with a device failure: the loss, step-time and device
    series are metrics.jsonl's, and the recovery, its cost and the goodput are events.jsonl's."""
    sets = [a for kv in TINY for a in ("--set", kv)] + ["--set", "train.steps=6"]
    fault = ["--set", "faults=[{at_step: 3, devices: [5]}]"]
    run, tb = tmp_path / "run", tmp_path / "tb"
    assert cli.main(["train", "configs/demo.yaml", *sets, *fault, "--quiet", "--out", str(run),
                     "--tensorboard", str(tb)]) == 0
    capsys.readouterr()
    rows = read_jsonl(run / "metrics.jsonl")
    events = read_jsonl(run / "events.jsonl")
    sc = read_scalars(tb)
    assert [r["step"] for r in rows] == list(range(6)) and not any(r.get("redo") for r in rows)
    assert sc["train/loss"] == [(r["step"], f32(r["loss"])) for r in rows]
    assert sc["train/step_time_s"] == [(r["step"], f32(r["step_time_s"])) for r in rows]
    assert sc["train/grad_norm"] == [(r["step"], f32(r["grad_norm"])) for r in rows]
    assert sc["train/n_devices"] == [(r["step"], r["n_devices"]) for r in rows]
    assert [n for _, n in sc["train/n_devices"]] == [8, 8, 8, 7, 7, 7]
    (rec,) = [e for e in events if e["type"] == "recovery"]
    assert rec["step"] == 3
    assert sc["recovery/mttr_s"] == [(3, f32(rec["mttr_s"]))]
    for phase in MTTR_PHASES:
        assert sc[f"recovery/{phase}"] == [(3, f32(rec[phase]))]
    (cost,) = [e for e in events if e["type"] == "failure_cost"]
    assert sc["failure/time_lost_s"] == [(3, f32(cost["time_lost_s"]))]
    end = events[-1]
    assert end["type"] == "end" and end["step"] == 6
    assert sc["goodput/goodput"] == [(6, f32(end["goodput"]["goodput"]))]
    assert sc["goodput/wall_s"] == [(6, f32(end["goodput"]["wall_s"]))]
    assert {k: v for k, v in sc.items() if k.startswith("badput/")} == {
        f"badput/{k}": [(6, f32(v))] for k, v in end["goodput"]["badput"].items()
    }
    assert not any(k.startswith(("redo/", "eval/")) for k in sc)
    # the flag is the config field: the run's config.yaml records it
    assert yaml.safe_load((run / "config.yaml").read_text())["metrics"] == {
        "tensorboard_dir": str(tb)
    }


def test_writer_series_redo_eval_and_events(tmp_path):
    """Steps redone after a checkpoint restore go to `redo/`, leaving one `train/` point per
    step; held-out losses, cut-overs and an unknown goodput (None) as documented."""
    w = TensorBoardWriter(tmp_path)

    def step(s, loss, redo=False, ev=None):
        return StepInfo(s, loss, "d8", 8 - s // 4, 0.5 + s, 1.0 + s, ev, redo, 0)

    for s in range(6):
        w(step(s, 10.0 - s, ev=3.5 if s == 2 else None))
    for s in (4, 5):  # a failure at step 6 restored the step-4 checkpoint
        w(step(s, 20.0 + s, redo=True))
    w(step(6, 3.0))
    w(Event("migration", {"type": "migration", "step": 7, "stall_s": 0.25}))
    w(Event("growth", {"type": "growth", "step": 8, "stall_s": 0.5}))
    w(Event("join", {"type": "join", "step": 8}))
    w(Event("end", {"type": "end", "step": 9, "goodput": {
        "goodput": None, "wall_s": 12.0, "good_s": None, "badput": {"startup_s": 2.0}}}))
    w.close()
    w.close()  # idempotent
    w(step(7, 1.0))  # after close: nothing, no error
    sc = read_scalars(tmp_path)
    assert sc["train/loss"] == [(s, 10.0 - s) for s in range(6)] + [(6, 3.0)]
    assert [s for s, _ in sc["train/step_time_s"]] == list(range(7))
    assert sc["train/n_devices"] == [(s, 8 - s // 4) for s in range(7)]
    assert sc["redo/loss"] == [(4, 24.0), (5, 25.0)]
    assert sc["redo/step_time_s"] == [(4, 4.5), (5, 5.5)]
    assert sc["eval/loss"] == [(2, 3.5)]
    assert sc["migration/stall_s"] == [(7, 0.25)] and sc["growth/stall_s"] == [(8, 0.5)]
    assert sc["goodput/wall_s"] == [(9, 12.0)] and sc["badput/startup_s"] == [(9, 2.0)]
    assert "goodput/goodput" not in sc and "goodput/good_s" not in sc
    assert not any(k.startswith("join") for k in sc)


def test_tensorboard_dir_config_field():
    assert tiny_config().metrics.tensorboard_dir is None
    assert tiny_config("metrics.tensorboard_dir=runs/tb").metrics.tensorboard_dir == "runs/tb"
    with pytest.raises(ConfigError, match=r"'metrics.tensorboard_dir' = '  '; allowed values: "
                       r"null \(no TensorBoard scalars\) or a directory path"):
        tiny_config("metrics.tensorboard_dir='  '")
    with pytest.raises(ConfigError, match="'metrics.tensorboard_dir' must be a string, got 3"):
        tiny_config("metrics.tensorboard_dir=3")


def test_missing_tensorboardx_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """Without tensorboardX, `--tensorboard` (train and launch) and the config field fail before
    training starts, saying how to install it; importing elasjax does not need it."""
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` fails
    tb = tmp_path / "tb"
    assert cli.main(["train", "configs/demo.yaml", "--tensorboard", str(tb), "--out",
                     str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "'metrics.tensorboard_dir' (--tensorboard) needs the tensorboardX package" in err
    assert INSTALL_HINT in err and INSTALL_HINT == "pip install 'elasjax[tensorboard]'"
    assert not (tmp_path / "run").exists()
    # launch: refused in the launcher, before any worker starts
    assert cli.main(["launch", "configs/multiprocess.yaml", "--processes", "2", "--tensorboard",
                     str(tb), "--out", str(tmp_path / "launch")]) == 2
    assert INSTALL_HINT in capsys.readouterr().err
    assert not (tmp_path / "launch").exists()
    # the library: the run stops with the error, and events.jsonl says so
    cfg = tiny_config("train.steps=2", f"metrics.tensorboard_dir={tb}")
    with pytest.raises(ConfigError, match=r"pip install 'elasjax\[tensorboard\]'"):
        trainer.run(cfg, tmp_path / "lib")
    last = read_jsonl(tmp_path / "lib" / "events.jsonl")[-1]
    assert last["type"] == "error" and last["error"] == "ConfigError"
    assert not tb.exists()
    code = ("import sys; sys.modules['tensorboardX'] = None; "
            "import elasjax, elasjax.loop.trainer, elasjax.cli, elasjax.launch.process, "
            "elasjax.observe.tensorboard")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


@pytest.mark.slow
def test_launch_writes_one_event_file_from_the_writing_process(tmp_path):
    """`elasjax launch --tensorboard DIR`, 2 processes, process 1 SIGKILLed at step 3: one event
    file (process 0's), whose loss series and recovery are the launch's jsonl files'."""
    root = Path(__file__).resolve().parents[1]
    out, tb = tmp_path / "mp", tmp_path / "tb"
    sets = [a for kv in (*TINY, "train.steps=6", "faults=[]") for a in ("--set", kv)]
    cmd = [sys.executable, "-m", "elasjax.cli", "launch", "configs/multiprocess.yaml", *sets,
           "--processes", "2", "--devices-per-process", "4", "--kill", "3:1", "--timeout", "270",
           "--out", str(out), "--tensorboard", str(tb), "--quiet"]
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    finally:  # the launcher SIGKILLs its workers on the way out; this is the backstop
        pids = out / "pids.json"
        for pid in json.loads(pids.read_text())["workers"] if pids.exists() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    assert p.returncode == 0, p.stdout + p.stderr
    rows = read_jsonl(out / "metrics.jsonl")
    events = read_jsonl(out / "events.jsonl")
    sc = read_scalars(tb)  # exactly one event file in DIR
    assert sc["train/loss"] == [(r["step"], f32(r["loss"])) for r in rows]
    assert [s for s, _ in sc["train/loss"]] == list(range(6))
    assert [n for _, n in sc["train/n_devices"]] == [8] * 3 + [4] * 3
    (rec,) = deaths(events)
    assert rec["step"] == 3 and rec["failed_processes"] == [1]
    # a point per recovery: the death's, and a collective retry's where a loaded host made one
    assert sc["recovery/mttr_s"] == [(e["step"], f32(e["mttr_s"])) for e in events
                                     if e["type"] == "recovery"]
    assert (3, f32(rec["mttr_s"])) in sc["recovery/mttr_s"]
    assert sc["goodput/wall_s"] == [(6, f32(events[-1]["goodput"]["wall_s"]))]
