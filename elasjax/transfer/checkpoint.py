"""Orbax persistent checkpoints: the last rung of recovery and the checkpoint-restart baseline.

Saves are atomic (Orbax writes to a temporary directory and renames on commit, so a half-written
checkpoint is never restored) and asynchronous; `keep` bounds retention. Each checkpoint stores
the `TrainState` *in the form of the plan that saved it* (ZeRO storage tiers and pipeline slots
as they are: every device writes its own shards, nothing is gathered), and a JSON record with
the step, the per-leaf checksums of that state (layout-independent) and the saved form (tensor
degree, ZeRO stage and layout tables, pipeline partition).

`restore_onto` reads a checkpoint onto any plan without materialising replicated full state:
Orbax reads each saved leaf spread over the live devices (`spread_shardings`: split along the
dimension that splits the most ways), and the same transition planner that recovery uses turns
that saved form into the new plan's form (`reshard.transition`, by canonical element
identities); a checkpoint read onto a plan of its own form goes straight onto that plan's
shardings (each device reads its own shards). Checkpoints written before the form was recorded
hold the canonical (ZeRO-0) form and are still read, through the canonical form.

Before any of a checkpoint is used, every file of it is read as what it must be
(`Checkpointer.check_files`): a file emptied, cut short or garbled is a `CheckpointFormatError`
naming the checkpoint and the file. Array data that still decodes to other numbers is refused by
the state's checksums (`CheckpointChecksumError` at a resume, `StateMismatchError` at the
recovery's checkpoint rung), naming the files that hold the leaves that differ.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import sys
import types
import warnings
from pathlib import Path
from urllib.parse import unquote
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..config import CheckpointConfig, ConfigError
from ..plan.zero import ZeroLayout
from .lone_writer import LoneWriter
from .reshard import transition
from .shards import Shard, ShardStore, StateMismatchError


def _ocp():
    """Orbax, imported where a checkpoint is made or read: it costs every process that imports
    elasjax's loop about 0.2 s of CPU at start (`python -X importtime`), and most runs
    (every launch worker of the suite, a run without `checkpoint.dir`) never use it
    (experiments/RESULTS.md, "What a process pays at start")."""
    import orbax.checkpoint as ocp

    return ocp


# each generation of a job's checkpoint manager numbers Orbax's operations from its own block
_OPS_PER_GENERATION = 1 << 20


def _agree_operation_ids(generation: int) -> None:
    """Orbax names the key-value signals of a save after a count of the process's operations
    (`OperationIdGenerator`, process-wide): a process restarted into a running job counts from
    0 while the others are further on, and at the first save after its admission every process
    waited for a signal posted under another name (an own loop's job with checkpoints hung there
    5 minutes, tests/test_own_loop_launch.py's rejoin test). Every process that opens the
    manager of `generation` restarts the count at the same value."""
    try:
        from orbax.checkpoint._src.futures import synchronization

        ids = synchronization.OperationIdGenerator
        ids._operation_id_counter = itertools.count(generation * _OPS_PER_GENERATION)
        ids._operation_id = next(ids._operation_id_counter)
    except (ImportError, AttributeError) as e:
        warnings.warn(f"this Orbax has no OperationIdGenerator to agree on ({e}): a process "
                      "restarted into a job with checkpoints may wait at its first save",
                      RuntimeWarning, stacklevel=3)


class CheckpointFormatError(ConfigError):
    """A checkpoint this run cannot read: another model or shape, a storage format of another
    elasjax version, damaged files, or a step that is not there. The message names the
    checkpoint, what was found and what was expected (a damaged file: the file)."""


class CheckpointChecksumError(CheckpointFormatError, StateMismatchError):
    """A checkpoint whose files read, but whose state differs from the checksums it was saved
    with (array data garbled into other numbers, or a garbled record): bad input like any
    damaged checkpoint (`elasjax train` exits 2 with one line), and the `StateMismatchError` of
    every state that does not verify. The message names the leaves and the files they are read
    from."""


# The files Orbax writes as JSON: the step's record (`_CHECKPOINT_METADATA`), an item's JSON
# (`metadata`: the `meta` item, the run's record), the state item's tree, shardings and array
# metadata (`_METADATA`, `_sharding`, `array_metadatas/process_N`; `_ROOT_METADATA` in newer
# Orbax versions). Orbax writes `commit_success.txt` with a fixed text, and the arrays as OCDBT
# databases (a `manifest.ocdbt` and its `d/` files; one per process, merged into the item's).
_JSON_FILES = frozenset({"_CHECKPOINT_METADATA", "metadata", "_METADATA", "_sharding",
                         "_ROOT_METADATA"})
_COMMIT_TEXT = "Checkpoint commit was successful"
# how a failed array read names the value it was reading (TensorStore's OCDBT driver)
_OCDBT_READ = re.compile(r'Error reading "(?P<key>[^"]+)" in OCDBT database at local file '
                         r'"(?P<db>[^"]+)"')


def _ocdbt_file(db: Path, location: str) -> tuple[Path, int, int]:
    """(file, offset, length) of an OCDBT reference `kind:base:relative:offset:length`, its
    paths relative to the database `db` (TensorStore's `LabeledIndirectDataReference`)."""
    _, base, rel, off, length = location.rsplit(":", 4)
    return db / unquote(base) / unquote(rel), int(off), int(length)


class _OrbaxRecordNoise(logging.Filter):
    """Orbax reads each step's `_CHECKPOINT_METADATA` when a manager opens (for its commit
    time, falling back on the directory's) and logs an ERROR with the whole file where it does
    not parse. A checkpoint of ours read later says so itself, in one line naming the file
    (`Checkpointer.check_files`; tests/test_bad_checkpoint.py), so those records are dropped for
    the directories a `Checkpointer` opened, and only those."""

    dirs: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(
                ("Failed to json parse Metadata file", "Failed to read Metadata file")):
            return True
        text = record.getMessage()
        return not any(text.startswith(f"{record.msg.split(':')[0]}: {d}/") for d in self.dirs)

    @classmethod
    def install(cls, directory: Path) -> None:
        cls.dirs.add(str(directory))
        log = logging.getLogger("absl")
        if not any(isinstance(f, cls) for f in log.filters):
            log.addFilter(cls())


def _leaf_key(path) -> tuple[str, ...]:
    """A leaf's path as its names and indices (Orbax's metadata tree and the state's own tree
    spell the same path differently: `['params']` and `.params`)."""
    return tuple(re.findall(r"\w+", jax.tree_util.keystr(path)))


def _first_words(e: BaseException, limit: int = 300) -> str:
    """"Type: the first line of the message" of the error `e` was raised from, if any (Orbax
    wraps a file's error in a bare `Exception` naming only the array index), cut at a word
    boundary past `limit` characters."""
    while e.__cause__ is not None:
        e = e.__cause__
    line = f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0]
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


class _AbandonedReads(logging.Filter):
    """When a read of a damaged checkpoint fails, Orbax raises the first error and abandons the
    read's other work, which then reports itself: TensorStore completes the abandoned futures on
    its own threads and their callbacks find Orbax's event loop closed (unraisable `RuntimeError:
    Event loop is closed`), asyncio logs each failed task's or future's error when it is
    collected ("... exception was never retrieved"), and the read coroutines left suspended fail
    when the interpreter finalises them. Measured: 0 to 777 lines of tracebacks a run, before and
    after the one error that says what is wrong (tests/test_bad_input.py). Exactly those are
    dropped: the closed-loop reports; the never-retrieved errors that name a checkpoint
    directory being read (`dirs`); the finalisation errors of Orbax's own coroutines that name
    one, and after a read failed (`failed`) all of them. Every other report goes where it went before (the hook installed
    before, the "asyncio" logger's handlers)."""

    dirs: set[str] = set()
    failed = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith(("Task exception was never retrieved",
                                     "Future exception was never retrieved"))
                    and self.names_a_read(text))

    @classmethod
    def names_a_read(cls, text: str) -> bool:
        return any(d in text for d in cls.dirs)

    @classmethod
    def dropped(cls, u) -> bool:
        """Whether the unraisable report `u` is the noise of an abandoned read: an Orbax
        coroutine's error is dropped once a read failed, or before (the collector may finalise
        it while the read's error is still on its way up) where the error names a checkpoint
        directory being read."""
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            return True
        code = getattr(u.object, "cr_code", None)
        if code is None or "orbax" not in code.co_filename:
            return False
        return cls.failed or cls.names_a_read(str(u.exc_value))

    @classmethod
    def install(cls, directory: Path) -> None:
        """Before a read of `directory` (idempotent; both filters are process-wide)."""
        cls.dirs.add(str(directory))
        log = logging.getLogger("asyncio")
        if not any(isinstance(f, cls) for f in log.filters):
            log.addFilter(cls())
        before = sys.unraisablehook
        if getattr(before, "elasjax_abandoned_reads", False):
            return

        def hook(u):
            if not cls.dropped(u):
                before(u)

        hook.elasjax_abandoned_reads = True
        sys.unraisablehook = hook


class Checkpointer:
    """Orbax `CheckpointManager` over the job's live processes (`processes`, None = this process
    alone); `reopen` moves it to the survivors after a failure, and to the grown job after an
    admission. `generation` names its barriers: the same in every process that saves together.
    `joining`: a restarted process admitted into the job, which opens it only in the `reopen`
    every process calls once the admission is done (Orbax's manager is made with a barrier over
    its processes, which the others are not at before; a newcomer that made it at its start hung
    there), with the job's `generation`."""

    def __init__(self, cfg: CheckpointConfig, processes: set[int] | None = None,
                 generation: int = 0, *, joining: bool = False):
        if cfg.dir is None:
            raise ValueError("checkpoint.dir is not set")
        self.cfg = cfg
        self.dir = Path(cfg.dir).absolute()
        self.generation = generation
        self.lone: LoneWriter | None = None  # a lone survivor's writer, from its first save
        # step -> {(OCDBT database, key): the file holding that value} of the checkpoints whose
        # files were checked (`check_files`), to name the file of a value that fails later
        self._checked: dict[int, dict[tuple[str, str], Path]] = {}
        _OrbaxRecordNoise.install(self.dir)
        self.manager = None if joining else self._open(processes)

    def _sync(self) -> None:
        """Wait for the lone survivor's writer, if there is one, and let the manager see what
        it wrote (a `CheckpointWriteError` if a save failed)."""
        if self.lone is not None and self.lone.pending:
            self.lone.wait()
            self.manager.reload()

    def _open(self, processes: set[int] | None):
        ocp = _ocp()
        mp = ocp.options.MultiprocessingOptions()
        if processes is not None:  # a multi-process job: exactly these take part
            _agree_operation_ids(self.generation)
            mp = ocp.options.MultiprocessingOptions(
                primary_host=min(processes), active_processes=set(processes),
                barrier_sync_key_prefix=f"elasjax-ckpt-{self.generation}",
            )
        self.dir.mkdir(parents=True, exist_ok=True)  # Orbax will not, over a subset of processes
        # The item handlers are given the same options: a handler the manager builds itself
        # keeps the default primary host, process 0, and writes its files (the JSON record,
        # the array metadata) only there, so once process 0 is gone every checkpoint was a
        # commit marker over nothing (tests/test_checkpoint_multiprocess.py).
        registry = ocp.DefaultCheckpointHandlerRegistry()
        state = ocp.StandardCheckpointHandler(multiprocessing_options=mp)
        meta = ocp.JsonCheckpointHandler(multiprocessing_options=mp)
        for item, handler, kinds in (("state", state, (ocp.args.StandardSave, ocp.args.StandardRestore)),
                                     ("meta", meta, (ocp.args.JsonSave, ocp.args.JsonRestore))):
            for kind in kinds:
                registry.add(item, kind, handler)
        return ocp.CheckpointManager(
            self.dir,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.cfg.keep, enable_async_checkpointing=True,
                multiprocessing_options=mp, create=False,
            ),
            handler_registry=registry,
        )

    def reopen(self, processes: set[int] | None) -> None:
        """Continue over `processes` (the survivors): a manager whose barriers include a dead
        process would wait for it until its timeout. The old manager is dropped, not closed
        (closing waits on those barriers too); what it had committed stays on disk."""
        if processes is None:
            return
        if self.lone is not None:  # the job grew again: the job's processes save from now on
            self.lone.close()
            self.lone = None
        self.generation += 1
        self.manager = self._open(processes)

    def due(self, step: int) -> bool:
        """Save after `step` steps have completed?"""
        return step % self.cfg.every == 0

    def save(self, step: int, state: Any, checksums: dict[str, str], form: dict | None = None) -> None:
        """Save `state` as it is; `form` (`form_of(plan)`) says which plan's form that is (None:
        the canonical form)."""
        ocp = _ocp()
        meta = {"step": step, "checksums": checksums, "form": form}
        self._checked.pop(step, None)
        if jax.process_count() > 1 and all(
            x.is_fully_addressable for x in jax.tree.leaves(state)
        ):
            # the plan lives in this process alone (a lone survivor): Orbax cannot write that
            # from inside a multi-process job; a single-process child does (lone_writer.py)
            if self.lone is None:
                self.manager.wait_until_finished()  # the job's own saves land first
                self.lone = LoneWriter(self.dir, self.cfg.keep)
            self.lone.save(step, jax.device_get(state), meta)
            return
        self._sync()
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )

    def latest_step(self) -> int | None:
        self._sync()
        self.manager.wait_until_finished()
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The committed checkpoints' steps, oldest first."""
        self._sync()
        self.manager.wait_until_finished()
        return sorted(self.manager.all_steps())

    def resolve(self, resume_step: int) -> int:
        """The step `checkpoint.resume_step` names (-1: the newest), or a `CheckpointFormatError`
        saying what the directory holds."""
        have = self.steps()
        if resume_step == -1 and have:
            return have[-1]
        if resume_step in have:
            return resume_step
        held = (f"it holds steps {', '.join(map(str, have))}" if have
                else "it holds no committed checkpoint")
        allowed = (f"-1 (the newest), {', '.join(map(str, have))}" if have
                   else "a directory holding a checkpoint, or no resume_step (a fresh start)")
        raise CheckpointFormatError(
            f"config 'checkpoint.resume_step' = {resume_step}: no checkpoint "
            f"{'at all' if resume_step == -1 else resume_step} in {self.dir} ({held}); "
            f"allowed values: {allowed}")

    def check_fits(self, step: int, abstract_target: Any) -> None:
        """Checkpoint `step`'s arrays against the target's leaves (shapes and dtypes), before
        anything is read: a checkpoint of another model or shape is a `CheckpointFormatError`
        naming the first leaf that differs."""
        ocp = _ocp()
        _AbandonedReads.install(self.dir)
        try:
            stored = ocp.StandardCheckpointHandler().metadata(self.dir / str(step) / "state")
        except Exception as e:  # noqa: BLE001 (any unreadable metadata: said as such)
            _AbandonedReads.failed = True
            raise CheckpointFormatError(
                f"checkpoint {step} in {self.dir}: its array metadata cannot be read "
                f"({_first_words(e)}); it is damaged or not an elasjax "
                "checkpoint") from None
        have = {_leaf_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(stored)[0]}
        want = {_leaf_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract_target)[0]}
        for key in sorted(set(want) | set(have)):
            h, w = have.get(key), want.get(key)
            name = ".".join(key)
            if h is None or w is None:
                where, what = ("this config's state", "the checkpoint") if h is None else (
                    "the checkpoint", "this config's state")
                raise CheckpointFormatError(
                    f"checkpoint {step} in {self.dir} does not fit this config: leaf {name} is in "
                    f"{where} but not in {what} (a checkpoint of another model or optimizer; "
                    "allowed: a checkpoint this config saved)")
            if tuple(h.shape) != tuple(w.shape) or np.dtype(h.dtype) != np.dtype(w.dtype):
                raise CheckpointFormatError(
                    f"checkpoint {step} in {self.dir} does not fit this config: leaf {name} is "
                    f"stored as {tuple(h.shape)} {np.dtype(h.dtype)}, this config needs "
                    f"{tuple(w.shape)} {np.dtype(w.dtype)} (a checkpoint of another model or "
                    "shape; allowed: a checkpoint this config saved)")

    def restore(self, step: int, abstract_target: Any, *, files_checked: bool = False
                ) -> tuple[Any, dict]:
        """(state on the target shardings, metadata {step, checksums}); checked first
        (`check_files`, unless the caller just did: `files_checked`; `check_fits`); an
        unreadable checkpoint is a `CheckpointFormatError` naming the file where the read says
        which value failed."""
        ocp = _ocp()
        self._sync()
        self.manager.wait_until_finished()
        if not files_checked:
            self.check_files(step)
        self.check_fits(step, abstract_target)
        try:
            out = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_target), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # noqa: BLE001 (Orbax wraps a damaged file's error in Exception)
            _AbandonedReads.failed = True
            file = self._file_of_failed_read(step, e)
            if file is not None:  # array data that does not decode (garbled in place)
                raise self._damaged(step, file, f"the array data it holds cannot be read: "
                                                f"{_first_words(e)}") from None
            raise CheckpointFormatError(
                f"checkpoint {step} in {self.dir} cannot be read: {_first_words(e)} (damaged "
                "or incomplete files?)") from e
        return out["state"], out["meta"]

    def metadata(self, step: int) -> dict:
        """The JSON record of checkpoint `step` alone: {step, checksums, form}; the checkpoint's
        files checked first (`check_files`)."""
        ocp = _ocp()
        self._sync()
        self.manager.wait_until_finished()
        self.check_files(step)
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    # -- damaged files -----------------------------------------------------------------------

    def _damaged(self, step: int, file: Path, why: str) -> CheckpointFormatError:
        """The one error of a damaged file of checkpoint `step`: the checkpoint, the file (from
        the checkpoint directory), what is wrong with it and what else the directory holds."""
        others = sorted(int(p.name) for p in self.dir.iterdir()
                        if p.name.isdigit() and int(p.name) != step)
        held = (f"this directory also holds steps {', '.join(map(str, others))}" if others
                else "this directory holds no other")
        name = file.relative_to(self.dir) if file.is_relative_to(self.dir) else file
        return CheckpointFormatError(
            f"checkpoint {step} in {self.dir}: file {name} is damaged ({why}); allowed: a "
            f"checkpoint whose files are whole ({held})")

    def check_files(self, step: int) -> None:
        """Read every file of checkpoint `step` as what it must be, before any of it is used:
        a file emptied, cut short or garbled is a `CheckpointFormatError` naming it. The JSON
        records must parse to objects (the run's record holding its step and checksums), the
        commit markers must hold Orbax's text, and every OCDBT database (the state item's, and
        each process's that it was merged from) must decode: its manifest, every B-tree and
        version node of every version it holds, and every file its values are read from must
        hold their bytes. The bytes of the values themselves are checked when they are read
        (where they do not decode: `restore`) and by the state's checksums after (where they
        decode to other numbers: `checksums_differ`). A file no read would use (an earlier
        version's node of a process's database) is refused too: it says the checkpoint was
        damaged. Each read checks again (a checkpoint checked at a resume may be damaged by the
        time a recovery reads it). Measured on the suite's checkpoint: every file of it emptied,
        cut to half and garbled is refused by name (tests/test_bad_checkpoint.py)."""
        root = self.dir / str(step)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                self._check_record(step, path)
        values: dict[tuple[str, str], Path] = {}
        for manifest in sorted(root.rglob("manifest.ocdbt")):
            values.update(self._check_ocdbt(step, manifest.parent))
        self._checked[step] = values

    def _check_record(self, step: int, path: Path) -> None:
        """One file of checkpoint `step` that is not an OCDBT database's: a JSON record or a
        commit marker (files of other names are left to the read)."""
        if path.name == "commit_success.txt":
            # Orbax writes f"{_COMMIT_TEXT} to {the directory it committed}"; the directory may
            # have moved since, but its name is the marker's own directory's (the step, the
            # item): a marker cut short anywhere loses it
            text = path.read_bytes().decode(errors="replace")
            to = text.removeprefix(f"{_COMMIT_TEXT} to ")
            if to == text or Path(to).name != path.parent.name:
                raise self._damaged(step, path, f"a commit marker that does not hold Orbax's "
                                                f"text {_COMMIT_TEXT!r} to .../"
                                                f"{path.parent.name}")
            return
        if path.name not in _JSON_FILES and path.parent.name != "array_metadatas":
            return
        try:
            record = json.loads(path.read_bytes().decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise self._damaged(step, path, f"a JSON record that does not parse: "
                                            f"{_first_words(e)}") from None
        if not isinstance(record, dict):
            raise self._damaged(step, path, f"a JSON record that holds a "
                                            f"{type(record).__name__}, not an object")
        if path.parent.name == "meta" and path.name == "metadata":  # the run's record
            sums = record.get("checksums")
            if record.get("step") != step or not isinstance(sums, dict) or not sums or not all(
                    isinstance(v, str) for v in sums.values()):
                raise self._damaged(step, path, f"the run's record holds step "
                                                f"{record.get('step')!r} and "
                                                f"{type(sums).__name__} checksums, not step "
                                                f"{step} and each leaf's checksum")

    def _check_ocdbt(self, step: int, db: Path) -> dict[tuple[str, str], Path]:
        """The OCDBT database in `db` decoded (its manifest, every version's B-tree, each value's
        file long enough); {(db, key): the file holding that value} of its newest version."""
        import tensorstore as ts

        kv = ts.KvStore.open(f"file://{db}/").result()

        def dump(location: str | None, what: str):
            file = db / "manifest.ocdbt" if location is None else _ocdbt_file(db, location)[0]
            try:
                return ts.ocdbt.dump(kv, location).result()
            except Exception as e:  # noqa: BLE001 (any undecodable node: said as such)
                raise self._damaged(step, file, f"{what} does not decode: "
                                                f"{_first_words(e)}") from None

        manifest = dump(None, "the array database's manifest")
        versions = list(manifest["versions"])
        pending = [v["location"] for v in manifest["version_tree_nodes"]]
        while pending:  # the version tree of a database of many versions
            for e in dump(pending.pop(), "a version tree node")["entries"]:
                if "root" in e:  # a version
                    versions.append(e)
                else:  # a node of versions
                    pending.append(e["location"])
        sizes: dict[Path, int] = {}
        newest: dict[tuple[str, str], Path] = {}
        seen: set[str] = set()
        # the newest version first: every value it reads is recorded for naming its file
        for i, v in enumerate(sorted(versions, key=lambda v: -v["generation_number"])):
            record = i == 0
            nodes = [v["root"]["location"]]
            while nodes:
                loc = nodes.pop()
                if loc in seen:
                    continue
                seen.add(loc)
                for e in dump(loc, "an array database B-tree node")["entries"]:
                    if "location" in e:  # an interior node's child
                        nodes.append(e["location"])
                    elif "indirect_value" in e:
                        file, off, length = _ocdbt_file(db, e["indirect_value"])
                        key = e["key"].decode(errors="replace")
                        if file not in sizes:
                            sizes[file] = file.stat().st_size if file.is_file() else -1
                        if sizes[file] < off + length:
                            held = ("is missing" if sizes[file] < 0
                                    else f"holds {sizes[file]} bytes")
                            raise self._damaged(step, file, f"it {held} and the array data of "
                                                            f"{key} is its bytes {off} to "
                                                            f"{off + length}")
                        if record:
                            newest[(str(db), key)] = file
        return newest

    def _file_of_failed_read(self, step: int, e: BaseException) -> Path | None:
        """The file holding the value a failed read names (TensorStore's error says which key
        of which database), if the checked checkpoint records it."""
        while e.__cause__ is not None:
            e = e.__cause__
        m = _OCDBT_READ.search(str(e))
        if m is None:
            return None
        db = str(Path(m["db"]).absolute())
        return self._checked.get(step, {}).get((db, m["key"]))

    def files_of(self, step: int, leaves: list[str]) -> list[Path]:
        """The files (from the checkpoint directory) that checkpoint `step`'s arrays of `leaves`
        (checksum names, `a/b/c`) are read from, by the state item's newest version."""
        names = {leaf.replace("/", ".") for leaf in leaves}
        state = str(self.dir / str(step) / "state")
        return sorted({f.relative_to(self.dir) for (db, key), f in
                       self._checked.get(step, {}).items()
                       if db == state and key.rsplit("/", 1)[0] in names})

    def checksums_differ(self, step: int, bad: list[str]) -> CheckpointChecksumError:
        """The error of checkpoint `step` read whole whose state differs from its recorded
        checksums in leaves `bad`: the leaves and the files they were read from, or the record
        itself, are damaged."""
        files = self.files_of(step, bad[:3])
        shown = ", ".join(map(str, files[:4])) + (f" and {len(files) - 4} more"
                                                   if len(files) > 4 else "")
        where = (f"file{'s' if len(files) > 1 else ''} {shown}" if files
                 else "its array data")
        return CheckpointChecksumError(
            f"checkpoint {step} fails its checksums: {len(bad)} leaves differ from the ones it "
            f"was saved with, e.g. {bad[:3]}: in {self.dir}, {where} or the record "
            f"{step}/meta/metadata is damaged; refused (allowed: a checkpoint whose files are "
            "whole)")

    def drop_after(self, step: int) -> list[int]:
        """Delete checkpoints newer than `step` (an abandoned timeline after resuming from
        `step`); returns the steps deleted."""
        self._sync()
        self.manager.wait_until_finished()
        newer = [s for s in self.manager.all_steps() if s > step]
        for s in newer:
            self.manager.delete(s)
            self._checked.pop(s, None)
        return newer

    def close(self) -> None:
        if self.lone is not None:
            self.lone.close()
            self.lone = None
            self.manager.reload()
        if self.manager is None:  # a newcomer that left before its admission was done
            return
        self.manager.wait_until_finished()
        self.manager.close()


def restore_latest(cfg: CheckpointConfig, abstract_target: Any) -> tuple[Any, dict] | None:
    """Open `cfg.dir` and restore its newest checkpoint onto the target, or None if empty."""
    ck = Checkpointer(cfg)
    try:
        step = ck.latest_step()
        return None if step is None else ck.restore(step, abstract_target)
    finally:
        ck.close()


# The ZeRO storage format `form_of` records: 2 is `storage.ZeroCodec`'s rows of unpadded pieces
# in each tensor rank's own element order (1, before it, had padded pieces in tensor-major order)
STORAGE_FORMAT = 2


def form_of(plan) -> dict:
    """What identifies a plan's state form (`StateFactory.layout`), as JSON."""
    z = plan.zero
    return {
        "tensor": plan.tensor,
        "zero_stage": plan.zero_stage,
        "zero": None if z is None else {
            "kind": z.kind, "stage": z.stage, "n_pieces": z.n_pieces,
            "tiers": [[list(slots) for slots in t] for t in z.tiers],
            "format": STORAGE_FORMAT,
        },
        "partition": list(plan.partition),
    }


def _plan_of_form(form: dict):
    """The plan fields `StateFactory.layout` reads, from `form_of`'s record."""
    z = form["zero"]
    if z is not None and z.get("format", 1) != STORAGE_FORMAT:
        raise CheckpointFormatError(
            f"the checkpoint holds ZeRO storage in format {z.get('format', 1)}; this elasjax "
            f"reads format {STORAGE_FORMAT} (and ZeRO-0 checkpoints of any version). Resume it "
            "with the elasjax that wrote it, or from a checkpoint saved with zero.stage = 0"
        )
    zero = None if z is None else ZeroLayout(
        z["kind"], z["stage"], z["n_pieces"],
        tuple(tuple(tuple(slots) for slots in t) for t in z["tiers"]),
    )
    partition = tuple(form["partition"])
    return types.SimpleNamespace(
        tensor=form["tensor"], zero_stage=form["zero_stage"], zero=zero, partition=partition,
        stage=max(1, len(partition)),
    )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(k for k in range(1, min(n, at_most) + 1) if n % k == 0) if n else 1


def spread_shardings(abstract: Any, devices, dims: list[int | None] | None = None) -> Any:
    """Per leaf, a sharding over the first `g` of `devices` along one dimension, `g` the
    largest divisor of its size that is <= len(devices): the dimension `dims[i]` where given
    (ZeRO storage: its `data` axis), else the one that splits the most ways. Devices are taken
    round-robin over processes, and every process must hold a part of every leaf (Orbax builds
    no array a process has no shard of): a leaf that splits fewer ways than there are processes
    (a scalar, a small or oddly sized leaf) is replicated once per process; in one process it
    stays on the first device. Otherwise no leaf is replicated."""
    by_proc: dict[int, list] = {}
    for d in devices:
        by_proc.setdefault(d.process_index, []).append(d)
    devices = [d for group in itertools.zip_longest(*by_proc.values()) for d in group if d is not None]
    n_proc = len(by_proc)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    dims = dims or [None] * len(leaves)

    def one(x, want):
        cands = [want] if want is not None else range(len(x.shape))
        best, dim = 1, None
        for i in cands:
            g = _largest_divisor(x.shape[i], len(devices))
            if g > best:
                best, dim = g, i
        if best < n_proc:  # one copy per process
            return NamedSharding(Mesh(np.array(devices[:n_proc]), ("spread",)), PartitionSpec())
        mesh = Mesh(np.array(devices[:best]), ("spread",))
        spec = PartitionSpec() if dim is None else PartitionSpec(*([None] * dim), "spread")
        return NamedSharding(mesh, spec)

    return treedef.unflatten([one(x, d) for x, d in zip(leaves, dims)])


def _as_checkpoint_sources(store, saved) -> None:
    """Mark every shard of a restored saved form as rung `checkpoint`, and cut ZeRO storage
    shards (several ranks and rows of one leaf on one device) into one shard per (rank, row),
    the unit the transition planner reads storage in. The cuts are slices on the device that
    holds them: nothing crosses devices."""
    for i, (tag, shape) in enumerate(zip(saved.tags, store.shapes)):
        out = []
        for s in store.shards[i]:
            if tag[1] is None:
                out.append(Shard(s.device, s.box, s.data, "checkpoint"))
                continue
            b = len(shape) - 3  # [*layers, data, rows, width]
            (r0, r1), (q0, q1) = s.box[b], s.box[b + 1]
            for r in range(r0, r1):
                for q in range(q0, q1):
                    box = s.box[:b] + ((r, r + 1), (q, q + 1), s.box[b + 2])
                    cut = (slice(None),) * b + (slice(r - r0, r - r0 + 1),
                                                slice(q - q0, q - q0 + 1))
                    out.append(Shard(s.device, box, None if s.data is None else s.data[cut],
                                     "checkpoint"))
        store.shards[i] = out


def restore_onto(ckpt: Checkpointer, step: int, factory, exe, *, devices=None, transport=None,
                 threads=None) -> tuple[Any, dict, dict]:
    """Checkpoint `step` on `exe`'s plan: (state, metadata, {"peak_restore_bytes": the most
    bytes one device held of the restored saved form}). Its files are checked first
    (`Checkpointer.metadata`: a damaged file is a `CheckpointFormatError` naming it). Not
    verified here: the caller compares the state's checksums with `metadata["checksums"]`."""
    meta = ckpt.metadata(step)
    if meta.get("form") is None:  # an older checkpoint: the canonical form
        full, meta = ckpt.restore(step, factory.abstract_on(exe.mesh), files_checked=True)
        return exe.from_canonical(full), meta, {"peak_restore_bytes": None}
    if meta["form"]["zero_stage"] != exe.plan.zero_stage:
        # the transition planner moves ZeRO storage between ZeRO plans and plain leaves between
        # plain ones; no run changes its stage, so nothing converts between the two
        raise CheckpointFormatError(
            f"checkpoint {step} in {ckpt.dir} holds ZeRO stage {meta['form']['zero_stage']} "
            f"storage and this config's plan has ZeRO stage {exe.plan.zero_stage}; allowed: "
            f"zero.stage = {meta['form']['zero_stage']} to resume it (the data and tensor "
            "degrees, the device count and the pipeline may change)")
    saved = factory.layout(_plan_of_form(meta["form"]))
    live = sorted(exe.plan.device_ids)
    by_id = devices or {d.id: d for d in jax.devices()}
    if _same_form(meta["form"], exe, [by_id[i] for i in live]):
        # the saved form is the plan's own: each device reads its own shards, nothing is moved
        state, meta = ckpt.restore(step, _targets(exe.layout.abstract, exe.state_shardings),
                                   files_checked=True)
        return state, meta, {"peak_restore_bytes": _peak_device_bytes(state)}
    data_dims = [None if t[1] is None else len(x.shape) - 3
                 for t, x in zip(saved.tags, jax.tree.leaves(saved.abstract))]
    sh = spread_shardings(saved.abstract, [by_id[i] for i in live], data_dims)
    restored, meta = ckpt.restore(step, _targets(saved.abstract, sh), files_checked=True)
    peak = _peak_device_bytes(restored)
    store = ShardStore.capture(restored)
    _as_checkpoint_sources(store, saved)
    state, _ = transition(
        store, exe.state_shardings, devices=by_id,
        old_layout=saved, new_layout=exe.layout, transport=transport, threads=threads,
    )
    del restored
    return state, meta, {"peak_restore_bytes": peak}


def _targets(abstract, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _same_form(form: dict, exe, devices) -> bool:
    """Is the saved form `exe`'s plan's own (the form is what `StateFactory.layout` reads, so
    the saved and the plan's layouts are then the same), with every leaf on a device of every
    process of the plan (Orbax builds no array a process holds no shard of)? Then the
    checkpoint is read straight onto the plan's shardings."""
    if form != form_of(exe.plan):
        return False
    procs = {d.process_index for d in devices}
    return all({d.process_index for d in s.device_set} == procs
               for s in jax.tree.leaves(exe.state_shardings))


def _peak_device_bytes(tree) -> int:
    per_device: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
    return max(per_device.values(), default=0)


__all__ = ["CheckpointChecksumError", "CheckpointFormatError", "Checkpointer", "form_of",
           "restore_latest", "restore_onto", "spread_shardings"]
