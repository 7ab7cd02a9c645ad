"""The local launcher of `elasjax launch`: a job's processes on this machine (loopback).

It starts the coordination process first (`elasjax.runtime.coordinator`: JAX's coordination
service in a process of its own, so any worker may die, process 0 included), then the workers
(`python -m elasjax.launch.process`, `elasjax.launch.process.worker_main`), each its own process
group; it watches them (`_monitor`: the end of the run, a death, the coordination process lost, the
timeout), SIGKILLs what is left on the way out and writes `launch.json`. The coordination
process's death ends every worker; the launcher then reports it and reaps whatever is left (see
docs/multiprocess.md). `--worker-restarts N` starts dead workers again to rejoin the running job
(`_Restarts`); `--max-restarts N` starts the whole job again from its newest checkpoint
(`elasjax.launch.supervisor`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from ..config import Config, ConfigError, load
from ..observe.events import load_hooks
from ..observe.metrics import read_jsonl
from ..observe.tensorboard import check_available as check_tensorboard
from ..plan.planner import Topology
from ..runtime import coordinator
from ..runtime.faults import MULTI_CONTROLLER, FaultEvent, resolve_schedule
from ..runtime.startup import (
    COORDINATION_HEARTBEAT_S,
    RuntimeConfig,
    resolve_settings,
    xla_flags,
)
from .process import KillSpec, import_modules, parse_slow, parse_spares, resolve_config
from .supervisor import (
    RESTARTABLE,
    USAGE_ERROR,
    RestartPolicy,
    SupervisorLog,
    check_out,
    check_supervisable,
    plan_restart,
    restarts_line,
    stop_reason,
)


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
    incarnation: int = 0  # 0: started with the job; k: its k-th restart (`_Restarts`)
    stopped_at_end: bool = False  # stopped (SIGSTOP) when the job finished: ended by `_reap`

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
    slow: str | None = None,
    timeout_s: float = 900.0,
    quiet: bool = False,
    imports: Sequence[str] = (),
    spares: int | str | None = None,
    hooks: Sequence[str] = (),
    max_restarts: int = 0,
    restart_backoff_s: float = 2.0,
    kill_coordinator: int | None = None,
    worker_restarts: int = 0,
    script_args: Sequence[str] = (),
    **settings,
) -> int:
    """Start `processes` workers on this machine (loopback), plus `spares` hot spare workers
    (None: the config's `parallel.spares`), wait for them, reap them. `settings`: the
    detector's (`startup.SETTINGS`, by field name, e.g. `collective_timeout_s=1`); each one
    given wins over the config's `launch` section, which decides the rest.

    Returns 0 when a worker finished the run (the others survived as deaths), 3 when the
    coordination process died (the job cannot continue), 1 on any other failure or on
    `timeout_s`. Every worker is its own process group and is SIGKILLed on the way out if still
    running. Writes `launch.json` (per-process exit status) and `worker<i>.log` to `out`.

    `max_restarts` > 0 supervises the job (`elasjax.launch.supervisor`): when it cannot continue,
    every process is reaped and the whole job starts again as a new job (fresh coordinator port)
    resuming from the newest checkpoint of `checkpoint.dir`, after `restart_backoff_s` (doubled
    at each next restart), at most `max_restarts` times within `timeout_s` in all. The return
    code is then the last attempt's. Each ended attempt's files move to `out/attempt<k>/`;
    `supervisor.jsonl` records every restart and the end. `max_restarts` 0 changes nothing.

    `worker_restarts` > 0: a worker that dies is started again, at most that many times in
    all (`_Restarts`; backoff `restart_backoff_s`, doubled per restart of one process); the
    restarted process rejoins the running job, which grows back onto its devices
    (`elasjax.loop.admission`).

    `kill_coordinator` (a step): the launcher SIGKILLs the coordination process once that step's
    metrics row is logged, in the first attempt only (the loss of the node it runs on).

    A `config_path` ending in `.py` is the user's own training script: every worker runs it
    (`elasjax.launch.script`) with `script_args`, its `ElasticState` on the job's runtime; the
    kills count the steps it commits. What needs elasjax's loop (a config's `--set`, spares,
    supervised restarts of the whole job, the coordination process's kill) is refused by name.
    """
    for flag, v in (("--processes", processes), ("--devices-per-process", devices_per_process)):
        if v < 1:
            raise ConfigError(f"{flag} {v}: allowed values: an integer >= 1")
    if not isinstance(worker_restarts, int) or worker_restarts < 0:
        raise ConfigError(f"--worker-restarts {worker_restarts!r}: allowed values: an integer "
                          ">= 0 (dead workers started again to rejoin the job; 0: never)")
    if config_path is not None and str(config_path).endswith(".py"):
        return _launch_script(
            config_path, script_args, processes=processes,
            devices_per_process=devices_per_process, out=out, kills=kills, timeout_s=timeout_s,
            quiet=quiet, refused={"--set": list(overrides), "--slow": slow,
                                  # (`--standby`, `--optimizer` and `--tensorboard` arrive as --set)
                                  "--import": list(imports), "--hook": list(hooks),
                                  "--spares": spares, "--max-restarts": max_restarts,
                                  "--kill-coordinator": kill_coordinator},
            worker_restarts=worker_restarts, restart_backoff_s=restart_backoff_s,
            settings=settings)
    if script_args:
        raise ConfigError(f"arguments after '--' ({' '.join(script_args)}) go to a launched "
                          "script (a .py file); a config takes --set KEY=VALUE")
    policy = RestartPolicy(max_restarts, restart_backoff_s)
    # Fail fast, before any process starts: config, kill schedule and initial plan (pure).
    import_modules(imports)
    load_hooks(hooks)  # a bad name is an error here, not in every worker
    if spares is not None:  # --spares wins over the config's parallel.spares
        overrides = [*overrides, f"parallel.spares={parse_spares(spares)}"]
    if worker_restarts:  # --worker-restarts wins over the config's recovery.worker_restarts
        overrides = [*overrides, f"recovery.worker_restarts={worker_restarts}"]
    base = load(config_path, overrides)
    detector = resolve_settings(base.launch, settings)  # a flag given wins over the section
    # the workers' config, and the run's config.yaml, say what the flags set
    overrides = [*overrides, *(f"launch.{k}={str(v).lower() if isinstance(v, bool) else v}"
                               for k, v in settings.items())]
    worker_restarts = base.recovery.worker_restarts
    if base.train.optimizer:  # a bad name is an error here too, not in every worker
        from ..layout.state import load_optimizer  # (optax and flax: only where one is named)

        load_optimizer(base.train.optimizer)
    check_tensorboard(base)  # tensorboardX missing: an error here, not in the writing worker
    processes += base.parallel.spares  # the spares run as processes of their own, last
    cfg = resolve_config(base, processes, devices_per_process, kills)
    if kill_coordinator is not None and not 0 <= kill_coordinator < cfg.train.steps - 1:
        raise ConfigError(
            f"--kill-coordinator {kill_coordinator}: allowed values: a step from 0 to "
            f"{cfg.train.steps - 2} (after that step's row is logged, before the last step)")
    check_supervisable(cfg, policy)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="elasjax-launch-"))
    check_out(out, policy)
    out.mkdir(parents=True, exist_ok=True)
    job = _Job(
        config_path, processes, devices_per_process, out, imports, hooks,
        RuntimeConfig(
            "127.0.0.1:0",  # each attempt gets a free port of its own
            processes,
            process_id=0,
            devices_per_process=devices_per_process,
            slow=parse_slow(slow, processes) if slow else None,
            **detector,
        ),
        slow,
    )
    t_start = time.time()
    sup = SupervisorLog(out, t_start) if policy.enabled else None
    attempts = _attempts(job, overrides, kills, cfg, t_start + timeout_s, quiet, policy, sup,
                         kill_coordinator, worker_restarts)
    return _report_launch(attempts, sup, policy, cfg, out, t_start, quiet)


def _launch_script(script: str, script_args: Sequence[str], *, processes: int,
                   devices_per_process: int, out, kills: Sequence[KillSpec], timeout_s: float,
                   quiet: bool, refused: dict, worker_restarts: int, restart_backoff_s: float,
                   settings: dict) -> int:
    """`launch_local` of a user's script (see there; its counts checked there): its workers run
    `launch.script`."""
    from .script import check_flags, check_script, kills_by_step

    check_flags(script, refused)
    check_script(script)
    kills_by_step(kills, processes)  # a bad process, or every process killed: an error here
    base = load(None)
    detector = resolve_settings(base.launch, settings)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="elasjax-launch-"))
    out.mkdir(parents=True, exist_ok=True)
    job = _Job(script, processes, devices_per_process, out, (), (),
               RuntimeConfig("127.0.0.1:0", processes, process_id=0,
                             devices_per_process=devices_per_process, **detector),
               None, script_args=list(script_args))
    t_start = time.time()
    policy = RestartPolicy(0, restart_backoff_s)
    a = _run_attempt(job, [], kills, base, t_start + timeout_s, quiet, policy,
                     worker_restarts=worker_restarts)
    return _report_launch([a], None, RestartPolicy(0, 0.0), None, out, t_start, quiet)


def _attempts(job: _Job, overrides: list[str], kills: Sequence[KillSpec], cfg, deadline: float,
              quiet: bool, policy: RestartPolicy, sup: SupervisorLog | None,
              kill_coordinator: int | None, worker_restarts: int) -> list[_Attempt]:
    """Run the job until it ends, and, supervised (`sup`), again as a new job from its newest
    checkpoint while `policy` and the `deadline` allow; every attempt, in order."""
    attempts: list[_Attempt] = []
    run_overrides, run_kills, run_cfg = list(overrides), list(kills), cfg
    while True:
        a = _run_attempt(job, run_overrides, run_kills, run_cfg, deadline, quiet, policy,
                         kill_coordinator if not attempts else None, worker_restarts)
        attempts.append(a)
        if sup is None:
            break
        why = stop_reason(a.outcome, a.returncode, len(sup.restarts), policy)
        delay = policy.delay(len(sup.restarts) + 1)
        if why is None and time.time() + delay >= deadline:
            why = "no time is left for a restart within the launch timeout (--timeout)"
        if why is not None:
            if a.outcome != "finished":
                sup.write("stop", attempt=len(attempts) - 1, outcome=a.outcome,
                          message=a.message, why=why)
                a.message += f"; not restarted: {why}"
            break
        _report_attempt(a, len(attempts) - 1, quiet)
        try:
            run_overrides, run_cfg = _prepare_restart(
                job, a, len(attempts) - 1, overrides, run_cfg, sup, policy, quiet
            )
        except ConfigError as e:  # stop with the reason, the launch's record written
            why = f"the restarted job's config is refused: {e}"
            sup.write("stop", attempt=len(attempts) - 1, outcome=a.outcome,
                      message=a.message, why=why)
            a.message += f"; not restarted: {why}"
            break
        run_kills = []  # the schedule, kills included, is in the `faults` override now
        time.sleep(delay)
    return attempts


def _report_launch(attempts: list[_Attempt], sup: SupervisorLog | None, policy: RestartPolicy,
                   cfg, out: Path, t_start: float, quiet: bool) -> int:
    """The launch's record (`launch.json`, the supervisor's end) and its last lines; the exit
    code (`launch_local`)."""
    last = attempts[-1]
    summary = last.summary(time.time() - t_start)
    if sup is not None:
        summary["restarts"] = sup.restarts
        summary["attempts"] = [
            {"coordinator": x.coordinator, **x.summary(None)} for x in attempts[:-1]]
        summary["coordinator"] = last.coordinator
        sup.write("end", outcome=last.outcome, restarts=len(sup.restarts),
                  max_restarts=policy.max_restarts, message=last.message)
        if sup.restarts:
            last.message += f" ({restarts_line(sup.restarts)})"
            summary["message"] = last.message
    (out / "launch.json").write_text(json.dumps(summary, indent=2))
    _say(quiet, f"elasjax launch: {last.outcome}: {last.message}")
    _say(quiet, "per process: " + _per_process(last.status))
    if last.outcome == "finished":
        _print_recoveries(out, quiet)
    elif (sup is None and cfg is not None and last.outcome in RESTARTABLE
          and last.returncode != USAGE_ERROR):
        hint = (
            "to resume from its newest checkpoint: --set checkpoint.resume_step=-1, or supervise "
            "the launch with --max-restarts N"
            if cfg.checkpoint.dir is not None
            else "with checkpoints (checkpoint.dir), --max-restarts N would restart it from the "
            "newest one"
        )
        _say(quiet, f"the job cannot continue; {hint}")
    _say(quiet, f"outputs: {out}")
    if last.outcome == "finished" and last.returncode == USAGE_ERROR:
        # the run ended, but a worker refused what it was asked (a scheduled kill that never
        # fired, `launch.script`): the launch did not do what its command said
        bad = [s["process"] for s in last.status if s["returncode"] == USAGE_ERROR]
        _say(quiet, f"elasjax launch: process(es) {bad} exited with a usage error (exit "
                    f"{USAGE_ERROR}); their logs say why")
        return USAGE_ERROR
    return {"finished": 0, "coordinator_lost": 3}.get(last.outcome, 1)


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every attempt of one launch starts with."""

    config_path: str | None
    processes: int
    devices_per_process: int
    out: Path
    imports: Sequence[str]
    hooks: Sequence[str]
    rc: RuntimeConfig  # its coordinator is replaced by each attempt's
    slow: str | None
    script_args: Sequence[str] | None = None  # a user's script (`config_path`) and its argv

    def command(self, coordinator: str, process: int, overrides, kills) -> list[str]:
        rc = self.rc
        if self.script_args is not None:
            return [
                sys.executable, "-u", "-m", "elasjax.launch.script", str(self.config_path),
                "--coordinator", coordinator, "--num-processes", str(self.processes),
                "--process-id", str(process), "--devices-per-process",
                str(self.devices_per_process), *rc.settings_argv(),
                *(a for k in kills for a in ("--kill", str(k))),
                "--die-with-parent", str(os.getpid()), "--", *self.script_args,
            ]
        cmd = [
            sys.executable,
            "-u",
            "-m",
            "elasjax.launch.process",
            *([self.config_path] if self.config_path else []),
            "--coordinator",
            coordinator,
            "--num-processes",
            str(self.processes),
            "--process-id",
            str(process),
            "--devices-per-process",
            str(self.devices_per_process),
            *rc.settings_argv(),
            *(["--slow", self.slow] if self.slow else []),
            "--out",
            str(self.out),
            "--die-with-parent",
            str(os.getpid()),
        ]
        for o in overrides:
            cmd += ["--set", o]
        for k in kills:
            cmd += ["--kill", str(k)]
        for m in self.imports:
            cmd += ["--import", m]
        for h in self.hooks:
            cmd += ["--hook", h]
        return cmd


@dataclasses.dataclass
class _Attempt:
    """One start of the whole job, from its processes' start to their reaping."""

    coordinator: str
    t_start: float
    outcome: str
    message: str
    status: list[dict]
    kill_steps: dict[int, int]  # process -> the step of its scheduled kill
    coordination: dict  # the coordination process: pid, returncode, log

    @property
    def returncode(self) -> int | None:
        """`USAGE_ERROR` when a worker exited with it (a config or usage error: every attempt
        would), else the exit status of the lowest worker."""
        codes = [s["returncode"] for s in self.status]
        return USAGE_ERROR if USAGE_ERROR in codes else codes[0]

    def killed_as_scheduled(self) -> set[int]:
        return {s["process"] for s in self.status
                if s["scheduled_kill"] is not None and s["signal"] == "SIGKILL"}

    def summary(self, elapsed_s: float | None) -> dict:
        d = {"outcome": self.outcome, "message": self.message}
        if elapsed_s is not None:
            d["elapsed_s"] = elapsed_s
        d["left_running_after_reap"] = [
            s["process"] for s in self.status if s["running_after_reap"]]
        d["processes"] = [{k: v for k, v in s.items() if k != "running_after_reap"}
                          for s in self.status]
        d["coordination"] = self.coordination
        return d


class _Restarts:
    """Dead workers started again (`--worker-restarts N`): each replacement takes the dead
    worker's process id and asks to rejoin the running job (`runtime.membership`), which admits
    it at a step boundary and grows back onto its devices. At most `budget` restarts in all,
    the k-th of one process `backoff_s` x 2^(k-1) seconds after its death; none once a worker
    has finished the run."""

    def __init__(self, budget: int, backoff_s: float, start):
        """`start(index, incarnation)`: a new `_Proc` for that process id."""
        self.left, self.backoff_s, self.start = budget, backoff_s, start
        self.due: list[tuple[float, int]] = []  # (when, process id)
        self.count: dict[int, int] = defaultdict(int)

    def died(self, p: _Proc, now: float) -> str | None:
        """Schedule p's restart if the budget allows; returns the line to say."""
        if self.left <= 0:
            return None
        self.left -= 1
        self.count[p.index] += 1
        k = self.count[p.index]
        delay = self.backoff_s * 2 ** (k - 1)
        self.due.append((now + delay, p.index))
        return (f"process {p.index} will be restarted in {delay:g}s to rejoin the job "
                f"(restart {k} of it; {self.left} left)")

    def start_due(self, now: float) -> list[_Proc]:
        started = []
        for when, i in [d for d in self.due if d[0] <= now]:
            self.due.remove((when, i))
            proc = self.start(i, self.count[i])
            started.append(proc)
        return started


def _run_attempt(job: _Job, overrides, kills, cfg: Config, deadline: float, quiet: bool,
                 policy: RestartPolicy, kill_coordinator: int | None = None,
                 worker_restarts: int = 0) -> _Attempt:
    """Start every process of the job on a fresh coordinator port, monitor them, reap them."""
    topo = Topology(tuple(range(job.processes * job.devices_per_process)), job.devices_per_process)
    events = (resolve_schedule(cfg.faults, topo, cfg.train.steps, MULTI_CONTROLLER,
                               cfg.recovery.worker_restarts) if job.script_args is None
              else [FaultEvent(k.at_step, (), "process", f"process {k.process}",
                               phase=k.phase, hosts=(k.process,)) for k in kills])
    scheduled = {
        h: f"{e.at_step}:{h}" + (f" during the {e.phase}" if e.phase != "step" else "")
        for e in events
        for h in e.hosts
    }
    kill_steps = {h: e.at_step for e in events for h in e.hosts}
    rc0 = dataclasses.replace(job.rc, coordinator=f"127.0.0.1:{_free_port()}")
    # the job's processes on this host (`worker.local_processes`: a compile worker's pace)
    env = dict(os.environ, PYTHONUNBUFFERED="1", ELASJAX_LOCAL_PROCESSES=str(job.processes))
    env["XLA_FLAGS"] = xla_flags(rc0, env.get("XLA_FLAGS", ""))
    procs: list[_Proc] = []
    t_start = time.time()
    if kill_coordinator is not None:  # its rows decide the kill: none of an earlier run's
        (job.out / "metrics.jsonl").unlink(missing_ok=True)
    coord = coordinator.start_local(
        int(rc0.coordinator.rsplit(":", 1)[1]), job.processes,
        max(rc0.heartbeat_timeout_s, COORDINATION_HEARTBEAT_S), job.out / "coordinator.log",
        env=dict(os.environ),
    )

    def start(i: int, incarnation: int = 0) -> _Proc:
        log = job.out / (f"worker{i}.log" if not incarnation else f"worker{i}.r{incarnation}.log")
        with log.open("wb") as fh:
            p = subprocess.Popen(
                job.command(rc0.coordinator, i, overrides, kills), stdout=fh,
                stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        return _Proc(i, p, log, incarnation=incarnation)

    restarts = _Restarts(worker_restarts, policy.backoff_s, start) if worker_restarts else None
    try:
        for i in range(job.processes):
            procs.append(start(i))
        pids = {"launcher": os.getpid(), "workers": [q.popen.pid for q in procs],
                "coordinator": coord.pid}
        (job.out / "pids.json").write_text(json.dumps(pids))
        outcome, message = _monitor(
            procs, coord, scheduled, deadline, job.rc.heartbeat_timeout_s, quiet,
            (kill_coordinator, job.out / "metrics.jsonl"), restarts,
        )
    finally:
        left = _reap(procs)
        coord_rc = _stop_coordinator(coord)
    status = []
    for p in procs:
        rc = p.returncode
        status.append(
            {
                "process": p.index,
                "incarnation": p.incarnation,
                "returncode": rc,
                "signal": signal.Signals(-rc).name if rc is not None and rc < 0 else None,
                "scheduled_kill": (str(scheduled[p.index]) if p.index in scheduled
                                   and not p.incarnation else None),
                "pid": p.popen.pid,
                "ended_after_s": None if p.ended_at is None else round(p.ended_at - t_start, 3),
                "log": str(p.log),
                "running_after_reap": p.popen.poll() is None,
                "stopped_at_end": p.stopped_at_end,
            }
        )
    if left:
        message += f"; SIGKILLed {len(left)} process(es) still running: {left}"
        stopped = [p.index for p in procs if p.stopped_at_end]
        if stopped:
            message += f" (stopped when the job finished: {stopped})"
    coordination = {"pid": coord.pid, "returncode": coord_rc,
                    "log": str(job.out / "coordinator.log"),
                    "running_after_reap": coord.poll() is None}
    return _Attempt(rc0.coordinator, t_start, outcome, message, status, kill_steps,
                    coordination)


def _prepare_restart(job: _Job, a: _Attempt, index: int, overrides: Sequence[str], cfg: Config,
                     sup: SupervisorLog, policy: RestartPolicy, quiet: bool
                     ) -> tuple[list[str], Config]:
    """After attempt `index` ended and every process was reaped: what the next attempt runs,
    checked like the first (`resolve_config`), then recorded and said."""
    rs = plan_restart(
        job.out, index, a.outcome, a.message, cfg.faults, a.killed_as_scheduled(), a.kill_steps,
        cfg.checkpoint.dir, overrides, len(sup.restarts) + 1, policy,
    )
    new_cfg = resolve_config(
        load(job.config_path, rs.overrides), job.processes, job.devices_per_process
    )
    sup.write("restart", **rs.record)
    _say(quiet, rs.line)
    return list(rs.overrides), new_cfg


def _report_attempt(a: _Attempt, index: int, quiet: bool) -> None:
    _say(quiet, f"elasjax launch: attempt {index} ended: {a.outcome}: {a.message}")
    _say(quiet, "per process: " + _per_process(a.status))


def _per_process(status: list[dict]) -> str:
    return ", ".join(f"p{s['process']}={s['signal'] or s['returncode']}" for s in status)


def _monitor(procs, coord, scheduled, deadline, heartbeat_s, quiet,
             kill_coordinator=(None, None), restarts: _Restarts | None = None) -> tuple[str, str]:
    """Wait until every worker has ended, or the coordination process has (no worker can go
    on without its service), or a worker finished the run and the others did not follow within
    a grace. Shows the lines of the lowest worker still in the job (the one that writes).
    `kill_coordinator`: (step, metrics path): SIGKILL the coordination process once that step's
    row is logged (None: never). `restarts`: dead workers are started again (appended to
    `procs`)."""
    tails = [_Tail(p.log) for p in procs]
    failures: list[_Proc] = []  # ended with an error nobody scheduled, in order
    kill_step, metrics = kill_coordinator
    rows = _Tail(metrics) if kill_step is not None else None
    killed = None  # the step after which the coordination process was killed as scheduled
    while True:
        now = time.time()
        if rows is not None and killed is None and any(
                json.loads(ln).get("step", -1) >= kill_step for ln in rows.lines() if ln):
            killed = kill_step
            with contextlib.suppress(ProcessLookupError):
                os.kill(coord.pid, signal.SIGKILL)
            _say(quiet, "the coordination process was killed as scheduled (after step "
                        f"{kill_step})")
        finished = any(p.ended_at is not None and p.returncode == 0 for p in procs)
        # whose lines are shown, chosen before this look at the exits: a worker that ends now
        # still has its last lines shown (its error's; it leaves at once, `process._fail`)
        shown = next((p for p in procs if p.ended_at is None or p.returncode == 0), None)
        for p in list(procs):
            if p.ended_at is None and p.popen.poll() is not None:
                p.ended_at = now
                rc = p.returncode
                if p.index in scheduled and rc == -signal.SIGKILL:
                    _say(quiet, f"process {p.index} was killed as scheduled ({scheduled[p.index]})")
                elif rc != 0:
                    failures.append(p)
                    _say(quiet, f"process {p.index} ended with {_rc(rc)} (not scheduled): "
                                f"{_last_error(p.log)}")
                line = (restarts.died(p, now) if restarts is not None and rc != 0
                        and not finished else None)
                if line:
                    _say(quiet, line)
        if restarts is not None and not finished:
            for p in restarts.start_due(now):
                procs.append(p)
                tails.append(_Tail(p.log))
                _say(quiet, f"process {p.index} restarted (pid {p.popen.pid}, log {p.log.name})")
        for p, tail in zip(procs, tails):
            for line in tail.lines():
                if not quiet and p is shown and line.startswith("[elasjax"):
                    print(line, flush=True)
        if coord.poll() is not None:
            how = ("was killed as scheduled after step "
                   f"{killed} (--kill-coordinator; not repeated in a restart)" if killed is not None
                   else f"ended with {_rc(coord.returncode)}")
            return "coordinator_lost", f"the coordination process {how}; {_COORD}"
        done = [p for p in procs if p.ended_at is not None and p.returncode == 0]
        if all(p.ended_at is not None for p in procs) and not (
                restarts is not None and restarts.due and not done):
            break
        if done and now > min(p.ended_at for p in done) + heartbeat_s + 15:
            break  # grace for the others to end themselves
        left = [p for p in procs if p.ended_at is None]
        if done and left and all(_stopped(p.popen.pid) for p in left):
            # a stopped worker cannot end itself, and continued after its job ended it was
            # aborted by XLA's coordination agent (SIGABRT, 2 of 5 stop probes:
            # experiments/RESULTS.md, "The MTTR battery"): the job is over, it is ended now
            for p in left:
                p.stopped_at_end = True
                _say(quiet, f"process {p.index} is stopped (SIGSTOP) and the job finished "
                            "without it: the launcher ends it")
            break
        if now > deadline:
            return "timeout", "the job did not finish within the launch timeout"
        time.sleep(0.2)
    done = [p for p in procs if p.returncode == 0]
    if done:
        survived = "; ".join(f"process {p.index} ended with {_rc(p.returncode)}" for p in failures)
        extra = f" (survived: {survived})" if survived else ""
        return "finished", f"process {done[0].index} finished the run{extra}"
    if failures:
        p = failures[0]
        return "failed", f"process {p.index} exited with {_rc(p.returncode)}: {_last_error(p.log)}"
    return "failed", "every process was killed as scheduled: nobody is left to train"


_COORD = (
    "it hosts the JAX coordination service, which every training process needs (the runtime "
    "ends them)"
)


def _stop_coordinator(coord: subprocess.Popen) -> int | None:
    """End the coordination process once the workers are reaped: SIGTERM, then SIGKILL."""
    if coord.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            coord.terminate()
        try:
            coord.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(coord.pid, signal.SIGKILL)
            coord.wait(timeout=10)
    return coord.returncode


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


STACKS_S = 1.0  # what a worker gets to write its stacks before the SIGKILL


def _stopped(pid: int) -> bool:
    """Is process `pid` stopped (SIGSTOP, or traced and stopped: /proc state T or t)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _registered(log: Path) -> bool:
    """Has the worker logging to `log` registered its stack dump (it logs as `[elasjax pN]`
    only after `process.run_worker` did)? SIGUSR1 would end one still starting."""
    try:
        with log.open("rb") as f:
            return b"[elasjax p" in f.read(1 << 20)
    except OSError:
        return False


def _reap(procs: Sequence[_Proc]) -> list[int]:
    """SIGKILL the process group of every worker still running; returns their indices. Each
    is first asked for its threads' stacks (SIGUSR1: `process.run_worker` registers Python's
    faulthandler for it), written to its log: a finished worker that did not exit within the
    grace says there where it was held (experiments/RESULTS.md, "The bitwise sweep": 2 of 10
    launches of the ZeRO demo ended so, with nothing in the logs to say why)."""
    asked = [p for p in procs if p.popen.poll() is None and _registered(p.log)
             and not _stopped(p.popen.pid)]  # a stopped one would not answer
    for p in asked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.popen.pid, signal.SIGUSR1)
    if asked:
        time.sleep(STACKS_S)
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
                f"via {e['rung']}; kill->detected {_fmt(e.get('kill_to_detect_s'))} "
                f"({e.get('detected_by', 'n/a')}); "
                f"MTTR {e['mttr_s']:.2f}s "
                f"(detect {e['detect_s']:.2f}, plan {e['plan_s']:.3f}, compile "
                f"{e['compile_s']:.2f}, transfer {e['transfer_s']:.3f}, verify "
                f"{e['verify_s']:.3f}, snapshot {e['snapshot_s']:.3f}, first step "
                f"{e['first_step_s']:.3f}; standby hit {e['standby_hit']}; "
                f"{e['bytes_cross_process'] / 1e6:.2f} MB across processes)",
                flush=True,
            )
            if e.get("spare_took_over"):
                print(
                    f"spare took over at step {e['step']}: process(es) {e['spare_took_over']} in "
                    f"the place of {e.get('failed_processes')}; n_devices "
                    f"{e['from_n_devices']} -> {e['to_n_devices']}",
                    flush=True,
                )
        elif e.get("type") == "end":
            if e["final_loss"] is None:
                print(f"no step left to train: resumed at step {e['step']}, the run's end; "
                      f"plan {e['plan']}")
            else:
                print(f"final loss {e['final_loss']:.6f} at step {e['step'] - 1}; "
                      f"plan {e['plan']}")


