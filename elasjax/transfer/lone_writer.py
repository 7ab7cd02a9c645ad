"""Checkpoints of a process left alone in a multi-process job, written by a single-process child.

When every other process of a job has died, the survivor's state lives on its own devices only.
Orbax cannot write that state from inside a job that still counts several processes: it
refuses process-local `jax.Array`s there ("Cannot serialize host local jax.Array ... in
multi-host setting"), and its NumPy handler writes array data only in process 0, so host values
saved by any other process come out as a commit marker over no data (the defect
experiments/RESULTS.md records for the supervised-resume soak of 2026-11-28). A child process
whose JAX has one process has neither limit: the survivor sends it the host values of each
checkpoint, and the child saves them with a plain single-process `CheckpointManager` into the
same directory, in the same format, so any later job (of any process count) resumes from them.

The protocol is pickled `(step, state, meta)` tuples on the child's stdin and one line per save
on its stdout, `ok <step>` or `error <message>`; EOF ends the child (`main(DIR, KEEP)`,
KEEP `none` or a count).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any


class CheckpointWriteError(RuntimeError):
    """A lone survivor's checkpoint was not written: the message says which and why."""


class LoneWriter:
    """The survivor's side: a child started at the first save, fed one checkpoint at a time.

    `save` returns once the child has the values (it may still be writing the previous one);
    `wait` returns once every save sent has been committed, and raises on the first that was
    not."""

    def __init__(self, directory: Path, keep: int | None):
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        env.pop("XLA_FLAGS", None)  # the child needs one host device, not the job's fake ones
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from elasjax.transfer.lone_writer import main; "
             "sys.exit(main(*sys.argv[1:]))", str(directory),
             "none" if keep is None else str(keep)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        self.pending: list[int] = []

    def save(self, step: int, state: Any, meta: dict) -> None:
        try:
            pickle.dump((step, state, meta), self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise CheckpointWriteError(
                f"checkpoint {step}: the lone survivor's checkpoint writer (pid {self.proc.pid}) "
                f"is gone ({e}; exit code {self.proc.poll()})") from None
        self.pending.append(step)

    def wait(self) -> None:
        while self.pending:
            step = self.pending.pop(0)
            line = self.proc.stdout.readline().decode(errors="replace").strip()
            if line != f"ok {step}":
                self.pending.clear()
                raise CheckpointWriteError(
                    f"checkpoint {step}: the lone survivor's checkpoint writer answered "
                    f"{line or 'nothing'!r} (exit code {self.proc.poll()})")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=60)


def main(directory: str, keep: str) -> int:
    """The child: save what arrives until EOF."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(
        Path(directory),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None if keep == "none" else int(keep),
            enable_async_checkpointing=False, create=True),
    )
    out = os.fdopen(os.dup(1), "wb")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # anything else printed, by Python or by a library, goes to stderr
    while True:
        try:
            step, state, meta = pickle.load(sys.stdin.buffer)
        except EOFError:
            break
        try:
            manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
            manager.wait_until_finished()
            out.write(f"ok {step}\n".encode())
        except Exception as e:  # noqa: BLE001 (said to the survivor, which raises it)
            out.write(f"error {type(e).__name__}: {str(e).splitlines()[0][:300]}\n".encode())
        out.flush()
    manager.close()
    return 0
