"""TensorBoard scalars of a run, beside its jsonl files.

`TensorBoardWriter` is a hook (`elasjax.observe.events`): called with each step's `StepInfo` and
each event, it writes scalars with tensorboardX (a maintained event-file writer that needs no
TensorFlow), an optional dependency: `pip install 'elasjax[tensorboard]'`. Importing elasjax
does not import it; asking for a writer without it installed is a `ConfigError` that says how to
install it. The loop makes one when `metrics.tensorboard_dir` is set (`--tensorboard DIR`), in
the process that writes `metrics.jsonl` (under `elasjax launch`: the lowest live process at the
start), and closes it when the run ends, also on an error.

What it writes, each point at a training step (its `global_step`):

- each step: `train/loss`, `train/step_time_s`, `train/n_devices`, `train/grad_norm`, and
  `eval/loss` at the steps that evaluate (`train.eval_every`);
- each step run again after a checkpoint restore: `redo/loss`, `redo/step_time_s` (below);
- `recovery`: `recovery/mttr_s` and each of its phases (`recovery/detect_s`, ...:
  `metrics.MTTR_PHASES`), at the failure's step;
- `failure_cost`: `failure/time_lost_s` and `failure/steps_to_pace`, at the failure's step;
- `migration` and `growth` (cut-overs): `migration/stall_s`, `growth/stall_s`, at the
  cut-over's step;
- `end`: `goodput/goodput`, `goodput/wall_s`, `goodput/good_s` (each where not null) and
  `badput/<cause>` for each cause of `metrics.failure_costs`, at the run's last step + 1.

A step redone after a checkpoint restore (`StepInfo.redo`) goes to the `redo/` tags, never to
`train/` again: `train/loss` keeps one point per step, the first run's (the one `metrics.jsonl`
has without `redo`). A second `train/loss` point at a step already written would go back in
step, which TensorBoard's event loader reads as a restarted job: it purges the points after that
step from its display ("Detected out of order event.step ... Purging"). The `redo/` series shows
the redone steps beside `train/` instead.
Other events (`start`, `join`, `standby_ready`, `warning`, ...) are in `events.jsonl` only.

The writer only queues points (tensorboardX writes from its own thread), so a step costs no
file I/O; it flushes at each recovery and at the `end` event, and `close()` flushes the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Config, ConfigError
from .events import Event, StepInfo
from .metrics import MTTR_PHASES

INSTALL_HINT = "pip install 'elasjax[tensorboard]'"


def summary_writer_class():
    """tensorboardX's `SummaryWriter`, or a `ConfigError` saying how to install it."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"config 'metrics.tensorboard_dir' (--tensorboard) needs the tensorboardX package, "
            f"which is not installed ({e}); install it with: {INSTALL_HINT}"
        ) from None
    return SummaryWriter


def check_available(cfg: Config) -> None:
    """Fail fast, before anything starts: a `ConfigError` if `cfg` asks for TensorBoard scalars
    and tensorboardX is not installed."""
    if cfg.metrics.tensorboard_dir is not None:
        summary_writer_class()


class TensorBoardWriter:
    """A hook writing the run's scalars (see the module docstring) to an event file in
    `logdir`. Use it as a hook (`elasjax.run(cfg, hooks=[w])`, then `w.close()`) or through
    `metrics.tensorboard_dir`, which makes and closes one in the writing process."""

    def __init__(self, logdir: str | Path, *, flush_secs: int = 30):
        writer_cls = summary_writer_class()
        self.logdir = Path(logdir)
        self._w = writer_cls(logdir=str(self.logdir), flush_secs=flush_secs)
        self._closed = False

    @classmethod
    def from_config(cls, cfg: Config) -> TensorBoardWriter | None:
        """The writer `cfg.metrics.tensorboard_dir` asks for, or None when it is not set."""
        d = cfg.metrics.tensorboard_dir
        return None if d is None else cls(d)

    def __call__(self, x: Any) -> None:
        if self._closed:
            return
        if isinstance(x, StepInfo):
            self._step(x)
        elif isinstance(x, Event):
            self._event(x)

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        self._w.add_scalar(tag, float(value), global_step=int(step))

    def _step(self, s: StepInfo) -> None:
        if s.redo:
            self._scalar("redo/loss", s.loss, s.step)
            self._scalar("redo/step_time_s", s.step_time_s, s.step)
            return
        self._scalar("train/loss", s.loss, s.step)
        self._scalar("train/step_time_s", s.step_time_s, s.step)
        self._scalar("train/n_devices", s.n_devices, s.step)
        self._scalar("train/grad_norm", s.grad_norm, s.step)
        if s.eval_loss is not None:
            self._scalar("eval/loss", s.eval_loss, s.step)

    def _event(self, ev: Event) -> None:
        f = ev.fields
        if ev.type == "recovery":
            self._scalar("recovery/mttr_s", f["mttr_s"], f["step"])
            for phase in MTTR_PHASES:
                self._scalar(f"recovery/{phase}", f[phase], f["step"])
            self._w.flush()
        elif ev.type == "failure_cost":
            self._scalar("failure/time_lost_s", f["time_lost_s"], f["step"])
            self._scalar("failure/steps_to_pace", f["steps_to_pace"], f["step"])
        elif ev.type in ("migration", "growth"):
            self._scalar(f"{ev.type}/stall_s", f["stall_s"], f["step"])
        elif ev.type == "end":
            g, step = f["goodput"], f["step"]
            # None where the run had no step at the initial plan's pace to measure against
            for key in ("goodput", "wall_s", "good_s"):
                if g.get(key) is not None:
                    self._scalar(f"goodput/{key}", g[key], step)
            for cause, v in g.get("badput", {}).items():
                self._scalar(f"badput/{cause}", v, step)
            self._w.flush()

    def flush(self) -> None:
        if not self._closed:
            self._w.flush()

    def close(self) -> None:
        """Write what is queued and close the event file (idempotent)."""
        if not self._closed:
            self._closed = True
            self._w.close()
