"""One step of the loop as the host drives it: its batch in, its program dispatched with the
snapshot and the held-out evaluation queued behind it, and its metrics read later.

The host never waits for the step it has just dispatched: a step's metrics (loss, gradient norm,
and the checksums of the state it produced) are read `READ_BEHIND` steps late, after the next
steps are dispatched, so the devices stay busy while the host prepares the next batches
(`Trainer._after_step` says which steps are read at once). What a read learns (the loss, the
step's time, the state's checksums) goes into the loop's state (`loopstate.LoopState`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from ..config import Config
from ..observe.events import Emitter
from ..observe.metrics import JsonlWriter, StepClock
from ..plan.planner import Plan
from ..runtime.inprocess import host_values
from ..transfer import checksum
from .data import DataPipeline
from .loopstate import LoopState

READ_BEHIND = 2  # steps the host may dispatch before it reads the oldest one's metrics


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    plan: Plan
    met: dict
    t0: float
    keys: list  # the checksum rows' keys
    processed: int
    digest: str
    redo: bool
    evals: list | None = None
    tokens: float = 0.0  # the step's loss normaliser: its real samples' counts (GPT: tokens)
    seq: int | None = None  # its number for the step clock (`metrics.StepClock`), if watched


class Stepper:
    """Dispatches the loop's steps and reads their metrics (see the module docstring). `initial`:
    the start plan, whose layout a run that keeps only its surviving replicas' share (`kept`,
    the torchft_like baseline) batches by."""

    def __init__(self, cfg: Config, rt, data: DataPipeline, initial: Plan, clock: StepClock):
        self.cfg, self.rt, self.data, self.initial, self.clock = cfg, rt, data, initial, clock

    def dispatch(self, ls: LoopState, due, redo: bool, t_run: float) -> tuple[Any, InFlight]:
        """Run one step on `ls.pos` (inside the step's guard): batch, train, snapshot,
        evaluation; `due`: the fault events injected after its dispatch; `t_run`: when the run
        began (the timeline's startup ends at the first dispatch)."""
        pos = ls.pos
        step, plan, exe = pos.step, pos.plan, pos.exe
        _, idx = self.data.step_ids(step)
        host_batch = self.batch(step, plan, pos.kept)
        t0 = time.perf_counter()
        if not ls.timeline.startup_s:
            ls.timeline.startup_s = t0 - t_run
        every = self.cfg.train.eval_every
        evaluate = every and ((step + 1) % every == 0 or step + 1 == self.cfg.train.steps)
        # the evaluation's batches and executable before the step's collectives are in flight:
        # its first use compiles, and a compile on the main thread while a dead peer held the
        # step's collectives kept the survivors from leaving them until it ended (their abort
        # waits for the main thread, which might post a collective: `aborts`; 1.4 s of detection
        # in experiments/RESULTS.md, "The MTTR fuzz")
        evals_in = self._eval_inputs(exe, plan, pos.kept, pos.state) if evaluate else None
        batch = exe.put_batch(host_batch.arrays())
        new_state, met = exe.train(pos.state, batch)
        seq = None
        if not self.rt.step_sync:  # (there a step has finished when it is read)
            ls.seq += 1
            seq = ls.seq
            self.clock.watch(seq, met["loss"])
        exe.runs += 1
        for x in jax.tree.leaves(met):  # queued now, right behind the step: read later without
            x.copy_to_host_async()  # waiting for the steps dispatched after it
        self.rt.inject(due, "after_dispatch")
        ls.pool.take(new_state, step + 1)
        evals = None
        if evals_in is not None:
            evals = [fn(new_state.params, b) for fn, b in evals_in]
        # a runtime whose steps complete in their guard waits for the snapshot's copies too; the
        # others leave them running beside the next step
        self.rt.commit((new_state, met, evals, ls.pool.in_flight() if self.rt.step_sync else ()))
        processed = int((host_batch.weights > 0).sum())
        flight = InFlight(
            step, plan, met, t0, exe.layout.checksum_keys, processed, DataPipeline.digest(idx),
            redo, evals, float((host_batch.counts * host_batch.weights).sum()), seq,
        )
        return new_state, flight

    def flush(self, ls: LoopState, mw: JsonlWriter, ew: Emitter) -> None:
        """Read the steps in flight and log them."""
        while ls.inflight:
            self.read(ls, ls.inflight.popleft(), mw, ew)

    def read(self, ls: LoopState, f: InFlight, mw: JsonlWriter, ew: Emitter) -> None:
        """Read step `f`'s metrics into `ls`, and write, display and hand them to the hooks."""
        scalars = host_values(
            self.rt, (f.met["loss"], f.met["grad_norm"], f.met["checksums"], f.evals),
            f.plan.device_ids,
        )
        loss, gnorm = float(scalars[0]), float(scalars[1])
        ls.good = checksum.rows_to_host(f.keys, scalars[2])
        # a step's time: from its dispatch (or the end of the step before) to when it had run
        t_read = time.perf_counter()
        t_done = self.clock.finished(f.seq) if f.seq is not None else None
        t_done = t_read if t_done is None else min(t_done, t_read)
        dt = t_done - max(f.t0, ls.t_done)
        if not ls.losses:
            ls.t_first_done = t_done
        ls.t_done = t_done
        ls.timeline.step(f.plan.name, dt, f.redo)
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {f.step}")
        ls.losses[f.step] = loss
        ls.digests[f.step] = f.digest
        rec = {
            "step": f.step,
            "loss": loss,
            "global_batch": f.processed,
            "tokens": int(round(f.tokens)),
            "n_devices": f.plan.n_devices,
            "n_processes": len({self.rt.process_of(d) for d in f.plan.device_ids}),
            "plan": f.plan.name,
            "step_time_s": dt,
            "grad_norm": gnorm,
            "batch_digest": f.digest,
            # the state this step produced, as `end`'s state_digest says it of the last one: two
            # runs compare step by step, bit for bit (`elasjax compare`, elasjax.bench.bitwise)
            "state_digest": checksum.digest(ls.good),
        }
        if f.redo:
            rec["redo"] = True
        if f.evals is not None:
            tot = sum(float(t) for t, _ in scalars[3])
            n = sum(float(c) for _, c in scalars[3])
            ls.evals[f.step] = rec["eval_loss"] = tot / n
        mw.write(rec)
        ew.display.update(f.step + 1, loss, f.plan)
        self.rt.log(f"step {f.step}: loss {loss:.6f} on {f.plan.name} ({dt:.3f}s)")
        ew.step(rec)

    def _eval_inputs(self, exe, plan: Plan, kept, state) -> list:
        """The held-out batches on the devices, each with the evaluation's executable (compiled
        for `state`'s parameters, whose shapes and shardings the step keeps); its runs give the
        per-batch (sum, count) arrays, read later."""
        out = []
        for i in range(self.cfg.train.eval_batches):
            hb = self._subset(self.data.eval_batch(i, self._layout_plan(plan, kept)), kept)
            batch = exe.put_batch(hb.arrays())
            out.append((exe.eval_for(state.params, batch), batch))
        return out

    # -- batches (torchft_like processes only the surviving replicas' share) ---------------------

    def _layout_plan(self, plan: Plan, kept) -> Plan:
        return self.initial if kept is not None else plan

    def _subset(self, hb, kept):
        """Keep the columns of the `kept` replicas of the initial layout (torchft_like)."""
        if kept is None:
            return hb
        b = self.initial.micro_batch
        return hb.columns(np.concatenate([np.arange(r * b, (r + 1) * b) for r in kept]))

    def batch(self, step: int, plan: Plan, kept):
        """Step `step`'s host batch for `plan` (the samples of the step, whatever the plan)."""
        return self._subset(self.data.batch(step, self._layout_plan(plan, kept)), kept)
