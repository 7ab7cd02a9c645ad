"""Orbax persistent checkpoints: the last rung of recovery and the checkpoint-restart baseline.

Saves are atomic (Orbax writes to a temporary directory and renames on commit, so a half-written
checkpoint is never restored) and asynchronous; `keep` bounds retention. Each checkpoint stores
the `TrainState` and a JSON record with the step and the per-leaf checksums of that state, so a
restore is verified like any other recovery. Restore always passes an abstract target carrying
the *new* plan's shardings: that is Orbax's supported path onto a different mesh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from .config import CheckpointConfig


class Checkpointer:
    """Orbax `CheckpointManager` over the job's live processes (`processes`, None = this process
    alone); `reopen` moves it to the survivors after a failure."""

    def __init__(self, cfg: CheckpointConfig, processes: set[int] | None = None):
        if cfg.dir is None:
            raise ValueError("checkpoint.dir is not set")
        self.cfg = cfg
        self.dir = Path(cfg.dir).absolute()
        self.generation = 0
        self.manager = self._open(processes)

    def _open(self, processes: set[int] | None):
        mp = ocp.options.MultiprocessingOptions()
        if processes is not None:  # a multi-process job: exactly these take part
            mp = ocp.options.MultiprocessingOptions(
                primary_host=min(processes), active_processes=set(processes),
                barrier_sync_key_prefix=f"elasjax-ckpt-{self.generation}",
            )
        self.dir.mkdir(parents=True, exist_ok=True)  # Orbax will not, over a subset of processes
        return ocp.CheckpointManager(
            self.dir,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.cfg.keep, enable_async_checkpointing=True,
                multiprocessing_options=mp, create=False,
            ),
        )

    def reopen(self, processes: set[int] | None) -> None:
        """Continue over `processes` (the survivors): a manager whose barriers include a dead
        process would wait for it until its timeout. The old manager is dropped, not closed
        (closing waits on those barriers too); what it had committed stays on disk."""
        if processes is None:
            return
        self.generation += 1
        self.manager = self._open(processes)

    def due(self, step: int) -> bool:
        """Save after `step` steps have completed?"""
        return step % self.cfg.every == 0

    def save(self, step: int, state: Any, checksums: dict[str, str]) -> None:
        if jax.process_count() > 1 and all(
            x.is_fully_addressable for x in jax.tree.leaves(state)
        ):
            # the plan lives in this process alone (a lone survivor): Orbax refuses
            # process-local arrays in a multi-process job, so save their host values
            state = jax.device_get(state)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({"step": step, "checksums": checksums}),
            ),
            force=True,
        )

    def latest_step(self) -> int | None:
        self.manager.wait_until_finished()
        return self.manager.latest_step()

    def restore(self, step: int, abstract_target: Any) -> tuple[Any, dict]:
        """(state on the target shardings, metadata {step, checksums})."""
        self.manager.wait_until_finished()
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_target), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], out["meta"]

    def drop_after(self, step: int) -> list[int]:
        """Delete checkpoints newer than `step` (an abandoned timeline after resuming from
        `step`); returns the steps deleted."""
        self.manager.wait_until_finished()
        newer = [s for s in self.manager.all_steps() if s > step]
        for s in newer:
            self.manager.delete(s)
        return newer

    def close(self) -> None:
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


__all__ = ["Checkpointer", "restore_latest"]
