"""Bad input ends in one clear line naming the file, key or flag and what is allowed, with exit
code 2; a checkpoint is never deleted without a line saying which steps and why.

The CLI cases run `cli.main` (nothing trains); the checkpoint cases train a 4-step run with a
checkpoint every 2 steps once, then resume it wrongly in every way a user can.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, tiny_config

from elasjax import cli
from elasjax.loop import trainer
from elasjax.observe.metrics import read_jsonl
from elasjax.transfer.checkpoint import CheckpointFormatError

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")


def _err(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines  # one line, no traceback
    return lines[0]


@pytest.mark.parametrize("text,msg", [
    ("train: {steps: 3\n", r"bad\.yaml: line 2, column 1: not valid YAML: while parsing a flow "
                            r"mapping expected ',' or '}'"),
    ("train: {steps: 3, steps: 5}\n", r"bad\.yaml: line 1, column 19: key 'steps' given twice "
                                      r"\(first at line 1\); allowed: each key once"),
    ("train:\n  steps: 3\n  steps: 5\n", r"line 3, column 3: key 'steps' given twice"),
    ("- a\n- b\n", r"bad\.yaml: the top level must be a mapping of sections"),
])
def test_a_config_file_that_is_not_a_config_is_one_line(tmp_path, capsys, text, msg):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    for cmd in ("train", "plan", "sim"):
        assert cli.main([cmd, str(path)]) == 2
        line = _err(capsys)
        assert re.search(msg, line), line


def test_a_path_that_is_not_a_config_file_is_one_line(tmp_path, capsys):
    assert cli.main(["train", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert f"{tmp_path}: is a directory; allowed: a YAML config file" in _err(capsys)
    assert cli.main(["train", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: no such file; allowed: a YAML config file" in _err(capsys)
    assert cli.main(["launch", str(tmp_path), "--processes", "2", "--out", str(tmp_path / "o")]) == 2
    assert "is a directory" in _err(capsys)


def test_bad_overrides_and_flags_are_one_line(tmp_path, capsys):
    out = ["--out", str(tmp_path / "o")]
    assert cli.main(["train", DEMO, "--set", "faults=[{at_step: 3", *out]) == 2
    assert ("--set faults=[{at_step: 3: line 1, column 13: not valid YAML: while parsing a flow "
            "mapping") in _err(capsys)
    assert cli.main(["train", DEMO, "--set", "train.steps", *out]) == 2
    assert "override 'train.steps' must look like key.path=value" in _err(capsys)
    assert cli.main(["launch", DEMO, "--processes", "0", *out]) == 2
    assert "--processes 0: allowed values: an integer >= 1" in _err(capsys)
    assert cli.main(["launch", DEMO, "--processes", "2", "--devices-per-process", "0", *out]) == 2
    assert "--devices-per-process 0: allowed values: an integer >= 1" in _err(capsys)
    assert cli.main(["launch", DEMO, "--processes", "2", "--hook", "nocolon", *out]) == 2
    assert "--hook 'nocolon': expected MODULE:FUNCTION" in _err(capsys)
    assert cli.main(["plan", DEMO, "--fail", "a,b"]) == 2
    assert "--fail a,b: allowed values: comma-separated device ids from 0 to 7" in _err(capsys)
    assert cli.main(["plan", DEMO, "--fail", "3,9"]) == 2
    assert "--fail names devices [9]; allowed values: 0 .. 7" in _err(capsys)
    assert not (tmp_path / "o").exists()  # nothing started


def _metrics(d: Path, steps, digest="s") -> Path:
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 2.0, "batch_digest": f"{digest}{s}"}) + "\n" for s in steps))
    return d


def test_compare_refuses_runs_of_different_steps_unless_asked(tmp_path, capsys):
    a = _metrics(tmp_path / "a", range(20))
    b = _metrics(tmp_path / "b", range(40))
    assert cli.main(["compare", str(a), str(b)]) == 2
    assert (f"compare: {a} logged steps 0..19 and {b} logged steps 0..39; allowed: two runs of "
            "the same steps (or --common-steps") in _err(capsys)
    assert cli.main(["compare", str(a), str(b), "--common-steps"]) == 0
    out = capsys.readouterr().out
    assert "steps    20" in out and "steps logged in only one run (not compared): [20, 21" in out
    assert cli.main(["compare", str(a), str(tmp_path / "none")]) == 2
    assert "none/metrics.jsonl not found" in _err(capsys)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, exe_cache):
    """A 4-step run's checkpoints at steps 2 and 4 (kept for every test to copy)."""
    ck = tmp_path_factory.mktemp("saved") / "ck"
    trainer.run(tiny_config("train.steps=4", "faults=[]", f"checkpoint.dir={ck}",
                            "checkpoint.every=2"), None, exe_cache=exe_cache)
    assert sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == [2, 4]
    return ck


def _resume(ck: Path, step: int, exe_cache, *extra: str):
    return trainer.run(tiny_config("train.steps=4", "faults=[]", f"checkpoint.dir={ck}",
                                   "checkpoint.every=2", f"checkpoint.resume_step={step}", *extra),
                       None, exe_cache=exe_cache)


@pytest.mark.slow
def test_every_wrong_resume_says_what_it_found_and_what_it_needs(saved, tmp_path, exe_cache):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointFormatError, match=(
            r"'checkpoint.resume_step' = -1: no checkpoint at all in .*empty \(it holds no "
            r"committed checkpoint\); allowed values: a directory holding a checkpoint")):
        _resume(empty, -1, exe_cache)
    with pytest.raises(CheckpointFormatError, match=(
            r"'checkpoint.resume_step' = 3: no checkpoint 3 in .* \(it holds steps 2, 4\); "
            r"allowed values: -1 \(the newest\), 2, 4")):
        _resume(saved, 3, exe_cache)
    with pytest.raises(CheckpointFormatError, match=(
            r"checkpoint 2 in .* does not fit this config: leaf opt_state\.1\.0\.mu\.embed\."
            r"embedding is stored as \(256, 32\) float32, this config needs \(256, 64\) float32")):
        _resume(saved, 2, exe_cache, "model.d_model=64")
    with pytest.raises(CheckpointFormatError, match=(
            r"checkpoint 2 in .* holds ZeRO stage 0 storage and this config's plan has ZeRO "
            r"stage 1; allowed: zero.stage = 0 to resume it")):
        _resume(saved, 2, exe_cache, "zero.stage=1")
    # damaged array files: every file of the step's arrays cut to half its size; the files'
    # check names the first (every file of a checkpoint damaged alone: test_bad_checkpoint.py)
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    cut = [p for p in (broken / "2" / "state").rglob("*") if p.is_file() and p.stat().st_size > 64
           and not p.name.startswith("_")]
    assert cut
    for p in cut:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with pytest.raises(CheckpointFormatError, match=r"checkpoint 2 in .*broken: file 2/state/\S+ "
                                                    r"is damaged \("):
        _resume(broken, 2, exe_cache)
    assert sorted(int(p.name) for p in saved.iterdir() if p.name.isdigit()) == [2, 4]  # none lost
    # only the array data garbled (each stored chunk's first byte, zstd's frame header): the
    # files check, the read fails, and names the file of the chunk it failed on
    garbled = tmp_path / "garbled"
    shutil.copytree(saved, garbled)
    assert _garble_chunks(garbled / "2" / "state")
    with pytest.raises(CheckpointFormatError, match=r"checkpoint 2 in .*garbled: file 2/state/"
                                                    r"ocdbt\.process_0/d/\w+ is damaged \(the "
                                                    r"array data it holds cannot be read: "
                                                    r"ValueError: "):
        _resume(garbled, 2, exe_cache)
    # both through the CLI, as a user meets them: one line each, not the failed read's abandoned
    # work reporting itself around it (`checkpoint._AbandonedReads`)
    whole = r"; allowed: a checkpoint whose files are whole \(this directory also holds steps 4\)"
    for ck, msg in ((broken, r"file 2/state/\S+ is damaged \(.*\)" + whole),
                    (garbled, r"file 2/state/ocdbt\.process_0/d/\w+ is damaged \(the array data "
                              r"it holds cannot be read: ValueError: .*\)" + whole)):
        sets = [a for o in (*TINY, "train.steps=4", "faults=[]", f"checkpoint.dir={ck}",
                            "checkpoint.resume_step=2") for a in ("--set", o)]
        p = subprocess.run([sys.executable, "-m", "elasjax.cli", "train", DEMO, *sets, "--out",
                            str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1, p.stderr[:2000] + " ... " + p.stderr[-1000:]
        assert re.match(rf"elasjax: error: checkpoint 2 in {re.escape(str(ck))}: {msg}$",
                        lines[0]), lines[0]


def _garble_chunks(db: Path) -> int:
    """Flip the first byte of every array chunk stored out of line in the OCDBT database `db`
    (its newest version); how many."""
    import tensorstore as ts

    kv = ts.KvStore.open(f"file://{db}/").result()
    nodes = [ts.ocdbt.dump(kv).result()["versions"][-1]["root"]["location"]]
    n = 0
    while nodes:
        for e in ts.ocdbt.dump(kv, nodes.pop()).result()["entries"]:
            if "location" in e:
                nodes.append(e["location"])
            elif "indirect_value" in e:
                _, base, rel, off, _ = e["indirect_value"].split(":")
                f = db / base / rel
                b = bytearray(f.read_bytes())
                b[int(off)] ^= 0xFF
                f.write_bytes(bytes(b))
                n += 1
    return n


def test_a_failed_checkpoint_read_drops_only_its_abandoned_works_reports(monkeypatch, caplog,
                                                                         tmp_path):
    """After a failed read, Orbax's abandoned work reports itself (when, is a race: 0 to 777
    lines a run, measured): each `RuntimeError: Event loop is closed`, each never-retrieved
    error of a task that read the checkpoint's directory, each finalisation error of Orbax's own
    coroutines that names it and, once a read failed, every such error is dropped; any other unraisable or asyncio
    error still goes where it went."""
    import logging
    import types

    from elasjax.transfer.checkpoint import _AbandonedReads

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(_AbandonedReads, "dirs", set())
    monkeypatch.setattr(_AbandonedReads, "failed", False)
    ck = tmp_path / "ck"
    _AbandonedReads.install(ck)
    _AbandonedReads.install(ck)  # once: not a hook around a hook
    report = lambda e, obj=None: types.SimpleNamespace(
        exc_type=type(e), exc_value=e, exc_traceback=None, err_msg=None, object=obj)
    orbax_coro = types.SimpleNamespace(cr_code=types.SimpleNamespace(
        co_filename="/site-packages/orbax/checkpoint/_src/serialization/serialization.py"))
    users_coro = types.SimpleNamespace(cr_code=types.SimpleNamespace(co_filename="/home/me.py"))
    dying = report(ImportError("sys.meta_path is None, Python is likely shutting down"),
                   orbax_coro)
    other = [report(RuntimeError("something else")), report(ValueError("Event loop is closed")),
             dying, report(ImportError("shutting down"), users_coro)]
    sys.unraisablehook(report(RuntimeError("Event loop is closed")))
    # an abandoned read's coroutine finalised before the read's error reached `restore`: its
    # error names the directory being read
    sys.unraisablehook(report(Exception(f"Encountered error while reading array index: ... "
                                        f"'path': '{ck}/2/state/' ..."), orbax_coro))
    for u in other:
        sys.unraisablehook(u)
    assert seen == other  # no read failed yet: Orbax's other coroutines still reported
    _AbandonedReads.failed = True
    seen.clear()
    for u in other:
        sys.unraisablehook(u)
    assert seen == [other[0], other[1], other[3]]
    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        log.error("Task exception was never retrieved\nfuture: <Task exception=ValueError("
                  "'DATA_LOSS: Error reading \"x/.zarray\" in OCDBT database at local file "
                  f"\"{ck}/2/state/\"')>")
        log.error("Future exception was never retrieved\nfuture: <Future finished exception="
                  f"ValueError('DATA_LOSS: ... at local file \"{ck}/2/state/\"')>")
        log.error("Task exception was never retrieved\nfuture: <Task exception=ValueError('a "
                  "task of the user's own')>")
    assert [r.getMessage()[-20:] for r in caplog.records] == ["a task of the user's own')>"[-20:]]


@pytest.mark.slow
def test_a_resume_deletes_the_newer_checkpoints_and_says_so(saved, tmp_path, exe_cache):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    with pytest.warns(UserWarning, match=r"resumed from checkpoint 2: deleted the newer "
                                         r"checkpoints \[4\] in .*ck \(they belong to the timeline"):
        run = _resume(ck, 2, exe_cache)
    assert min(run.losses) == 2
    assert sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == [2, 4]  # 4 saved again


def test_a_resume_from_the_last_steps_checkpoint_ends_with_nothing_to_train(saved, tmp_path,
                                                                             exe_cache):
    """A supervised restart can resume from the checkpoint saved after the run's last step (the
    job died while shutting down): the run ends at once, its `end` event says there was no loss
    to report, and nothing is deleted."""
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    out = tmp_path / "out"
    run = trainer.run(tiny_config("train.steps=4", "faults=[]", f"checkpoint.dir={ck}",
                                  "checkpoint.every=2", "checkpoint.resume_step=-1"),
                      out, exe_cache=exe_cache)
    assert run.losses == {} and run.final_loss is None
    (end,) = [e for e in read_jsonl(out / "events.jsonl") if e["type"] == "end"]
    assert end["final_loss"] is None and end["step"] == 4
    assert sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == [2, 4]
