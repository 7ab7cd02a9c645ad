"""The training loop: plan -> mesh -> state -> compiled step, and recovery as a plan transition.

At every step boundary the loop applies the faults scheduled for that step. A recovery is the
timeline of DESIGN section 4, each phase timed:

`detect` (probe which devices lost their buffers) -> `plan` (the planner over the survivors) ->
`compile` (the new plan's executables) -> `transfer` (rebuild the state on the new mesh from live
sources: surviving data-parallel replicas; or, when a slice has none and a checkpoint is
configured, the newest Orbax checkpoint, losing the steps since) -> `verify` (checksums of the
rebuilt state against those of the last good state, computed on device) -> `first_step`.

A recovery that cannot be verified raises; a slice with no live copy and no checkpoint raises
`UnrecoverableStateError`. The run never continues with re-initialised or partly stale state.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from . import checksum
from .checkpoint import Checkpointer
from .config import Config, ConfigError, dump
from .data import DataPipeline
from .faults import FaultEvent, detect, inject, resolve_schedule
from .metrics import JsonlWriter
from .planner import Plan, Topology, fast_path_plan, initial_plan, replan
from .mesh import make_mesh
from .reshard import (
    Transfer,
    TransferLog,
    TransitionPlanCache,
    UnrecoverableStateError,
    describe_state,
    index_to_box,
    transition,
)
from .rng import check_backend_config
from .sharding import path_str
from .state import StateFactory, make_optimizer
from .reshard import ShardStore
from .snapshot import SnapshotPool
from .standby import BackgroundJobs, CompileCounter, StandbyCompiler
from .step import ExecutableCache, Executables


class RecoveryVerificationError(RuntimeError):
    """The rebuilt state's checksums differ from the last good state's."""


@dataclasses.dataclass
class RecoveryEvent:
    step: int
    failed_devices: list[int]
    fault: str
    from_plan: str
    to_plan: str
    rung: str
    bytes_moved: int
    transfers: int
    max_transfers_per_device: int
    bytes_lost: int
    steps_lost: int
    detect_s: float
    plan_s: float
    compile_s: float
    standby_hit: bool
    exe_cache_hit: bool
    transfer_s: float
    verify_s: float
    first_step_s: float = 0.0
    verified: bool = False
    resumed_at_step: int = 0
    bytes_kept_in_place: int = 0
    rungs: list[str] = dataclasses.field(default_factory=list)
    refused_snapshots: list[str] = dataclasses.field(default_factory=list)
    snapshot_setup_s: float = 0.0
    migration: str = "blocking"  # "blocking" | "async" (resumed on a fast path first)
    optimal_plan: str = ""
    strategy: str = "elastic"
    compiles: int = -1  # XLA compilations on the training thread from detection to first step
    transfer_plan_hit: bool = False  # the transition was planned before the failure
    transfer_plan_s: float = 0.0  # planning time inside transfer_s (0 on a hit)

    @property
    def mttr_s(self) -> float:
        return (
            self.detect_s
            + self.plan_s
            + self.compile_s
            + self.transfer_s
            + self.verify_s
            + self.first_step_s
        )

    def to_json(self) -> dict:
        d = {"type": "recovery", **dataclasses.asdict(self), "mttr_s": self.mttr_s}
        d["failure_simulation"] = "single-process: buffers deleted by the fault injector"
        return d


@dataclasses.dataclass
class RunSummary:
    out_dir: Path | None
    losses: dict[int, float]
    eval_losses: dict[int, float]
    recoveries: list[RecoveryEvent]
    plans: list[str]
    final_plan: Plan
    checksums: dict[str, str]
    sample_digests: dict[int, str]
    state: Any = None
    migrations: list[dict] = dataclasses.field(default_factory=list)
    # one per recovery and per cut-over, in order
    transfer_logs: list[TransferLog] = dataclasses.field(default_factory=list)

    @property
    def final_loss(self) -> float:
        return self.losses[max(self.losses)]


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path`, for every executable (process-wide: JAX
    keeps this in its global config)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(Path(path).absolute()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def job_devices(cfg: Config) -> list[jax.Device]:
    avail = jax.devices()
    n = len(avail) if cfg.parallel.devices == -1 else cfg.parallel.devices
    if n > len(avail):
        raise ConfigError(
            f"config 'parallel.devices' = {n} but only {len(avail)} devices are visible; allowed "
            f"values: -1, 1 .. {len(avail)} (for fake CPU devices set XLA_FLAGS="
            f"--xla_force_host_platform_device_count=N before JAX starts)"
        )
    return avail[:n]


class Trainer:
    def __init__(
        self,
        cfg: Config,
        out_dir: str | Path | None = None,
        *,
        progress: bool = False,
        exe_cache: ExecutableCache | None = None,
    ):
        check_backend_config()
        if cfg.standby.cache_dir:
            enable_compilation_cache(cfg.standby.cache_dir)
        self.cfg = cfg
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress = progress
        devs = job_devices(cfg)
        self.devices = {d.id: d for d in devs}
        self.topo = Topology(tuple(d.id for d in devs), cfg.parallel.devices_per_host)
        self.schedule = resolve_schedule(cfg.faults, self.topo, cfg.train.steps)
        self.initial = initial_plan(self.topo, cfg)
        self.factory = StateFactory(cfg, make_optimizer(cfg.train))
        self.data = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
        self.exe_cache = exe_cache if exe_cache is not None else ExecutableCache()
        self.ckpt = Checkpointer(cfg.checkpoint) if cfg.checkpoint.dir is not None else None
        self.dropped_checkpoints: list[int] = []
        self.pool = SnapshotPool(cfg.snapshot, self.topo)
        self.dead_hosts: set[int] = set()
        self.transfer_logs: list[TransferLog] = []
        self.standby: StandbyCompiler | None = None
        if cfg.standby.enabled or cfg.recovery.migration == "async":
            self.standby = StandbyCompiler(
                lambda plan: self.exe_cache.get(cfg, self.factory, plan, self.devices)[0],
                max_plans=max(cfg.standby.max_plans, 2),
            )
        self.pending_cutover: tuple[Plan, float, int] | None = None
        self.torchft_keep: tuple[int, ...] | None = None  # initial replicas still training
        self.compiles = CompileCounter()
        self._standby_due: tuple[Plan, set[int]] | None = None
        self.transition_plans = TransitionPlanCache()
        self.jobs = (
            BackgroundJobs("elasjax-transfer-plans") if cfg.recovery.prepare_transfers else None
        )

    # -- executables ----------------------------------------------------------------------------

    def executables(self, plan: Plan) -> tuple[Executables, bool, bool]:
        """(executables, already compiled in this process, compiled by the standby thread)."""
        if self.standby is not None:
            key = plan.compile_key
            exe = self.standby.get(key)
            if exe is not None:
                return exe, True, True
            if self.standby.pending(key):  # being compiled in the background: do not duplicate
                return self.standby.wait(key), False, True
        exe, hit = self.exe_cache.get(self.cfg, self.factory, plan, self.devices)
        return exe, hit, False

    def failure_candidates(self, plan: Plan, live: set[int]) -> list[tuple[set[int], set[int]]]:
        """The likeliest next failures of `plan`: (devices lost, hosts lost) for every single
        device and every single host."""
        fails = [({d}, set()) for d in plan.device_ids]
        fails += [
            (set(self.topo.host_devices(h)) & live, {h})
            for h in range(self.topo.n_hosts)
            if set(self.topo.host_devices(h)) & set(plan.device_ids)
        ]
        return fails

    def standby_candidates(self, plan: Plan, live: set[int]) -> list[Plan]:
        """Plans recovery would need after the likeliest next failures of `plan`
        (`failure_candidates`): their optimal plans with `standby.enabled`; the no-movement fast
        paths with `recovery.migration: async`."""
        out: list[Plan] = []
        for gone, _ in self.failure_candidates(plan, live):
            survivors = [d for d in self.topo.device_ids if d in live - gone]
            if not survivors:
                continue
            if self.cfg.recovery.migration == "async":
                fast = fast_path_plan(plan, survivors, self.cfg)
                if fast is not None:
                    out.append(fast)
            if self.cfg.standby.enabled:
                try:
                    out.append(replan(survivors, self.topo, self.cfg, plan, self.initial))
                except Exception:  # a failure the planner cannot serve needs no standby
                    pass
        keys = list(dict.fromkeys(p.compile_key for p in out))
        return keys[: max(self.cfg.standby.max_plans, 1)]

    def _recovery_plan(self, plan: Plan, survivors: list[int]) -> tuple[Plan, Plan]:
        """(plan to resume on, optimal plan) after a failure that leaves `survivors`."""
        optimal = replan(survivors, self.topo, self.cfg, plan, self.initial)
        if self.cfg.recovery.migration == "async" and self.cfg.recovery.strategy == "elastic":
            fast = fast_path_plan(plan, survivors, self.cfg)
            if fast is not None and fast != optimal:
                return fast, optimal
        return optimal, optimal

    def _prepare_transitions(self, plan: Plan, exe: Executables, state, live: set[int]) -> None:
        """Plan, in the background, the transitions recovery would run after each likely next
        failure of `plan` (`failure_candidates`), from shard descriptions: `transition` then
        finds them in `transition_plans` and only executes copies. Elastic strategy only."""
        if self.jobs is None or self.cfg.recovery.strategy != "elastic":
            return
        full = describe_state(state)  # metadata of the buffers only, read on this thread
        held = set(plan.device_ids) | set(plan.spare_ids)
        jobs = []
        for gone, hosts in self.failure_candidates(plan, live):
            survivors = [d for d in self.topo.device_ids if d in live - gone]
            if survivors:
                jobs.append(functools.partial(
                    self._prepare_one, full, plan, exe.layout, gone & held, survivors,
                    self.dead_hosts | hosts,
                ))
        self.jobs.replace(jobs)

    def _prepare_one(self, full, plan, old_layout, dead, survivors, dead_hosts) -> None:
        target, _ = self._recovery_plan(plan, survivors)
        self._prepare_move(full, dead, target, old_layout, self.pool.describe_sources(dead, dead_hosts))

    def _prepare_move(self, full, dead, target: Plan, old_layout, extra) -> None:
        store = dataclasses.replace(
            full, shards=[[s for s in leaf if s.device not in dead] for leaf in full.shards]
        )
        layout = self.factory.layout(target)
        mesh = make_mesh(target.mesh_shape, [self.devices[i] for i in target.device_ids])
        self.transition_plans.prepare(
            store, layout.shardings(mesh), extra, old_layout=old_layout, new_layout=layout
        )

    def _refresh_standby(self, plan: Plan, live: set[int]) -> None:
        if self.standby is not None:
            self.standby.submit(self.standby_candidates(plan, live))

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        cfg = self.cfg
        out = self.out_dir
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(dump(cfg))
        mw = JsonlWriter(out / "metrics.jsonl" if out else None)
        ew = JsonlWriter(out / "events.jsonl" if out else None)
        try:
            with self.compiles:
                return self._run(mw, ew)
        except Exception as e:
            ew.write({"type": "error", "error": type(e).__name__, "message": str(e)})
            raise
        finally:
            mw.close()
            ew.close()
            if self.ckpt is not None:
                self.ckpt.close()
            if self.standby is not None:
                self.standby.close()
            if self.jobs is not None:
                self.jobs.close()

    def _run(self, mw: JsonlWriter, ew: JsonlWriter) -> RunSummary:
        cfg, T = self.cfg, self.cfg.train.steps
        plan = self.initial
        exe, _, _ = self.executables(plan)
        step, state, good = self._start(exe)
        self._refresh_standby(plan, set(plan.device_ids) | set(plan.spare_ids))
        self._prepare_transitions(plan, exe, state, set(self.topo.device_ids))
        if self.standby is not None and cfg.standby.wait_at_start:
            t0 = time.perf_counter()
            self.standby.wait_all()
            ew.write({"type": "standby_ready", "plans": self.standby.compiled,
                      "wait_s": time.perf_counter() - t0, "compile_s": self.standby.compile_s})
        if self.jobs is not None and cfg.standby.wait_at_start:
            self.jobs.wait_idle()  # the likely transitions are planned before step 0, too
        migrations: list[dict] = []
        ew.write(
            {
                "type": "start",
                "step": step,
                "plan": plan.name,
                "plan_detail": plan.describe(),
                "devices": list(self.topo.device_ids),
                "devices_per_host": self.topo.devices_per_host,
                "compile_s": exe.compile_s,
                "n_params": self.factory.n_params,
                "resumed_from_checkpoint": step if cfg.checkpoint.resume_step is not None else None,
                "dropped_newer_checkpoints": self.dropped_checkpoints,
            }
        )
        live = set(self.topo.device_ids)
        pending = list(self.schedule)
        losses: dict[int, float] = {}
        evals: dict[int, float] = {}
        digests: dict[int, str] = {}
        recoveries: list[RecoveryEvent] = []
        plans = [plan.name]
        open_event: RecoveryEvent | None = None
        redo_until = -1
        bar = _Progress(T, enabled=self.progress)
        with bar:
            while step < T:
                self.pool.complete()  # the previous step's snapshot has landed
                if self.pending_cutover is not None and self._cutover_due(step):
                    plan, exe, state, good, mig = self._cutover(step, live, plan, exe, state, good)
                    migrations.append(mig)
                    ew.write(mig)
                    bar.log(
                        f"step {step}: cut over {mig['from_plan']} => {mig['to_plan']}; stalled "
                        f"{mig['stall_s']:.3f}s; optimal plan running {mig['time_to_optimal_s']:.2f}s "
                        "after the failure"
                    )
                    plans.append(plan.name)
                due = [e for e in pending if e.at_step == step]
                if due:
                    pending = [e for e in pending if e.at_step != step]
                    live, plan, exe, state, good, open_event, new_step = self._recover(
                        step, due, live, plan, exe, state, good
                    )
                    redo_until = max(redo_until, step)
                    step = new_step
                    plans.append(plan.name)
                gids, idx = self.data.step_ids(step)
                host_batch = self._batch(step, plan)
                batch = exe.put_batch(host_batch.arrays())
                processed = int((host_batch.weights > 0).sum())
                t0 = time.perf_counter()
                state, met = exe.train(state, batch)
                met = jax.device_get(met)
                dt = time.perf_counter() - t0
                loss = float(met["loss"])
                if not np.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss} at step {step}")
                good = checksum.to_host(met["checksums"])
                self.pool.take(state, step + 1, self.devices)
                losses[step] = loss
                digests[step] = DataPipeline.digest(idx)
                if self._standby_due is not None and open_event is None:
                    self._refresh_standby(*self._standby_due)
                    self._prepare_transitions(plan, exe, state, live)
                    self._standby_due = None
                if open_event is not None:
                    open_event.first_step_s = dt
                    open_event.compiles = self.compiles.count - open_event.compiles
                    recoveries.append(open_event)
                    ew.write(open_event.to_json())
                    bar.log(_recovery_line(open_event))
                    open_event = None
                step += 1
                rec = {
                    "step": step - 1,
                    "loss": loss,
                    "global_batch": processed,
                    "tokens": processed * cfg.model.seq_len,
                    "n_devices": plan.n_devices,
                    "plan": plan.name,
                    "step_time_s": dt,
                    "grad_norm": float(met["grad_norm"]),
                    "batch_digest": digests[step - 1],
                }
                if step - 1 < redo_until:
                    rec["redo"] = True
                if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == T):
                    evals[step - 1] = rec["eval_loss"] = self._eval(exe, plan, state)
                mw.write(rec)
                if self.ckpt is not None and self.ckpt.due(step):
                    self.ckpt.save(step, exe.to_canonical(state), good)
                bar.update(step, loss, plan)
        ew.write(
            {
                "type": "end",
                "step": step,
                "final_loss": losses[T - 1],
                "plan": plan.name,
                # digest of every leaf's layout-independent checksum: equal digests = bitwise
                # equal final parameters and optimizer state
                "state_digest": checksum.digest(good),
                "transfer_plans_prepared": self.jobs.done if self.jobs else 0,
                "transfer_plan_errors": self.jobs.errors[:5] if self.jobs else [],
            }
        )
        if self.progress:
            print_summary(recoveries, losses, evals, plan, self.out_dir)
        return RunSummary(
            self.out_dir, losses, evals, recoveries, plans, plan, good, digests, state, migrations,
            self.transfer_logs,
        )

    # -- batches (torchft_like processes only the surviving replicas' share) ---------------------

    def _layout_plan(self, plan: Plan) -> Plan:
        return self.initial if self.torchft_keep is not None else plan

    def _subset(self, hb):
        """Keep the columns of the kept replicas of the initial layout (torchft_like)."""
        if self.torchft_keep is None:
            return hb
        b = self.initial.micro_batch
        cols = np.concatenate([np.arange(r * b, (r + 1) * b) for r in self.torchft_keep])
        return dataclasses.replace(
            hb,
            inputs=hb.inputs[:, cols],
            targets=hb.targets[:, cols],
            weights=hb.weights[:, cols],
            key_ids=hb.key_ids[:, cols],
            sample_ids=hb.sample_ids[:, cols],
        )

    def _batch(self, step: int, plan: Plan):
        return self._subset(self.data.batch(step, self._layout_plan(plan)))

    def _start(self, exe: Executables):
        """(step, state, checksums) of a fresh start or a checkpoint resume."""
        rs = self.cfg.checkpoint.resume_step
        if rs is not None:
            assert self.ckpt is not None
            step = self.ckpt.latest_step() if rs == -1 else rs
            if step is None:
                raise FileNotFoundError(f"checkpoint.resume_step: no checkpoint in {self.ckpt.dir}")
            state, meta = self._restore(step, exe)
            self.dropped_checkpoints = self.ckpt.drop_after(step)
        else:
            step, state = 0, exe.init()
        good = checksum.to_host(exe.checksum(state))
        if rs is None and self.ckpt is not None:
            self.ckpt.save(0, exe.to_canonical(state), good)
        self.pool.configure(state, exe.state_shardings, exe.mesh, set(exe.plan.device_ids) | set(exe.plan.spare_ids))
        return step, state, good

    def _restore(self, step: int, exe: Executables):
        """Restore checkpoint `step` (stored in canonical form) onto `exe`'s plan, verified."""
        full, meta = self.ckpt.restore(step, self.factory.abstract_on(exe.mesh))
        state = exe.from_canonical(full)
        got = checksum.to_host(exe.checksum(state))
        bad = checksum.diff(meta["checksums"], got)
        if bad:
            raise RecoveryVerificationError(f"checkpoint {step} fails its checksums: {bad[:3]}")
        return state, meta

    def _eval(self, exe: Executables, plan: Plan, state) -> float:
        tot = n = 0.0
        for i in range(self.cfg.train.eval_batches):
            b = exe.put_batch(self._subset(self.data.eval_batch(i, self._layout_plan(plan))).arrays())
            s, c = jax.device_get(exe.eval(state.params, b))
            tot, n = tot + float(s), n + float(c)
        return tot / n

    # -- recovery -------------------------------------------------------------------------------

    def _recover(self, step, due: list[FaultEvent], live, plan, exe, state, good):
        t_fail = time.perf_counter()
        compiles_before = self.compiles.count
        if self.jobs is not None:
            self.jobs.replace([])  # plans for the old plan's failures: stop preparing them
        self.pending_cutover = None  # a new failure re-plans from scratch
        failed = tuple(sorted({d for e in due for d in e.device_ids}))
        fault = "; ".join(e.spec for e in due)
        for e in due:
            if e.kind == "hosts":
                self.dead_hosts |= {self.topo.host_of(d) for d in e.device_ids}
        store, bytes_lost = inject(state, failed)
        del state  # its buffers on the failed devices are gone; only `store` survives
        t0 = time.perf_counter()
        dead = detect(store, set(plan.device_ids)) | (set(failed) & set(plan.spare_ids))
        detect_s = time.perf_counter() - t0
        live = live - dead
        t0 = time.perf_counter()
        survivors = [d for d in self.topo.device_ids if d in live]
        strategy = self.cfg.recovery.strategy
        if strategy == "torchft_like":
            optimal = torchft_plan(plan, survivors, self.cfg)
            if optimal is None:
                raise UnrecoverableStateError(
                    "params", (), f"torchft_like: no data replica is intact after devices "
                    f"{list(failed)} failed at step {step}"
                )
            self.torchft_keep = _kept_ranks(self.torchft_keep, plan, optimal)
            new_plan = optimal
        else:
            new_plan, optimal = self._recovery_plan(plan, survivors)
        migration = "async" if new_plan != optimal else "blocking"
        plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        new_exe, hit, standby_hit = self.executables(new_plan)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        resume_at, expected = step, good
        refusals_before = len(self.pool.refusals)
        tinfo: dict = {}
        try:
            if strategy == "checkpoint_restart":
                raise UnrecoverableStateError("state", (), "checkpoint_restart restores from disk")
            snaps = self.pool.sources(dead, self.dead_hosts, version=step)
            new_state, log = transition(
                store,
                new_exe.state_shardings,
                devices=self.devices,
                extra_sources=snaps,
                old_layout=exe.layout,
                new_layout=new_exe.layout,
                plans=self.transition_plans,
                info=tinfo,
            )
            jax.block_until_ready(new_state)
            rung = log.worst_rung()
        except UnrecoverableStateError as err:
            if self.ckpt is None or strategy == "torchft_like":
                raise UnrecoverableStateError(
                    err.leaf, err.box, f"devices {list(failed)} failed at step {step}; no "
                    "surviving copy, no verified snapshot, and no checkpoint (checkpoint.dir)"
                ) from err
            del store
            ck_step = self.ckpt.latest_step()
            if ck_step is None:
                raise
            new_state, meta = self._restore(ck_step, new_exe)
            self.ckpt.drop_after(ck_step)
            rung, resume_at, expected = "checkpoint", ck_step, meta["checksums"]
            log = _checkpoint_log(new_state)
        transfer_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        actual = checksum.to_host(new_exe.checksum(new_state))
        bad = checksum.diff(expected, actual)
        if bad:
            raise RecoveryVerificationError(
                f"recovered state differs from the last good state in {len(bad)} leaves, e.g. "
                f"{bad[:3]}; refusing to continue"
            )
        verify_s = time.perf_counter() - t0
        if any(t.src in dead for t in log.entries):
            raise AssertionError("a transfer read a failed device")  # invariant, never expected
        t0 = time.perf_counter()
        self.pool.configure(new_state, new_exe.state_shardings, new_exe.mesh, live)
        snapshot_setup_s = time.perf_counter() - t0
        ev = RecoveryEvent(
            step=step,
            failed_devices=list(failed),
            fault=fault,
            from_plan=plan.name,
            to_plan=new_plan.name,
            rung=rung,
            bytes_moved=log.bytes_moved,
            transfers=log.transfers,
            max_transfers_per_device=log.max_per_device(),
            bytes_lost=bytes_lost,
            steps_lost=step - resume_at,
            detect_s=detect_s,
            plan_s=plan_s,
            compile_s=compile_s,
            standby_hit=standby_hit,
            exe_cache_hit=hit,
            transfer_s=transfer_s,
            verify_s=verify_s,
            verified=True,
            resumed_at_step=resume_at,
            bytes_kept_in_place=log.kept_bytes,
            rungs=sorted(log.rungs()),
            refused_snapshots=self.pool.refusals[refusals_before:],
            snapshot_setup_s=snapshot_setup_s,
            migration=migration,
            optimal_plan=optimal.name,
            strategy=strategy,
            compiles=compiles_before,  # completed after the first step
            transfer_plan_hit=tinfo.get("plan_hit", False),
            transfer_plan_s=tinfo.get("plan_s", 0.0),
        )
        self.transfer_logs.append(log)
        if migration == "async":
            self.pending_cutover = (optimal, t_fail, step)
            self.standby.submit([optimal.compile_key])  # the only plan that matters now
            if self.jobs is not None:  # plan the cut-over (nothing lost, no snapshots)
                self.jobs.replace([functools.partial(
                    self._prepare_move, describe_state(new_state), set(), optimal,
                    new_exe.layout, None,
                )])
        else:
            # Refresh the standby set after the first step, so that its compiles do not compete
            # with the step that ends the recovery.
            self._standby_due = (new_plan, set(live))
        return live, new_plan, new_exe, new_state, actual, ev, resume_at

    def _cutover_due(self, step: int) -> bool:
        """Cut over when the optimal plan is compiled, or wait for it once the run has spent
        `recovery.max_fast_path_steps` steps on the fast path."""
        optimal, _, fail_step = self.pending_cutover
        limit = self.cfg.recovery.max_fast_path_steps
        if limit and step - fail_step >= limit:
            self.standby.wait(optimal.compile_key)
            return True
        return self.standby.ready(optimal.compile_key)

    def _cutover(self, step, live, plan, exe, state, good):
        """Move to the optimal plan (compiled in the background) at a step boundary."""
        optimal, t_fail, fail_step = self.pending_cutover
        self.pending_cutover = None
        new_exe = self.standby.get(optimal.compile_key)
        t0 = time.perf_counter()
        store = ShardStore.capture(state)
        tinfo: dict = {}
        new_state, log = transition(
            store, new_exe.state_shardings, devices=self.devices, old_layout=exe.layout,
            new_layout=new_exe.layout, plans=self.transition_plans, info=tinfo,
        )
        jax.block_until_ready(new_state)
        transfer_s = time.perf_counter() - t0
        self.transfer_logs.append(log)
        t0 = time.perf_counter()
        actual = checksum.to_host(new_exe.checksum(new_state))
        bad = checksum.diff(good, actual)
        if bad:
            raise RecoveryVerificationError(f"cut-over changed {len(bad)} leaves, e.g. {bad[:3]}")
        verify_s = time.perf_counter() - t0
        self.pool.configure(new_state, new_exe.state_shardings, new_exe.mesh, live)
        self._refresh_standby(optimal, live)
        self._prepare_transitions(optimal, new_exe, new_state, live)
        mig = {
            "type": "migration",
            "step": step,
            "failure_step": fail_step,
            "from_plan": plan.name,
            "to_plan": optimal.name,
            "bytes_moved": log.bytes_moved,
            "transfers": log.transfers,
            "transfer_s": transfer_s,
            "verify_s": verify_s,
            "stall_s": transfer_s + verify_s,
            "transfer_plan_hit": tinfo["plan_hit"],
            "transfer_plan_s": tinfo["plan_s"],
            "steps_on_fast_path": step - fail_step,
            "time_to_optimal_s": time.perf_counter() - t_fail,
            "verified": True,
        }
        return optimal, new_exe, new_state, actual, mig


def torchft_plan(previous: Plan, survivors, cfg: Config) -> Plan | None:
    """TorchFT-like recovery: keep the intact data replicas exactly as they are (same
    micro-batches, same samples) and drop the broken ones with their samples: the global batch
    shrinks and the loss averages over the surviving replicas."""
    live = set(survivors)
    intact = [g for g in previous.groups if all(d in live for d in g)]
    if not intact:
        return None
    used = tuple(d for g in intact for d in g)
    return Plan(
        used, len(intact), previous.tensor, previous.microbatches, previous.micro_batch,
        previous.global_batch * len(intact) // previous.data or 1,
        tuple(d for d in survivors if d not in used), stage=previous.stage,
        partition=previous.partition,
    ).compile_key


def _kept_ranks(keep, old: Plan, new: Plan) -> tuple[int, ...]:
    """Initial-layout replica indices that survive into `new` (torchft_like)."""
    keep = tuple(range(old.data)) if keep is None else keep
    groups = set(new.groups)
    return tuple(k for k, g in zip(keep, old.groups) if g in groups)


def _checkpoint_log(state) -> TransferLog:
    log = TransferLog()
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = path_str(path)
        for s in x.addressable_shards:
            box = index_to_box(s.index, x.shape)
            log.entries.append(Transfer(name, box, "checkpoint", s.device.id, s.data.nbytes, "checkpoint"))
    return log


def _recovery_line(ev: RecoveryEvent) -> str:
    fast = (
        f" (fast path; optimal {ev.optimal_plan} compiling in the background)"
        if ev.migration == "async"
        else ""
    )
    return (
        f"step {ev.step}: {ev.fault} failed -> {ev.from_plan} => {ev.to_plan}{fast} via {ev.rung}; "
        f"{ev.bytes_moved / 1e6:.2f} MB in {ev.transfers} transfers"
        f"{' (planned ahead)' if ev.transfer_plan_hit else ''}; MTTR {ev.mttr_s:.2f}s "
        f"(compile {ev.compile_s:.2f}s{', standby hit' if ev.standby_hit else ''}); verified"
    )


class _Progress:
    """A rich progress bar (step, loss, devices), or nothing."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total = enabled, total
        self._p = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("devices {task.fields[devices]}"),
                TextColumn("{task.fields[plan]}"),
                TimeElapsedColumn(),
            )
            self._p.__enter__()
            self._task = self._p.add_task("train", total=self.total, loss="-", devices="-", plan="")
        return self

    def update(self, step: int, loss: float, plan: Plan) -> None:
        if self._p is not None:
            self._p.update(
                self._task, completed=step, loss=f"{loss:.4f}", devices=plan.n_devices, plan=plan.name
            )

    def log(self, msg: str) -> None:
        if self._p is not None:
            self._p.console.log(msg)

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)


def print_summary(recoveries, losses, evals, plan: Plan, out_dir) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if recoveries:
        t = Table(title="Recoveries (single-process simulated device loss)")
        for col in ("step", "failure", "plan change", "rung", "moved", "xfers", "verified", "MTTR"):
            t.add_column(col)
        for e in recoveries:
            rung = e.rung + (f" (-{e.steps_lost} steps)" if e.steps_lost else "")
            t.add_row(
                str(e.step), e.fault, f"{e.from_plan} -> {e.to_plan}", rung,
                f"{e.bytes_moved / 1e6:.2f} MB", str(e.transfers),
                "yes" if e.verified else "NO", f"{e.mttr_s:.2f}s",
            )
        con.print(t)
        t = Table(title="MTTR breakdown (seconds)")
        for col in ("step", "detect", "plan", "compile", "transfer", "verify", "1st step", "total"):
            t.add_column(col, justify="right")
        for e in recoveries:
            t.add_row(
                str(e.step), f"{e.detect_s:.4f}", f"{e.plan_s:.4f}", f"{e.compile_s:.3f}",
                f"{e.transfer_s:.3f}", f"{e.verify_s:.3f}", f"{e.first_step_s:.3f}",
                f"{e.mttr_s:.3f}",
            )
        con.print(t)
    else:
        con.print("no failures were injected")
    last = max(losses)
    msg = f"final loss {losses[last]:.4f} at step {last}; final plan {plan.describe()}"
    if evals:
        k = max(evals)
        msg += f"; held-out loss {evals[k]:.4f}"
    con.print(msg)
    if out_dir is not None:
        con.print(f"outputs: {out_dir}/config.yaml, metrics.jsonl, events.jsonl")


def run(
    cfg: Config,
    out_dir: str | Path | None = None,
    *,
    progress: bool = False,
    exe_cache: ExecutableCache | None = None,
) -> RunSummary:
    return Trainer(cfg, out_dir, progress=progress, exe_cache=exe_cache).run()


