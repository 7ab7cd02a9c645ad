"""The training loop: plan -> mesh -> state -> compiled step, for any runtime.

One loop drives both runtimes (`elasjax.runtime`): a single process with fake devices and
simulated failures, and the multi-controller runtime of `elasjax launch`, where a failure is a
process that dies. Each step runs in a runtime `guard`; a failure inside it raises
`DeviceFailure` on every survivor, and the loop hands it to the one recovery path
(`elasjax.loop.recovery`), then runs the step again on the new plan with the same samples and keys.
Devices that return (a schedule's `join`) join at a step boundary; the run grows onto them with
a background compile and a cut-over (`elasjax.loop.cutover`).

The loop is the one writer of its state (`loopstate.LoopState`: where training stands, the
snapshot pool, the pending cut-over, the run's record); its collaborators are given what they
need and return what they did: `ExecutableSource` (executables, the standby set),
`Contingencies` (the plans after the likely next failures), `TransitionPlanner` (transfers
planned ahead), `Recoverer`, `Cutovers` (growth and cut-over), `Admissions` (rejoins), `Stepper`
(a step's batch, dispatch and metrics), `Preparations` (the standby and the transitions of the
likely next failures set going, waited for, announced).

A step's metrics are read `stepping.READ_BEHIND` steps late, so the devices stay busy while the
host prepares the next batches; steps that need the values at once are read at once: the first
step after a recovery (its time is part of the MTTR), evaluation and checkpoint steps, and the
last step. Recovery first reads the step in flight, so it always verifies against the checksums
of the exact state it rebuilds.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import optax

from ..compilation.executables import ExecutableCache
from ..compilation.shared import SharedBuilds
from ..compilation.source import ExecutableSource
from ..compilation.standby import StandbyCompiler
from ..compilation.worker import CompileWorker, unavailable
from ..config import (
    Config,
    ConfigError,
    dump,
    grow_standby,
    mode_line,
    standby_depth,
    standby_on,
    with_optimizer_object,
)
from ..core.counters import CompileCounter
from ..core.rng import check_backend_config
from ..layout.state import StateFactory, check_elementwise, choose_optimizer
from ..observe.events import (
    Emitter,
    ErrorEvent,
    Hook,
    LOCAL_TYPES,
    WarningEvent,
)
from ..observe.metrics import JsonlWriter, RecoveryEvent, StepClock, paces
from ..observe.report import (
    Progress,
    join_line,
    migration_line,
    recovery_line,
)
from ..observe.tensorboard import TensorBoardWriter
from ..plan.contingencies import Contingencies
from ..plan.planner import initial_plan, one_device
from ..runtime.base import Runtime
from ..runtime.faults import IN_PROCESS, resolve_schedule
from ..runtime.inprocess import DeviceFailure, InProcessRuntime
from ..runtime.membership import AdmissionInterruptedError, Admitted
from ..transfer.checkpoint import Checkpointer, form_of
from ..transfer.snapshot import SnapshotPool, check_coverable, prepare_checksums
from .accounts import RunSummary, UnprotectedStateWarning, announce, conclude
from .admission import Admissions
from .cutover import Cutovers
from .data import DataPipeline
from .loopstate import LoopState
from .prepare import Preparations
from .recovery import (
    Position,
    Recoverer,
    RecoveryVerificationError,
    TransitionPlanner,
)
from .start import start
from .stepping import READ_BEHIND, InFlight, Stepper

__all__ = ["RecoveryEvent", "RecoveryVerificationError", "RunSummary", "Trainer",
           "UnprotectedStateWarning", "run"]


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path`, for every executable (process-wide: JAX
    keeps this in its global config)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(Path(path).absolute()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def donation(cfg: Config, rt) -> tuple[bool, bool]:
    """(does the train step donate its input state, do the snapshots' checksums make their
    copies too). Executables loaded from serialized form (`standby.rebind`, the persistent
    compilation cache) never donate: a train step deserialized onto XLA:CPU that donates
    deadlocks its in-process collective rendezvous within a few steps ("only 6 of 7 arrived"),
    while the same program without donation runs on (experiments/probe_loaded_donation.py
    reproduces both). Snapshots copied by their checksums' program (`SnapshotPool.fusion_helps`:
    one process on the CPU backend) read the state in a program queued before the next step:
    that step must not donate it either. Donation only saves memory; the values are the same."""
    snap = cfg.snapshot.resolved(rt.topology.n_hosts, len(rt.topology.device_ids))
    fused = bool((snap.buddy or snap.host) and SnapshotPool.fusion_helps(rt))
    donate = rt.donate and not (cfg.standby.rebind or cfg.standby.cache_dir or fused)
    return donate, fused


class Trainer:
    """Trains `cfg` on `runtime` (default: this process's devices, simulated failures)."""

    def __init__(
        self,
        cfg: Config,
        out_dir: str | Path | None = None,
        *,
        runtime: Runtime | None = None,
        progress: bool = False,
        exe_cache: ExecutableCache | None = None,
        optimizer: optax.GradientTransformation | None = None,
        hooks: Sequence[Hook] = (),
    ):
        check_backend_config()
        if optimizer is not None:
            cfg = with_optimizer_object(cfg)
        if cfg.standby.cache_dir:
            enable_compilation_cache(cfg.standby.cache_dir)
        self.rt = runtime if runtime is not None else InProcessRuntime(cfg)
        self._owns_rt = runtime is None  # closed (its threads ended) when the run ends
        self.hooks = list(hooks)
        self.emit = Emitter(None, hooks=self.hooks)  # `run` gives it its file and process
        self.cfg = cfg
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress = progress and self.rt.writer
        self.devices = self.rt.devices
        self.topo = self.rt.topology
        self.schedule = resolve_schedule(cfg.faults, self.topo, cfg.train.steps, self.rt.kind,
                                         cfg.recovery.worker_restarts)
        if cfg.recovery.worker_restarts and not self.rt.rejoins:
            raise ConfigError(
                f"config 'recovery.worker_restarts' = {cfg.recovery.worker_restarts} restarts "
                f"processes of `elasjax launch`; the {self.rt.kind} runtime has none; allowed "
                "values here: 0")
        if cfg.recovery.grow_standby is True and not self.rt.devices_return:
            raise ConfigError(
                f"config 'recovery.grow_standby' = true needs a runtime where devices can return; "
                f"the {self.rt.kind} runtime has none yet; allowed values here: false"
            )
        self.initial = initial_plan(self.topo, cfg)
        tx, self.optimizer_name, self.optimizer_source = choose_optimizer(cfg, optimizer)
        # a `train.optimizer` is keyed by name in `cfg.train`; an object passed here by itself
        self.factory = StateFactory(cfg, tx, custom_tx=self.optimizer_source == "python")
        custom = self.optimizer_source != "builtin"
        if custom and cfg.zero.stage > 0:
            check_elementwise(self.factory, self.initial)
        self.data = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
        self.exe_cache = exe_cache if exe_cache is not None else ExecutableCache()
        self.donate, self._fused_snapshots = donation(cfg, self.rt)
        check_coverable(cfg.snapshot, self.topo)
        adm = self.rt.admission  # a restarted process: opened once admitted (`_welcome`)
        self.ckpt = (Checkpointer(cfg.checkpoint, self.rt.processes(), joining=adm is not None,
                                  generation=adm.loop.ckpt_generation if adm else 0)
                     if cfg.checkpoint.dir is not None else None)
        self.compiles = CompileCounter()
        # a runtime that admits restarted processes (`admission`) may grow at any step
        grows = (any(e.is_join for e in self.schedule) or grow_standby(cfg)
                 or self.rt.rejoins)
        # `standby.enabled: auto` is on where a compile worker process builds the plans, and
        # where the job's processes share compiles (`config.standby_on`): the built-in GPT and
        # optimizer, which every process names alike in the shared key (`SharedBuilds.key`; a
        # user's model or optimizer object may not); `no_worker` says why a worker cannot
        # build them
        shares = self.rt.shares_compiles and cfg.model.type == "gpt" and not custom
        self.no_worker = unavailable(cfg, custom, self.rt.kind != IN_PROCESS,
                                     shares and cfg.standby.share_compiles)
        self.standby_on = standby_on(cfg, self.no_worker, shares)
        self.source = ExecutableSource(
            cfg, self.factory, self.devices, self.exe_cache, donate=self.donate,
            background=self.standby_on or cfg.recovery.migration == "async" or grows,
            log=self.rt.log, no_worker=self.no_worker,
            shared=(SharedBuilds(self.rt.client, self.rt.me, self.rt.peer_gone, self.rt.log)
                    if self.rt.shares_compiles and cfg.standby.share_compiles else None),
            # the snapshot checksums of each standby plan's pool, compiled with it
            prepare=lambda exe: prepare_checksums(cfg.snapshot, self.topo, exe.layout.abstract,
                                                  exe.state_shardings, exe.mesh,
                                                  fused=self._fused_snapshots),
        )
        self.contingencies = Contingencies(cfg, self.topo, self.initial,
                                           device_failures=self.rt.device_failures,
                                           can_grow=self.rt.devices_return,
                                           standby=self.standby_on,
                                           depth=standby_depth(cfg, shares))
        self.transitions = TransitionPlanner(cfg, self.factory, self.devices, self.contingencies,
                                             where=self.rt.process_of)
        self.recovery = Recoverer(cfg, self.rt, self.topo, self.factory, self.source,
                                 self.contingencies, self.transitions, self.ckpt, self.compiles)
        self.cutovers = Cutovers(cfg, self.rt, self.topo, self.initial, self.source,
                                 self.transitions)
        self.admissions = Admissions(cfg, self.rt, self.factory, self.source, self.transitions,
                                     self.cutovers)
        self._t_run = 0.0
        self.loop: LoopState | None = None  # the run's loop state, once it runs
        self.clock = StepClock()  # when each step finished (read later)
        self.steps = Stepper(cfg, self.rt, self.data, self.initial, self.clock)
        self.prep = Preparations(cfg, self.rt, self.source, self.contingencies, self.transitions,
                                 on=self.standby_on, no_worker=self.no_worker,
                                 progress=self.progress)
        self._gc_held = False  # the collector is off for a recovery (`_hold_gc`)

    @property
    def standby(self) -> StandbyCompiler | None:
        return self.source.standby

    @property
    def worker(self) -> CompileWorker | None:
        return self.source.worker

    @property
    def loop_s(self) -> float:
        """Wall time from the first step's completion to the last one's, as the host saw them."""
        return self.loop.loop_s if self.loop is not None else 0.0

    @property
    def pool(self) -> SnapshotPool | None:
        """The current plan's snapshot pool (the loop state's), once the run has started."""
        return self.loop.pool if self.loop is not None else None

    def _new_pool(self) -> SnapshotPool:
        """An empty snapshot pool (`SnapshotPool.configure` chooses its snapshots on a plan)."""
        return SnapshotPool(self.cfg.snapshot, self.topo, self.rt, donated=self.donate,
                            fused=self._fused_snapshots)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        self._t_run = time.perf_counter()
        out = self.out_dir
        if out is not None and self.rt.writer:
            out.mkdir(parents=True, exist_ok=True)
            python_tx = self.optimizer_name if self.optimizer_source == "python" else None
            (out / "config.yaml").write_text(dump(self.cfg, python_tx))
        # the files are written by the runtime's writer; when it dies, the next one takes over
        writes = lambda: self.rt.writer  # noqa: E731
        mw = JsonlWriter(out / "metrics.jsonl" if out else None, writes)
        ew = self.emit = Emitter(JsonlWriter(out / "events.jsonl" if out else None, writes,
                                             LOCAL_TYPES), None,
                                 self.rt.log, self.hooks, self.rt.me)
        tb = None
        try:
            # TensorBoard scalars (`metrics.tensorboard_dir`), from the process writing the files
            tb = TensorBoardWriter.from_config(self.cfg) if self.rt.writer else None
            ew.hooks += [tb] if tb is not None else []
            with self.compiles:
                return self._run(mw, ew)
        except Exception as e:
            # to the file only: the error reaches the caller, and a hook may be what raised it
            ew.writer.write(ErrorEvent(type(e).__name__, str(e), self.rt.me).to_json())
            raise
        finally:
            self._release_gc()
            self.source.release_background()  # a recovery that raised held them
            mw.close()
            ew.close()
            if tb is not None:
                tb.close()
            if self.ckpt is not None:
                self.ckpt.close()
            # launch's workers end with os._exit (`launch.process._leave`): a standby build
            # under way in this process is dropped, not waited for
            self.source.close(wait_s=60.0 if self.rt.kind == IN_PROCESS else 0.0)
            self.transitions.close()
            self.clock.close()
            if self._owns_rt:
                self.rt.close()  # waits for a snapshot under way

    def _run(self, mw: JsonlWriter, ew: Emitter) -> RunSummary:
        T = self.cfg.train.steps
        if self.rt.admission is not None:  # a restarted process rejoins
            ls = self._rejoin(mw, ew)
        else:
            pos, pool = self._start(ew)
            ls = LoopState(pos, list(self.schedule), pool=pool, good=pos.good,
                           standby_building=self.standby_on and not self.cfg.standby.wait_at_start)
            ls.stand_on(pos.plan)
        self.loop = ls
        bar = ew.display = Progress(T, enabled=self.progress)
        with bar:
            while ls.pos.step < T:
                step = ls.pos.step
                self._joins(ls, step, ew)
                try:
                    self._admit(ls, step, mw, ew)
                    cutover_now = self._cutover_if_due(ls, step, mw, ew)
                    new_state, flight = self._step(ls, step, cutover_now)
                except DeviceFailure as failure:
                    self._on_failure(ls, step, failure, mw)
                    continue
                self._after_step(ls, step, new_state, flight, mw, ew)
        return self._finish(ls, mw, ew)

    def _joins(self, ls: LoopState, step: int, ew: Emitter) -> None:
        """Devices returning at this step boundary, before the step's failures."""
        joining = [e for e in ls.pending if e.is_join and e.at_step == step]
        if joining:
            ls.pending = [e for e in ls.pending if e not in joining]
            ls.pos, jev, ls.cutover = self.cutovers.join(ls.pos, joining, paces(ls.timeline),
                                                         ls.cutover, ls.stood_on)
            if not jev["grow"] and ls.cutover is None:
                ls.protect_due = True  # the likely failures' plans changed
            ls.joins.append(jev)
            ew.emit(jev, join_line(jev))

    def _admit(self, ls: LoopState, step: int, mw: JsonlWriter, ew: Emitter) -> None:
        """Admit the restarted processes that asked to rejoin (`runtime.membership`; the last
        step's verdict named them, so every live process admits at this boundary), unless a
        recovery or an async recovery's migration is open (then at a later boundary; a pending
        growth is re-planned by the join)."""
        procs = self.rt.joiners()
        pc = ls.cutover
        # a pending growth does not hold an admission back: the join re-plans it over every
        # returned device (`Cutovers.join`, `replaces_pending`); a newcomer waits at most its
        # `init_timeout_s`, and a growth may stay pending for `recovery.grow_wait_steps` steps
        # of a loaded job (a second newcomer of one recovery was refused so, never admitted)
        if not procs or ls.open_event is not None or (pc is not None and pc.kind != "growth"):
            return
        package = ls.package((mw.lines, ew.writer.lines), time.perf_counter() - self._t_run)
        if self.ckpt is not None:
            package = dataclasses.replace(package, ckpt_generation=self.ckpt.generation)
        self._welcome(ls, self.rt.admit(package), ew)

    def _rejoin(self, mw: JsonlWriter, ew: Emitter) -> LoopState:
        """A restarted process's start: the loop as its admission describes it (what it has
        seen and written included), then the admission's steps with the live processes
        (`_welcome`)."""
        adm = self.rt.admission
        seen, now = adm.loop.seen, time.perf_counter()
        ls = LoopState.arrived(adm.loop, self._new_pool(), now)
        mw.continue_at(seen.lines[0])
        ew.writer.continue_at(seen.lines[1])
        self._t_run = now - seen.run_s
        counters = adm.counters
        # every newcomer of this admission, as the live processes see it (two admitted at one
        # boundary must not each grow onto its own devices alone: the processes would pend
        # different plans and never agree on a cut-over)
        admitted = Admitted(counters.admitted, counters.admitted_devices, counters.generation,
                            None)
        self.rt.log(f"admitted at step {ls.pos.step} (plan {ls.pos.plan.name}, client "
                    f"generation {counters.generation})")
        try:
            self._welcome(ls, admitted, ew)
        except DeviceFailure as f:
            raise AdmissionInterruptedError(ls.pos.step, f.cause) from f
        return ls

    def _welcome(self, ls: LoopState, admitted: Admitted, ew: Emitter) -> None:
        """The admission's steps on every process (`admission`): executables shipped to the
        newcomers, the state onto the new client, the newcomers' devices live (a growth
        pending). Its time is a training pause."""
        t0 = time.perf_counter()
        procs = list(admitted.processes)
        here = ls.verified()
        with self.rt.guard("admit/ship"):
            pos = self.admissions.ship(here, procs, set(here.live) | set(admitted.devices),
                                       ls.stood_on.values())
        t1 = time.perf_counter()
        with self.rt.guard("admit/state"):
            self._admission_faults(ls)
            done = self.admissions.settle(pos, ls.pool, admitted, paces(ls.timeline),
                                          ls.cutover, ls.stood_on)
        ls.pos, ls.pool, ls.cutover = done.pos, done.pool, done.pending
        if self.ckpt is not None:  # the grown job's processes save from now on, the newcomer's
            self.ckpt.reopen(self.rt.processes())  # first manager included
        t2 = time.perf_counter()
        jev = done.event
        jev.rejoined = {"processes": procs, "generation": admitted.generation,
                        "admit_s": admitted.admit_s, "ship_s": t1 - t0, "settle_s": t2 - t1}
        if not jev.grow and ls.cutover is None:
            ls.protect_due = True
        ls.joins.append(jev)
        ls.timeline.pause(t2 - t0 + (admitted.admit_s or 0.0))
        ew.emit(jev, join_line(jev))

    def _admission_faults(self, ls: LoopState) -> None:
        """The faults of phase `admission` due now (`FaultConfig.phase`): every process drops
        them from its schedule, and a process the job started with that one names is killed
        here, as the state's move begins (a restarted process never is: `ScriptJob` does the
        same for a script)."""
        due = [e for e in ls.pending if e.phase == "admission" and e.at_step <= ls.pos.step]
        if due:
            ls.pending = [e for e in ls.pending if e not in due]
            if self.rt.admission is None:
                self.rt.inject(due, "admission")

    def _cutover_if_due(self, ls: LoopState, step: int, mw: JsonlWriter, ew: Emitter) -> bool:
        """Cut over to the pending optimal (or bigger) plan if every process has it ready;
        True if it did. A background compile that failed abandons the cut-over (an event)."""
        if ls.cutover is None:
            return False
        with self.rt.guard("cutover"):
            due_now, abandoned, ls.cutover = self.cutovers.due(ls.cutover, step)
        if abandoned is not None:
            ls.abandoned.append(abandoned)
            ew.emit(abandoned, (
                f"step {step}: cut-over to {abandoned.optimal_plan} "
                f"abandoned, its compile failed: {abandoned.errors}"))
        if not due_now:
            return False
        self.steps.flush(ls, mw, ew)
        done = self.cutovers.cutover(ls.verified(), ls.pool, ls.cutover)
        ls.pos, ls.pool, ls.cutover, mig = done.pos, done.pool, done.pending, done.event
        ls.transfer_logs.append(done.log)
        if ls.cutover is None:  # (else the next cut-over's plan is all that matters)
            self.prep.protect(ls.pos, ls.pool)
        ls.timeline.cutover(ls.pos.plan.name, mig.stall_s)
        (ls.growths if mig.kind == "growth" else ls.migrations).append(mig)
        ew.emit(mig, migration_line(mig))
        ls.stand_on(ls.pos.plan)
        return True

    def _step(self, ls: LoopState, step: int, cutover_now: bool) -> tuple[Any, InFlight]:
        """Inject this step's scheduled faults, then dispatch it (inside the step's guard)."""
        pos = ls.pos
        due = [e for e in ls.pending if e.at_step == step and e.phase == "step"
               and not e.is_join] + [
            e for e in ls.pending if cutover_now and e.phase == "cutover" and e.at_step <= step
        ] + [  # the first step after the recovery of their step's failure
            e for e in ls.pending if e.phase == "recovery/first_step"
            and ls.open_event is not None and ls.open_event.step == e.at_step
        ]
        if ls.open_event is not None and pos.step == ls.open_event.resumed_at_step:
            ls.open_event.first_step_first_run = pos.exe.runs == 0 and not pos.exe.warm_s
        with self.rt.guard("step"):
            # (the pool's buffers only when a fault is due: reading them waits for the snapshot
            # under way, which otherwise runs beside the next step)
            self.rt.inject(due, "before_step", [pos.state, ls.pool.device_buffers()] if due else [])
            new_state, flight = self.steps.dispatch(ls, due, step < ls.redo_until, self._t_run)
        ls.pending = [e for e in ls.pending if e not in due]
        return new_state, flight

    def _on_failure(self, ls: LoopState, step: int, failure: DeviceFailure,
                    mw: JsonlWriter) -> None:
        """Recover from a failure in `step` (or in the boundary before it); the step runs again
        on the new plan. A failure in a recovery's first step continues that recovery's event."""
        t_failed = time.perf_counter() - failure.detect_s
        self._hold_gc()
        ls.pool.abort(step + 1)  # that step's snapshot, if it was taken
        self.steps.flush(ls, mw, self.emit)  # the checksums of the state recovery rebuilds
        pos = ls.verified()
        during = [e for e in ls.pending if e.at_step == step and e.phase.startswith("recovery/")
                  and e.phase != "recovery/first_step"]
        unfinished = ls.open_event  # a recovery whose first step just failed
        # a failure re-plans from scratch (returned devices too): nothing stays pending, but a
        # growth that a retry interrupts (below)
        growing = ls.cutover if ls.cutover is not None and ls.cutover.kind == "growth" else None
        ls.cutover = None
        r = self.recovery.recover(pos, ls.pool, failure, during)
        if self.cfg.deterministic and (r.pos.plan.tensor != pos.plan.tensor
                                       or one_device(r.pos.plan) != one_device(pos.plan)):
            # `planner.replan`: a mode only the default chose gives way rather than end the run
            keeps = (f"tensor degree {pos.plan.tensor}" if r.pos.plan.tensor != pos.plan.tensor
                     else "as many devices as the bits need (`planner.one_device`)")
            msg = (f"step {step}: no plan with {keeps} fits the "
                   f"{len(r.pos.live)} live devices; the run goes on as {r.pos.plan.name}, no "
                   "longer bitwise equal to the fault-free run (within 1e-5 per step, as in the "
                   "default mode)")
            self.emit.emit(WarningEvent("train.deterministic", msg), f"warning: {msg}")
        ls.pos, ls.open_event, ls.pool = r.pos, r.event, r.pool
        ls.transfer_logs.append(r.log)
        if r.cutover is not None:
            ls.cutover = self.cutovers.pend(r.cutover, r.pos)
        elif growing is not None and r.pos.plan == pos.plan and r.pos.live == pos.live:
            ls.cutover = self.cutovers.pend(growing, r.pos)  # a retry: the growth stays pending
        else:
            ls.protect_due = True
        if unfinished is None:  # its first step's record comes after it
            ls.recovery_at = len(ls.timeline.items)
        else:  # still one recovery: it ends at a good step
            ls.open_event = unfinished.continued_by(
                ls.open_event, max(0.0, t_failed - ls.recovered_at))
        ls.recovered_at = time.perf_counter()  # the first step's time counts from here
        # drop the events this recovery consumed (or that can no longer fire); later failures of
        # devices that will have returned by then stay
        gone = set(self.topo.device_ids) - set(ls.pos.live)
        ls.pending = [e for e in ls.pending if e.is_join or e.at_step > step
                      or not set(e.device_ids) <= gone]
        ls.redo_until = max(ls.redo_until, step)
        ls.stand_on(ls.pos.plan)

    def _after_step(self, ls: LoopState, step: int, new_state, flight: InFlight,
                    mw: JsonlWriter, ew: Emitter) -> None:
        """The step was dispatched: read the oldest steps' metrics, close a recovery at its first
        good step, refresh the standby after one, checkpoint when due."""
        T = self.cfg.train.steps
        pos = ls.pos = dataclasses.replace(ls.pos, step=step + 1, state=new_state, good=None)
        ls.inflight.append(flight)
        while len(ls.inflight) > READ_BEHIND:  # the oldest has finished by now
            self.steps.read(ls, ls.inflight.popleft(), mw, ew)
        if (self.rt.step_sync or ls.open_event is not None or flight.evals is not None
                or pos.step == T or (self.ckpt is not None and self.ckpt.due(pos.step))):
            self.steps.flush(ls, mw, ew)
        if ls.open_event is not None:
            self._close_recovery(ls, ew)
        elif ls.protect_due:
            self.prep.protect(ls.pos, ls.pool)
            ls.protect_due = False
            ls.standby_building = self.standby_on
            if self.cfg.standby.wait_after_recovery and pos.step < T:  # steps left
                self.steps.flush(ls, mw, ew)
                ls.timeline.pause(self.prep.wait(ew, pos.step))
                ls.standby_building = False
        elif ls.standby_building and self.standby.wait_all(timeout=0):
            ls.standby_building = False
            self.prep.ready(ew, pos.step, 0.0, 0.0, f"step {pos.step}: standby ready, built "
                                "in the background without pausing training")
        else:  # a standby executable built in the background runs once before it is needed
            self.source.warm_built(pos.live)
        if self.ckpt is not None and self.ckpt.due(pos.step):
            with self.rt.guard("checkpoint"):
                self.ckpt.save(pos.step, pos.state, ls.good, form_of(pos.exe.plan))

    def _close_recovery(self, ls: LoopState, ew: Emitter) -> None:
        """The recovery's first step was read: its MTTR ends here (batch and dispatch included)."""
        ev, ls.open_event = ls.open_event, None
        ev.first_step_s = time.perf_counter() - ls.recovered_at
        ev.compiles = self.compiles.count - ev.compiles
        ls.recoveries.append(ev)
        ls.timeline.items.insert(ls.recovery_at, ("recovery", ev))
        if self.rt.writer:
            ev.detail.update(self.rt.detection_report(ev.detail.get("incident")))
        ew.emit(ev, recovery_line(ev))
        self.source.release_background()
        self._release_gc()

    def _finish(self, ls: LoopState, mw: JsonlWriter, ew: Emitter) -> RunSummary:
        """The last reads, then the run's account (`accounts.conclude`)."""
        self.steps.flush(ls, mw, ew)
        ls.pool.complete()  # the last step's snapshot, taken beside the loop, is filed
        return conclude(ls, ew, self.cfg, self.rt, source=self.source,
                        transitions=self.transitions, initial=self.initial,
                        run_s=time.perf_counter() - self._t_run, out_dir=self.out_dir,
                        progress=self.progress)

    def _hold_gc(self) -> None:
        """No garbage collection from a failure to the recovery's first good step: Python's
        cyclic collector stops the loop while it scans, and in the demo a full collection took
        about as long as a whole standby hit (experiments/RESULTS.md, "`--standby` on the
        demo"). The garbage is collected after the first good
        step (`_release_gc`). A process that turned the collector off keeps it off."""
        if gc.isenabled():
            gc.disable()
            self._gc_held = True

    def _release_gc(self) -> None:
        if self._gc_held:
            self._gc_held = False
            gc.enable()

    # -- start ----------------------------------------------------------------------------------

    def _start(self, ew: Emitter) -> tuple[Position, SnapshotPool]:
        """The initial position and its snapshot pool (`start.start`: a fresh start or a
        checkpoint resume, on whoever is alive); then the standby and the transitions of its
        likely failures set going (`prepare.Preparations`), and the start announced
        (`accounts.announce`)."""
        s = start(self.cfg, self.rt, self.topo, self.initial, self.source, self.factory,
                  self.ckpt, self._new_pool)
        n_ahead, n_programs, line = self.prep.start(s.pos, s.pool)
        if self.cfg.standby.wait_at_start:
            self.prep.wait(ew, None)
        announce(
            s, ew, self.cfg, self.rt, ckpt_dir=self.ckpt.dir if self.ckpt else None,
            n_params=self.factory.n_params, optimizer=self.optimizer_name,
            mode=mode_line(self.cfg, self.optimizer_source == "python"),
            standby={"on": self.standby_on, "enabled": self.cfg.standby.enabled,
                     "plans": n_ahead if self.standby_on else 0,
                     "programs": n_programs if self.standby_on else 0,
                     "compiler": None if not self.standby_on else
                     "process" if self.worker is not None else "thread"},
            standby_line=line, faults=[f"step {e.at_step}: {e.spec}" for e in self.schedule],
            progress=self.progress)
        return s.pos, s.pool


def run(
    cfg: Config,
    out_dir: str | Path | None = None,
    *,
    progress: bool = False,
    exe_cache: ExecutableCache | None = None,
    runtime: Runtime | None = None,
    optimizer: optax.GradientTransformation | None = None,
    hooks: Sequence[Hook] = (),
) -> RunSummary:
    """Train the config's model with failures handled as they come (the loop entry point):
    outputs under `out_dir` (config.yaml, metrics.jsonl, events.jsonl), a summary returned.
    `runtime`: where it runs (default: this process, failures simulated). `optimizer`: any
    optax transformation instead of `train`'s AdamW (with `zero.stage` >= 1 it must keep its
    meaning on ZeRO storage: checked at start, `OptimizerMeaningError` otherwise); the config
    may name one instead (`train.optimizer`), not both. With either, `train.lr`, `warmup_steps`,
    `weight_decay` and (outside deterministic mode) `grad_clip` must keep their defaults
    (`ConfigError` otherwise). Deterministic mode clips gradients itself (`train.grad_clip`), so
    leave clipping out of `optimizer` there.
    `hooks`: callables given each step's `StepInfo` and each event (`elasjax.observe.events`)."""
    return Trainer(
        cfg, out_dir, progress=progress, exe_cache=exe_cache, runtime=runtime, optimizer=optimizer,
        hooks=hooks,
    ).run()
