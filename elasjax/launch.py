"""`elasjax launch`: one job as P cooperating processes on JAX's multi-controller runtime, surviving
real process failures (SIGKILL), plus the local launcher that starts and reaps them.

Worker loop. Every state change is one `multihost_utils.live_devices` block, which is atomic:
either every live process finishes the block or every one raises `ProcessFailureError` naming
the dead devices (its exit is a barrier over the live processes). State, checksums and snapshots
are committed only after a clean exit, so a failure anywhere leaves the last committed state
intact on every survivor:

    start      [plan + compile]  [init + checksums + snapshot]
    step s     [batch -> train -> block_until_ready -> checksums -> snapshot of the result]
    recovery   [replan + compile]  [rebuild + verify + snapshot]  then step s again

Compilation is a block of its own so that its exit barrier lines every process up before the
next collective: processes compile at different speeds, and a collective that waits longer than
`--xla_cpu_collective_timeout_seconds` fails as if a peer had died. (The coordination service's
own `wait_at_barrier` is no substitute: with a dead participant it blocks until its timeout.)
The train executable does not donate its input: a step interrupted by a death must leave the
previous state readable, which is what recovery rebuilds from.

A recovery re-plans over the surviving devices with the same pure planner as the single-process
trainer, then `distributed.plan_rebuild` / `execute_rebuild` build the new plan's state from
live replicas and, for shards that lived in the dead process only, from the host snapshot its
ring successor holds; checksums of the rebuilt state must equal those of the last committed
state. The step then re-runs with the same sample ids and keys, so losses continue those of the
fault-free run.

Fault injection is real: `--kill STEP:PROCESS` makes that process send itself SIGKILL right after
dispatching step STEP (its collectives are in flight); the wall time of the kill goes to the
coordination service's key-value store so survivors can report kill -> `ProcessFailureError`.

Process 0 hosts the coordination service. Its death makes the runtime terminate every other
process; the launcher then reports it and reaps whatever is left (see docs/multiprocess.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.errors import JaxRuntimeError
from jax.experimental import multihost_utils

from . import checksum
from .config import Config, ConfigError, dump, load
from .data import DataPipeline
from .distributed import (
    REJOIN_UNSUPPORTED,
    Exchanger,
    Membership,
    RejoinUnsupportedError,
    RuntimeConfig,
    execute_rebuild,
    initialize,
    kv_client,
    layouts,
    local_shards,
    plan_rebuild,
    take_snapshot,
    xla_flags,
)
from .metrics import JsonlWriter, read_jsonl
from .planner import Topology, initial_plan, replan
from .rng import check_backend_config
from .state import StateFactory, make_optimizer
from .step import compile_plan

# The phases whose sum is a recovery's `mttr_s` (DESIGN section 4, plus the snapshot refresh).
MTTR_PHASES = (
    "detect_s",
    "plan_s",
    "compile_s",
    "transfer_s",
    "verify_s",
    "snapshot_s",
    "first_step_s",
)


# ---------------------------------------------------------------------------------------------
# The kill schedule.


@dataclasses.dataclass(frozen=True)
class KillSpec:
    """SIGKILL process `process` right after it dispatches step `at_step`."""

    at_step: int
    process: int

    @classmethod
    def parse(cls, text: str) -> KillSpec:
        step, sep, proc = text.partition(":")
        if not sep or not step.strip().isdigit() or not proc.strip().isdigit():
            raise ConfigError(f"--kill {text!r} must look like STEP:PROCESS, e.g. --kill 3:2")
        return cls(int(step), int(proc))

    def __str__(self) -> str:
        return f"{self.at_step}:{self.process}"


def kill_schedule(cfg: Config, cli: Sequence[KillSpec], n_processes: int) -> tuple[KillSpec, ...]:
    """The run's kills: `--kill` options plus config faults with a `kill_process` field.

    Config faults that simulate device loss inside one process (`devices`, `hosts`, `count`)
    have no meaning here and are refused; so are kills outside the run, of unknown processes,
    of a process twice, or of every process.
    """
    kills = list(cli)
    for i, f in enumerate(cfg.faults):
        kp = f.kill_process
        if kp >= 0:
            kills.append(KillSpec(f.at_step, kp))
            continue
        raise ConfigError(
            f"config 'faults[{i}]' simulates device loss inside one process; under `elasjax "
            f"launch` a failure is a killed process: use --kill STEP:PROCESS (and --set faults=[])"
        )
    steps = cfg.train.steps
    seen: set[int] = set()
    for k in kills:
        if not 1 <= k.at_step < steps:
            raise ConfigError(
                f"--kill {k}: step {k.at_step} is outside the run; allowed steps: 1 .. {steps - 1}"
            )
        if not 0 <= k.process < n_processes:
            raise ConfigError(
                f"--kill {k}: process {k.process} does not exist; allowed: 0 .. {n_processes - 1}"
            )
        if k.process in seen:
            raise ConfigError(f"--kill {k}: process {k.process} is killed twice")
        seen.add(k.process)
    if n_processes and len(seen) >= n_processes:
        raise ConfigError("--kill kills every process; at least one must survive")
    return tuple(sorted(kills, key=lambda k: (k.at_step, k.process)))


def resolve_config(cfg: Config, n_processes: int, devices_per_process: int) -> Config:
    """The config as the launch runs it: all devices of all processes, a host = a process."""
    n = n_processes * devices_per_process
    p = cfg.parallel
    if p.devices not in (-1, n):
        raise ConfigError(
            f"config 'parallel.devices' = {p.devices} but the launch has {n} devices "
            f"({n_processes} processes x {devices_per_process}); allowed values: -1, {n}"
        )
    if cfg.checkpoint.dir is not None:
        raise ConfigError(
            "config 'checkpoint.dir': persistent checkpoints are not wired into `elasjax launch`; "
            "allowed values: null"
        )
    if cfg.zero.stage != 0:
        raise ConfigError(
            f"config 'zero.stage' = {cfg.zero.stage}: `elasjax launch` rebuilds state by boxes of "
            "ZeRO-0 leaves; ZeRO storage needs the canonical-range transfer plan across "
            "processes (not wired yet); allowed values: 0"
        )
    par = dataclasses.replace(p, devices=n, devices_per_host=devices_per_process)
    return cfg.replace(parallel=par)


# ---------------------------------------------------------------------------------------------
# Executables.


@dataclasses.dataclass
class PlanExecutables:
    exe: Any  # step.Executables


def compile_executables(cfg: Config, factory, plan, devices) -> PlanExecutables:
    """`step.compile_plan`'s executables for `plan`, compiled without donation: a step that a
    death interrupts must leave its input state readable on the survivors (recovery rebuilds
    from it), so the input is kept until the step commits."""
    return PlanExecutables(compile_plan(cfg, factory, plan, devices, donate=False))


# ---------------------------------------------------------------------------------------------
# The worker.


@dataclasses.dataclass
class Failure:
    """What survivors learnt from one `ProcessFailureError` (merged if more follow)."""

    step: int
    phase: str
    failed_devices: list[int]
    failed_processes: list[int]
    killed: bool
    kill_to_error_s: float | None
    block_to_error_s: float
    cause: str
    t_error: float
    incident: int


class Worker:
    """One process of a launched job; `run()` trains to the end or raises."""

    def __init__(self, cfg: Config, rc, out: Path | None, kills: Sequence[KillSpec]):
        check_backend_config()
        self.rc = rc
        self.me = jax.process_index()
        self.member = Membership.of(jax.devices())
        k = len(jax.local_devices())
        self.cfg = resolve_config(cfg, jax.process_count(), k)
        self.kills = {s.process: s for s in kill_schedule(self.cfg, kills, jax.process_count())}
        self.topo = Topology(self.member.ids, k)
        self.initial = initial_plan(self.topo, self.cfg)
        self.factory = StateFactory(self.cfg, make_optimizer(self.cfg.train))
        self.data = DataPipeline(
            self.cfg.data, self.cfg.model, self.cfg.rng, self.cfg.train.global_batch
        )
        self.exchanger = Exchanger(self.member)
        self.out = out
        self.writer = self.me == 0  # the lowest live process; process 0 cannot fail and survive
        self.incidents = 0
        self.pending: Failure | None = None
        self.exes: dict = {}
        self.step = 0
        self.plan = self.exe = self.state = self.good = self.pool = self.lays = None

    # -- atomic blocks --------------------------------------------------------------------------

    def _atomic(self, phase: str, body: Callable[[], Any]) -> tuple[bool, Any]:
        t0 = time.time()
        try:
            with multihost_utils.live_devices(list(self.member.devices)) as live:
                ids = {d.id for d in live}
                if ids != set(self.member.ids):
                    raise RuntimeError(
                        f"live devices {sorted(ids)} differ from the membership "
                        f"{sorted(self.member.ids)} at a block start; processes "
                        f"{sorted(set(self.member.processes) - {d.process_index for d in live})} "
                        "were not alive when the job started"
                    )
                return True, body()
        except multihost_utils.ProcessFailureError as e:
            self._failed(e, phase, t0)
            return False, None

    def _failed(self, e, phase: str, t_block: float) -> None:
        t_err = time.time()
        failed = sorted(d.id for d in e.failed_devices)
        procs = sorted({d.process_index for d in e.failed_devices})
        client = kv_client()
        kill_times = [_kv_float(client, f"elasjax/kill/{p}") for p in procs]
        kill_times = [t for t in kill_times if t is not None]
        k2e = t_err - min(kill_times) if kill_times else None
        self.incidents += 1
        cause = repr(e.__cause__) if e.__cause__ is not None else "failure seen at the block exit"
        f = Failure(
            self.step,
            phase,
            failed,
            procs,
            bool(kill_times),
            k2e,
            t_err - t_block,
            cause.splitlines()[0][:300],
            t_err,
            self.incidents,
        )
        detect = {"kill_to_error_s": k2e, "block_to_error_s": f.block_to_error_s}
        client.key_value_set(
            f"elasjax/detect/{self.incidents}/{self.me}", json.dumps(detect), allow_overwrite=True
        )
        self.member = self.member.without(set(failed))
        self.exchanger = Exchanger(self.member)
        _log(
            self.me,
            f"step {self.step} ({phase}): ProcessFailureError: processes {procs} (devices "
            f"{failed}) failed; kill -> error "
            + (f"{k2e:.2f}s" if k2e is not None else "n/a")
            + f"; cause: {f.cause[:160]}",
        )
        if self.pending is None:
            self.pending = f
        else:  # a failure during a recovery: one recovery covers both
            p = self.pending
            p.failed_devices = sorted(set(p.failed_devices) | set(failed))
            p.failed_processes = sorted(set(p.failed_processes) | set(procs))

    # -- phases ---------------------------------------------------------------------------------

    def _plan_and_compile(self):
        t0 = time.perf_counter()
        if set(self.member.ids) == set(self.topo.device_ids):
            plan = self.initial
        else:
            survivors = [d for d in self.topo.device_ids if d in set(self.member.ids)]
            plan = replan(survivors, self.topo, self.cfg, self.plan or self.initial, self.initial)
        plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        hit = plan in self.exes
        if not hit:
            self.exes[plan] = compile_executables(self.cfg, self.factory, plan, self.member.by_id())
        return plan, self.exes[plan], plan_s, time.perf_counter() - t0, hit

    def _init_state(self, pe: PlanExecutables):
        exe = pe.exe
        state = exe.init()
        good = checksum.to_host(exe.checksum(state))
        lays = layouts(self.factory.abstract, exe.state_shardings)
        pool = take_snapshot(state, lays, self.member, self.exchanger, 0)
        return state, good, lays, pool

    def _train(self):
        step, exe = self.step, self.exe.exe
        _, idx = self.data.step_ids(step)
        arrays = self.data.batch(step, self.plan).arrays()
        batch = {
            k: jax.make_array_from_callback(v.shape, exe.batch_shardings[k], lambda i, v=v: v[i])
            for k, v in arrays.items()
        }
        t0 = time.perf_counter()
        new_state, met = exe.train(self.state, batch)
        kill = self.kills.get(self.me)
        if kill is not None and kill.at_step == step:
            kv_client().key_value_set(f"elasjax/kill/{self.me}", repr(time.time()), True)
            _log(self.me, f"step {step}: sending SIGKILL to myself (--kill {kill})")
            os.kill(os.getpid(), signal.SIGKILL)
        jax.block_until_ready((new_state, met))
        dt = time.perf_counter() - t0
        loss, gnorm = float(met["loss"]), float(met["grad_norm"])
        good = checksum.to_host(met["checksums"])
        t0 = time.perf_counter()
        pool = take_snapshot(new_state, self.lays, self.member, self.exchanger, step + 1)
        snap_s = time.perf_counter() - t0
        return new_state, good, pool, loss, gnorm, dt, snap_s, DataPipeline.digest(idx)

    def _rebuild(self, pe: PlanExecutables):
        from .trainer import RecoveryVerificationError

        exe = pe.exe
        t0 = time.perf_counter()
        new_lays = layouts(self.factory.abstract, exe.state_shardings)
        snaps = self.pool.holdings(self.member.processes) if self.pool is not None else {}
        pieces = plan_rebuild(self.lays, new_lays, self.member.process_of(), snaps)
        treedef = jax.tree_util.tree_structure(self.factory.abstract)
        state, log = execute_rebuild(
            pieces,
            self.lays,
            local_shards(self.state),
            self.pool,
            self.step,
            exe.state_shardings,
            treedef,
            self.member.by_id(),
            self.exchanger,
        )
        jax.block_until_ready(state)
        transfer_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        actual = checksum.to_host(exe.checksum(state))
        bad = checksum.diff(self.good, actual)
        if bad:
            raise RecoveryVerificationError(
                f"rebuilt state differs from the last committed state (step {self.step}) in "
                f"{len(bad)} leaves, e.g. {bad[:3]}; refusing to continue"
            )
        verify_s = time.perf_counter() - t0
        dead = set(self.topo.device_ids) - set(self.member.ids)
        if any(t.src in dead for t in log.entries):
            raise AssertionError("a transfer read a failed device")  # invariant
        t0 = time.perf_counter()
        pool = take_snapshot(state, new_lays, self.member, self.exchanger, self.step)
        snap_s = time.perf_counter() - t0
        cross = sum(p.nbytes for p in pieces if p.remote)
        return state, new_lays, pool, log, cross, transfer_s, verify_s, snap_s

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> dict:
        out = self.out if self.writer else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(dump(self.cfg))
        mw = JsonlWriter(out / "metrics.jsonl" if out else None)
        ew = JsonlWriter(out / "events.jsonl" if out else None)
        try:
            return self._run(mw, ew)
        except Exception as e:
            ew.write(
                {
                    "type": "error",
                    "step": self.step,
                    "error": type(e).__name__,
                    "message": str(e),
                    "process": self.me,
                }
            )
            raise
        finally:
            mw.close()
            ew.close()

    def _run(self, mw, ew) -> dict:
        cfg, T = self.cfg, self.cfg.train.steps
        if _kv_float(kv_client(), "elasjax/started") is not None:
            # This process was restarted into a running job (same coordinator and id).
            raise RejoinUnsupportedError(
                f"process {self.me} was restarted into a running job: "
                + (
                    REJOIN_UNSUPPORTED
                    if self.rc.platform == "cpu"
                    else "rejoining is not implemented yet (see docs/multiprocess.md, 'Scale-up')"
                )
            )
        while True:  # start: a fresh start on whoever is alive
            ok, res = self._atomic("start/compile", self._plan_and_compile)
            if not ok:
                continue
            plan, exe, _, compile_s, _ = res
            ok, res = self._atomic("start/init", lambda exe=exe: self._init_state(exe))
            if ok:
                break
        self.plan, self.exe = plan, exe
        self.state, self.good, self.lays, self.pool = res
        if self.writer:
            kv_client().key_value_set("elasjax/started", repr(time.time()), allow_overwrite=True)
        if self.pending is not None:
            ew.write({"type": "failure_before_start", **dataclasses.asdict(self.pending)})
            self.pending = None
        ew.write(
            {
                "type": "start",
                "step": 0,
                "plan": plan.name,
                "plan_detail": plan.describe(),
                "devices": list(self.member.ids),
                "processes": list(self.member.processes),
                "devices_per_process": self.topo.devices_per_host,
                "compile_s": compile_s,
                "n_params": self.factory.n_params,
                "kills": [str(k) for k in self.kills.values()],
                "runtime": dataclasses.asdict(self.rc),
                "snapshot_unique_bytes": self.pool.nbytes,
                "eval": "not run under launch" if cfg.train.eval_every else "off",
            }
        )
        _log(self.me, f"start: plan {plan.describe()}; compile {compile_s:.1f}s")
        open_event: dict | None = None
        losses: dict[int, float] = {}
        while self.step < T:
            if self.pending is not None:
                ev = self._recover()
                if ev is not None:
                    open_event = ev
                continue
            ok, res = self._atomic("step", self._train)
            if not ok:
                continue
            self.state, self.good, self.pool, loss, gnorm, dt, snap_s, digest = res
            losses[self.step] = loss
            mw.write(
                {
                    "step": self.step,
                    "loss": loss,
                    "global_batch": cfg.train.global_batch,
                    "tokens": cfg.train.global_batch * cfg.model.seq_len,
                    "n_devices": self.plan.n_devices,
                    "n_processes": len(self.member.processes),
                    "plan": self.plan.name,
                    "step_time_s": dt,
                    "grad_norm": gnorm,
                    "batch_digest": digest,
                    "snapshot_s": snap_s,
                    "snapshot_bytes": self.pool.nbytes,
                }
            )
            if open_event is not None:
                self._close_event(open_event, dt, ew)
                open_event = None
            _log(self.me, f"step {self.step}: loss {loss:.6f} on {self.plan.name} ({dt:.3f}s)")
            self.step += 1
        ok = False
        while not ok:  # a last barrier, so no process leaves while others still need it
            ok, _ = self._atomic("end", lambda: None)
        ew.write(
            {
                "type": "end",
                "step": self.step,
                "final_loss": losses.get(T - 1),
                "plan": self.plan.name,
                "processes": list(self.member.processes),
            }
        )
        return {"losses": losses, "plan": self.plan.name, "processes": self.member.processes}

    def _recover(self) -> dict | None:
        f = self.pending
        old_plan = self.plan
        ok, res = self._atomic("recover/compile", self._plan_and_compile)
        if not ok:
            return None
        plan, exe, plan_s, compile_s, hit = res
        ok, res = self._atomic("recover/transfer", lambda: self._rebuild(exe))
        if not ok:
            return None
        state, lays, pool, log, cross, transfer_s, verify_s, snap_s = res
        self.plan, self.exe, self.state, self.lays, self.pool = plan, exe, state, lays, pool
        self.pending = None
        self.exes = {plan: exe}  # membership only shrinks: older plans never come back
        rungs = sorted(log.rungs())
        worst = "host" if "host" in rungs else "replica"
        detect_s = f.kill_to_error_s if f.kill_to_error_s is not None else f.block_to_error_s
        fault = ", ".join(
            f"process {p} " + ("killed (SIGKILL)" if f.killed else "failed")
            for p in f.failed_processes
        )
        _log(
            self.me,
            f"recovered at step {f.step}: {old_plan.name} -> {plan.name} via {'+'.join(rungs)}; "
            f"{log.bytes_moved / 1e6:.2f} MB in {log.transfers} transfers; verified",
        )
        return {
            "type": "recovery",
            "step": f.step,
            "fault": fault,
            "failed_devices": f.failed_devices,
            "failed_processes": f.failed_processes,
            "failed_phase": f.phase,
            "from_plan": old_plan.name,
            "to_plan": plan.name,
            "rung": worst,
            "rungs": rungs,
            "bytes_moved": log.bytes_moved,
            "bytes_cross_process": cross,
            "transfers": log.transfers,
            "max_transfers_per_device": log.max_per_device(),
            "steps_lost": 0,
            "resumed_at_step": f.step,
            "detect_s": detect_s,
            "kill_to_error_s": f.kill_to_error_s,
            "block_to_error_s": f.block_to_error_s,
            "error_cause": f.cause,
            "plan_s": plan_s,
            "compile_s": compile_s,
            "standby_hit": False,
            "exe_cache_hit": hit,
            "transfer_s": transfer_s,
            "verify_s": verify_s,
            "snapshot_s": snap_s,
            "verified": True,
            "collective_timeout_s": self.rc.collective_timeout_s,
            "heartbeat_timeout_s": self.rc.heartbeat_timeout_s,
            "_t_error": f.t_error,
            "_incident": f.incident,
            "failure_simulation": "real: a process of a jax.distributed job died (SIGKILL)"
            if f.killed
            else "real: a process of a jax.distributed job died",
        }

    def _close_event(self, ev: dict, first_step_s: float, ew) -> None:
        client = kv_client()
        per = {}
        for p in self.member.processes:
            v = _kv_json(client, f"elasjax/detect/{ev['_incident']}/{p}")
            if v is not None:
                per[str(p)] = v.get("kill_to_error_s")
        ev["detect_per_process_s"] = per
        ev["first_step_s"] = first_step_s
        ev["mttr_s"] = sum(ev[k] for k in MTTR_PHASES)
        ev["error_to_resumed_s"] = time.time() - ev.pop("_t_error")
        ev.pop("_incident")
        ew.write(ev)
        _log(
            self.me,
            "MTTR {mttr_s:.2f}s = detect {detect_s:.2f} + plan {plan_s:.3f} + compile "
            "{compile_s:.2f} + transfer {transfer_s:.3f} + verify {verify_s:.3f} + snapshot "
            "{snapshot_s:.3f} + first step {first_step_s:.3f}".format(**ev),
        )


def _kv_float(client, key: str) -> float | None:
    try:
        return float(client.key_value_try_get(key))
    except JaxRuntimeError:  # NOT_FOUND: the key was never set
        return None


def _kv_json(client, key: str):
    try:
        return json.loads(client.blocking_key_value_get(key, 5000))
    except JaxRuntimeError:  # DEADLINE_EXCEEDED: that process never reported
        return None


def _log(me: int, msg: str) -> None:
    print(f"[elasjax p{me}] {msg}", flush=True)


def _shutdown(me: int, processes: Sequence[int]) -> None:
    """Leave in an order that never strands a process: the others say goodbye and disconnect;
    process 0, whose coordination service they talk to, goes last."""

    client = kv_client()
    if me != 0:
        client.key_value_set(f"elasjax/bye/{me}", "1", allow_overwrite=True)
        jax.distributed.shutdown()
        return

    for p in processes:
        if p != 0:
            try:
                client.blocking_key_value_get(f"elasjax/bye/{p}", 30_000)
            except JaxRuntimeError:  # it died after the last barrier: nothing to wait for
                continue
    time.sleep(1.0)  # let their disconnect RPCs land before the service goes away
    jax.distributed.shutdown()


def run_worker(
    config_path: str | None,
    overrides: Sequence[str],
    rc,
    out: str | Path | None,
    kills: Sequence[KillSpec] = (),
) -> int:
    """Join the job described by `rc` and train; returns a process exit code."""

    cfg = load(config_path, overrides)
    initialize(rc)
    w = Worker(cfg, rc, Path(out) if out is not None else None, kills)
    summary = w.run()
    _log(w.me, f"done: {len(summary['losses'])} steps, final plan {summary['plan']}")
    _shutdown(w.me, summary["processes"])
    return 0


# ---------------------------------------------------------------------------------------------
# The local launcher.


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class _Proc:
    index: int
    popen: subprocess.Popen
    log: Path
    ended_at: float | None = None

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode


def launch_local(
    config_path: str | None,
    overrides: Sequence[str] = (),
    *,
    processes: int,
    devices_per_process: int = 2,
    out: str | Path | None = None,
    kills: Sequence[KillSpec] = (),
    heartbeat_timeout_s: int = 5,
    collective_timeout_s: int = 8,
    timeout_s: float = 900.0,
    quiet: bool = False,
) -> int:
    """Start `processes` workers on this machine (loopback), wait for them, reap them.

    Returns 0 when the run finished (every process exited 0 or was killed as scheduled), 3 when
    process 0 died (the job cannot continue), 1 on any other failure or on `timeout_s`. Every
    worker is its own process group and is SIGKILLed on the way out if still running. Writes
    `launch.json` (per-process exit status) and `worker<i>.log` to `out`.
    """
    if processes < 1 or devices_per_process < 1:
        raise ConfigError("--processes and --devices-per-process must be >= 1")
    # Fail fast, before any process starts: config, kill schedule and initial plan (pure).
    cfg = resolve_config(load(config_path, overrides), processes, devices_per_process)
    kills = kill_schedule(cfg, kills, processes)
    initial_plan(Topology(tuple(range(processes * devices_per_process)), devices_per_process), cfg)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="elasjax-launch-"))
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    rc0 = RuntimeConfig(
        f"127.0.0.1:{port}",
        processes,
        process_id=0,
        devices_per_process=devices_per_process,
        heartbeat_timeout_s=heartbeat_timeout_s,
        collective_timeout_s=collective_timeout_s,
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = xla_flags(rc0, env.get("XLA_FLAGS", ""))
    scheduled = {k.process: k for k in kills}
    if 0 in scheduled:
        _say(
            quiet,
            f"note: --kill {scheduled[0]} kills process 0, which hosts the coordination "
            "service: the job will end there",
        )
    procs: list[_Proc] = []
    t_start = time.time()
    try:
        for i in range(processes):
            cmd = [
                sys.executable,
                "-u",
                "-m",
                "elasjax.launch",
                *([config_path] if config_path else []),
                "--coordinator",
                rc0.coordinator,
                "--num-processes",
                str(processes),
                "--process-id",
                str(i),
                "--devices-per-process",
                str(devices_per_process),
                "--heartbeat-timeout",
                str(heartbeat_timeout_s),
                "--collective-timeout",
                str(collective_timeout_s),
                "--out",
                str(out),
                "--die-with-parent",
                str(os.getpid()),
            ]
            for o in overrides:
                cmd += ["--set", o]
            for k in kills:
                cmd += ["--kill", str(k)]
            log = out / f"worker{i}.log"
            with log.open("wb") as fh:
                p = subprocess.Popen(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            procs.append(_Proc(i, p, log))
        pids = {"launcher": os.getpid(), "workers": [q.popen.pid for q in procs]}
        (out / "pids.json").write_text(json.dumps(pids))
        outcome, message = _monitor(
            procs, scheduled, t_start + timeout_s, heartbeat_timeout_s, quiet
        )
    finally:
        left = _reap(procs)
    status = []
    for p in procs:
        rc = p.returncode
        status.append(
            {
                "process": p.index,
                "returncode": rc,
                "signal": signal.Signals(-rc).name if rc is not None and rc < 0 else None,
                "scheduled_kill": str(scheduled[p.index]) if p.index in scheduled else None,
                "pid": p.popen.pid,
                "ended_after_s": None if p.ended_at is None else round(p.ended_at - t_start, 3),
                "log": str(p.log),
            }
        )
    if left:
        message += f"; SIGKILLed {len(left)} process(es) still running: {left}"
    summary = {
        "outcome": outcome,
        "message": message,
        "elapsed_s": time.time() - t_start,
        "left_running_after_reap": [p.index for p in procs if p.popen.poll() is None],
        "processes": status,
    }
    (out / "launch.json").write_text(json.dumps(summary, indent=2))
    _say(quiet, f"elasjax launch: {outcome}: {message}")
    _say(
        quiet,
        "per process: "
        + ", ".join(f"p{s['process']}={s['signal'] or s['returncode']}" for s in status),
    )
    if outcome == "finished":
        _print_recoveries(out, quiet)
    _say(quiet, f"outputs: {out}")
    return {"finished": 0, "coordinator_lost": 3}.get(outcome, 1)


def _monitor(procs, scheduled, deadline, heartbeat_s, quiet) -> tuple[str, str]:
    """Wait for process 0 (the job's fate is its fate), then briefly for the others."""
    tail = _Tail(procs[0].log)
    unscheduled: list[str] = []
    while True:
        now = time.time()
        for p in procs:
            if p.ended_at is None and p.popen.poll() is not None:
                p.ended_at = now
                rc = p.returncode
                if p.index in scheduled and rc == -signal.SIGKILL:
                    _say(
                        quiet,
                        f"process {p.index} was killed as scheduled (--kill {scheduled[p.index]})",
                    )
                elif rc != 0 and p.index != 0 and procs[0].ended_at is None:
                    unscheduled.append(f"process {p.index} ended with {_rc(rc)}")
                    _say(
                        quiet,
                        f"process {p.index} ended with {_rc(rc)} (not scheduled): "
                        f"{_last_error(p.log)}",
                    )
        if not quiet:
            for line in tail.lines():
                if line.startswith("[elasjax"):
                    print(line, flush=True)
        p0 = procs[0]
        if p0.ended_at is not None:
            if all(p.ended_at is not None for p in procs):
                break
            if now > p0.ended_at + heartbeat_s + 15:  # grace for the others to end themselves
                break
        if now > deadline:
            return "timeout", "the job did not finish within the launch timeout"
        time.sleep(0.2)
    rc0 = procs[0].returncode
    if rc0 == 0:
        extra = f" (survived: {'; '.join(unscheduled)})" if unscheduled else ""
        return "finished", f"process 0 finished the run{extra}"
    others = "; ".join(
        f"process {p.index} ended {p.ended_at - procs[0].ended_at:+.1f}s later with "
        f"{_rc(p.returncode)}"
        for p in procs[1:]
        if p.ended_at is not None and p.returncode is not None and p.index not in scheduled
    )
    if 0 in scheduled and rc0 == -signal.SIGKILL:
        return "coordinator_lost", _coordinator_message(scheduled[0]) + f" ({others})"
    if rc0 < 0:
        return "coordinator_lost", f"process 0 ended with {_rc(rc0)}; {_COORD} ({others})"
    return "failed", f"process 0 exited with {_rc(rc0)}: {_last_error(procs[0].log)}"


_COORD = (
    "process 0 hosts the JAX coordination service, so the other processes cannot continue "
    "without it (the runtime terminates them)"
)


def _coordinator_message(kill: KillSpec) -> str:
    return (
        f"process 0 was killed at step {kill.at_step} (--kill {kill}); "
        + _COORD
        + "; the job ended"
    )


def _rc(rc: int) -> str:
    return signal.Signals(-rc).name if rc < 0 else f"exit code {rc}"


def _last_error(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    keys = ("Error", "error:", "Terminating process", "Traceback")
    hits = [ln for ln in lines if any(k in ln for k in keys) and not ln.startswith("    @")]
    return (hits[-1] if hits else (lines[-1] if lines else "(empty log)")).strip()[:400]


def _reap(procs: Sequence[_Proc]) -> list[int]:
    """SIGKILL the process group of every worker still running; returns their indices."""
    left = []
    for p in procs:
        if p.popen.poll() is None:
            left.append(p.index)
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)  # its own session: only our worker
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if p.ended_at is None:
            p.ended_at = time.time()
    return left


class _Tail:
    def __init__(self, path: Path):
        self.path, self.pos, self.buf = path, 0, ""

    def lines(self) -> list[str]:
        try:
            with self.path.open("r", errors="replace") as f:
                f.seek(self.pos)
                data = f.read()
                self.pos = f.tell()
        except OSError:
            return []
        self.buf += data
        *done, self.buf = self.buf.split("\n")
        return done


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, flush=True)


def _fmt(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f}s"


def _print_recoveries(out: Path, quiet: bool) -> None:
    path = out / "events.jsonl"
    if quiet or not path.exists():
        return
    for e in read_jsonl(path):
        if e.get("type") == "recovery":
            print(
                f"recovery at step {e['step']}: {e['fault']}; {e['from_plan']} -> {e['to_plan']} "
                f"via {e['rung']}; kill->error {_fmt(e['kill_to_error_s'])}; "
                f"MTTR {e['mttr_s']:.2f}s "
                f"(detect {e['detect_s']:.2f}, plan {e['plan_s']:.3f}, compile "
                f"{e['compile_s']:.2f}, transfer {e['transfer_s']:.3f}, verify "
                f"{e['verify_s']:.3f}, snapshot {e['snapshot_s']:.3f}, first step "
                f"{e['first_step_s']:.3f})",
                flush=True,
            )
        elif e.get("type") == "end":
            print(f"final loss {e['final_loss']:.6f} at step {e['step'] - 1}; plan {e['plan']}")


# ---------------------------------------------------------------------------------------------
# Worker entry point: `python -m elasjax.launch CONFIG --coordinator ... --process-id I`.


def worker_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="python -m elasjax.launch", description=__doc__)
    ap.add_argument("config", nargs="?", default=None)
    ap.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--devices-per-process", type=int, default=2)
    ap.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--heartbeat-timeout", type=int, default=5)
    ap.add_argument("--collective-timeout", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--kill", action="append", default=[], metavar="STEP:PROCESS")
    ap.add_argument("--out", default=None)
    ap.add_argument("--die-with-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    return ap


def worker_main(args: argparse.Namespace) -> int:
    rc = RuntimeConfig(
        args.coordinator,
        args.num_processes,
        args.process_id,
        args.platform,
        args.devices_per_process,
        args.heartbeat_timeout,
        args.collective_timeout,
    )
    kills = [KillSpec.parse(k) for k in args.kill]
    return run_worker(args.config, args.set, rc, args.out, kills)


def _die_with_parent(parent: int) -> None:
    """Linux: get SIGKILL when the launcher dies, so a killed launcher strands no worker."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    args = worker_parser().parse_args(argv)
    if args.die_with_parent is not None:
        _die_with_parent(args.die_with_parent)
    try:
        return worker_main(args)
    except (ConfigError, ValueError, FileNotFoundError, RejoinUnsupportedError) as e:
        print(f"[elasjax p{args.process_id}] error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # the process ends here: say why in one line, then the traceback
        print(
            f"[elasjax p{args.process_id}] training stopped: {type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        raise


if __name__ == "__main__":
    sys.exit(main())
