"""A damaged checkpoint is refused by name: every file of a real checkpoint emptied, cut to half
or garbled ends a resume in a `CheckpointFormatError` naming the checkpoint and the file, before
any step (`elasjax train`: one line, exit code 2); array data that still decodes, to other
numbers, is refused by the checksums it was saved with, naming the file it was read from; the
recovery's checkpoint rung refuses a damaged checkpoint with the same error instead of going on.

The checkpoint is written once for the module (the tiny config, 2 steps, a checkpoint every 2:
steps 0 and 2); each case corrupts a copy of it and resumes from step 2 in-process.
"""

import shutil
from pathlib import Path

import pytest
from conftest import TINY, tiny_config

from elasjax import StateMismatchError, cli
from elasjax.loop import trainer
from elasjax.observe.events import StepInfo
from elasjax.transfer.checkpoint import CheckpointChecksumError, CheckpointFormatError

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")

# every file Orbax writes for a checkpoint of one process, by what it is (names of the `d/`
# files are random); `test_the_cases_cover_every_file_of_the_checkpoint` keeps this whole
FILES = [
    "_CHECKPOINT_METADATA",  # the step's record (JSON)
    "commit_success.txt",  # commit markers
    "meta/commit_success.txt",
    "state/commit_success.txt",
    "meta/metadata",  # the run's record: step, checksums, form (JSON)
    "state/_METADATA",  # the state's tree (JSON)
    "state/_sharding",  # its shardings (JSON)
    "state/array_metadatas/process_*",  # each process's array metadata (JSON)
    "state/manifest.ocdbt",  # the merged array database: manifest, B-tree nodes
    "state/d/*",
    "state/ocdbt.process_*/manifest.ocdbt",  # each process's database: manifest, B-tree nodes of
    "state/ocdbt.process_*/d/*",  # every version, the array data
]


def _emptied(b: bytes) -> bytes:
    return b""


def _truncated(b: bytes) -> bytes:
    return b[: len(b) // 2]


def _garbled(b: bytes) -> bytes:
    """16 bytes spread over the file flipped (the first one included)."""
    out = bytearray(b)
    for i in range(0, len(out), max(1, len(out) // 16)):
        out[i] ^= 0x5A
    return bytes(out)


DAMAGE = {"emptied": _emptied, "truncated": _truncated, "garbled": _garbled}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, exe_cache):
    ck = tmp_path_factory.mktemp("saved") / "ck"
    trainer.run(tiny_config("train.steps=2", "faults=[]", f"checkpoint.dir={ck}",
                            "checkpoint.every=2"), None, exe_cache=exe_cache)
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == ["0", "2"]
    return ck


def _resume(ck: Path, exe_cache, *extra: str):
    return trainer.run(tiny_config("train.steps=3", "faults=[]", f"checkpoint.dir={ck}",
                                   "checkpoint.every=2", "checkpoint.resume_step=2", *extra),
                       None, exe_cache=exe_cache)


def _copy(saved: Path, where: Path) -> Path:
    ck = where / "ck"
    shutil.copytree(saved, ck)
    return ck


def test_the_cases_cover_every_file_of_the_checkpoint(saved):
    files = {p.relative_to(saved / "2") for p in (saved / "2").rglob("*") if p.is_file()}
    covered = {p.relative_to(saved / "2") for f in FILES for p in (saved / "2").glob(f)}
    assert files == covered, sorted(map(str, files - covered))
    assert all(list((saved / "2").glob(f)) for f in FILES)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("pattern", FILES)
def test_a_damaged_file_is_refused_naming_the_checkpoint_and_the_file(saved, tmp_path, exe_cache,
                                                                       pattern, damage):
    """Each file the pattern matches, damaged alone in a copy of the checkpoint: the resume
    raises `CheckpointFormatError` (exit code 2 from the CLI) naming the checkpoint directory,
    the step and that file, and trains nothing."""
    for i, original in enumerate(sorted((saved / "2").glob(pattern))):
        ck = _copy(saved, tmp_path / str(i))
        rel = original.relative_to(saved)
        (ck / rel).write_bytes(DAMAGE[damage](original.read_bytes()))
        with pytest.raises(CheckpointFormatError) as e:
            _resume(ck, exe_cache)
        msg = str(e.value)
        assert f"checkpoint 2 in {ck}: file {rel} is damaged (" in msg, msg
        assert ("allowed: a checkpoint whose files are whole (this directory also holds "
                "steps 0)") in msg


def _flip_in_chunk(ck: Path, key: bytes, where: str) -> Path:
    """One bit of the stored chunk `key` of checkpoint 2's arrays flipped, at its first byte
    (zstd's frame header) or its middle; the file that holds it."""
    import tensorstore as ts

    kv = ts.KvStore.open(f"file://{ck}/2/state/").result()
    root = ts.ocdbt.dump(kv).result()["versions"][-1]["root"]["location"]
    (entry,) = [e for e in ts.ocdbt.dump(kv, root).result()["entries"] if e["key"] == key]
    _, base, rel, off, length = entry["indirect_value"].split(":")
    data = ck / "2" / "state" / base / rel
    b = bytearray(data.read_bytes())
    b[int(off) + (0 if where == "first" else int(length) // 2)] ^= 0x01
    data.write_bytes(bytes(b))
    return data


def test_array_data_that_does_not_decode_is_refused_naming_its_file(saved, tmp_path, exe_cache):
    """A chunk whose frame header is garbled passes the files' check (its file is long enough,
    its nodes decode) and fails the read: the error names the file that holds it."""
    ck = _copy(saved, tmp_path)
    data = _flip_in_chunk(ck, b"params.head.kernel/0.0", "first")
    with pytest.raises(CheckpointFormatError) as e:
        _resume(ck, exe_cache)
    msg = str(e.value)
    assert (f"checkpoint 2 in {ck}: file {data.relative_to(ck)} is damaged (the array data it "
            'holds cannot be read: ValueError: ') in msg, msg
    assert 'Error reading "params.head.kernel/0.0"' in msg, msg


def test_array_data_that_still_decodes_is_refused_by_the_checksums_naming_its_file(
        saved, tmp_path, exe_cache):
    """One bit flipped inside a compressed chunk still decodes (these zstd frames carry no
    checksum of their own), to other numbers: the checksums the checkpoint was saved with
    refuse it, naming the leaf and the file it was read from. Before, the same refusal was a
    bare `StateMismatchError` (a traceback from the CLI, exit code 1); it still is one."""
    ck = _copy(saved, tmp_path)
    data = _flip_in_chunk(ck, b"params.head.kernel/0.0", "middle")
    with pytest.raises(CheckpointChecksumError) as e:
        _resume(ck, exe_cache)
    assert isinstance(e.value, StateMismatchError) and isinstance(e.value, CheckpointFormatError)
    msg = str(e.value)
    assert msg.startswith("checkpoint 2 fails its checksums: 1 leaves differ from the ones it "
                          "was saved with, e.g. ['params/head/kernel']"), msg
    # the leaf's chunks may lie in more than one file (in a fresh clone's run it named two):
    # the one flipped is among them
    named = msg.split(f"in {ck}, file", 1)[1].split(" or the record 2/meta/metadata is damaged")[0]
    assert str(data.relative_to(ck)) in named.removeprefix("s").strip().split(", "), msg


def test_the_issues_checkpoint_is_one_line_and_exit_code_2(saved, tmp_path, capfd):
    """Issue 80's case through the CLI, in this process: every file over 1 kB emptied, the JSON
    records included (before: a `JSONDecodeError` traceback, exit code 1)."""
    ck = _copy(saved, tmp_path)
    emptied = sorted(p.relative_to(ck) for p in (ck / "2").rglob("*")
                     if p.is_file() and p.stat().st_size > 1024)
    assert any(p.parent.name == "meta" for p in emptied)  # the run's record is one
    for p in emptied:
        (ck / p).write_bytes(b"")
    capfd.readouterr()
    sets = [a for o in (*TINY, "train.steps=3", "faults=[]", f"checkpoint.dir={ck}",
                        "checkpoint.resume_step=2") for a in ("--set", o)]
    rc = cli.main(["train", DEMO, *sets, "--out", str(tmp_path / "out"), "--quiet"])
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"elasjax: error: checkpoint 2 in {ck}: file "), err[0]
    assert any(f"file {p} is damaged" in err[0] for p in emptied), err[0]


def test_the_recoverys_checkpoint_rung_refuses_a_damaged_checkpoint(saved, tmp_path, exe_cache):
    """A recovery that reads the checkpoint (`recovery.strategy: checkpoint_restart`) finds the
    newest one damaged since the run resumed from it: the run stops with the same error naming
    the file, no step after the failure is trained."""
    ck = _copy(saved, tmp_path)
    record = ck / "2" / "meta" / "metadata"
    steps = []

    def hook(info):  # the checkpoint was read whole at the resume; damage it after
        if isinstance(info, StepInfo):
            steps.append(info.step)
            record.write_bytes(_truncated(record.read_bytes()))

    with pytest.raises(CheckpointFormatError) as e:
        trainer.run(tiny_config("train.steps=6", "faults=[{at_step: 3, devices: [3]}]",
                                f"checkpoint.dir={ck}", "checkpoint.every=100",
                                "checkpoint.resume_step=2", "recovery.strategy=checkpoint_restart"),
                    None, exe_cache=exe_cache, hooks=[hook])
    assert f"checkpoint 2 in {ck}: file 2/meta/metadata is damaged (" in str(e.value)
    assert steps == [2]  # step 3 failed and was not trained again
