"""`elasjax launch`: one job as P cooperating processes on JAX's multi-controller runtime,
surviving real process failures (SIGKILL). This module is a process of the job: the config as a
launch runs it (`resolve_config`), and the worker (`python -m elasjax.launch.process CONFIG
--coordinator ... --process-id I`, `worker_main`), which joins the job and trains. The local launcher, which
starts the coordination process and the workers on this machine, watches, reaps and restarts
them, is `elasjax.launch.local`.

Each worker runs the same `trainer.Trainer` as `elasjax train`, on the multi-controller runtime
(`elasjax.runtime.multicontroller`): every feature the trainer has (ZeRO, pipelines and async migration,
deterministic mode, standby executables, prepared transitions, buddy snapshots, checkpoints,
evaluation, the baselines) runs here too, and a config that cannot is refused before any process
starts (`resolve_config`).

Fault injection is real and comes from the one fault schedule: `{at_step, kill_process: P}`
entries of the config, to which `--kill STEP:PROCESS` adds. The targeted process sends itself
SIGKILL right after dispatching step STEP (its collectives are in flight), or, with
`phase: recovery`, during the transfer of the recovery at that step; the wall time of the kill
goes to the coordination service's key-value store so survivors can report kill -> error.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import jax

from ..config import Config, ConfigError, FaultConfig, load
from ..observe.events import import_user_module, load_hooks
from ..plan.planner import Topology, initial_plan
from ..runtime.faults import MULTI_CONTROLLER, resolve_schedule
from ..runtime.liveness import die_with_parent
from ..runtime.membership import JobEndedError
from ..runtime.multicontroller import MultiControllerRuntime, RejoinUnsupportedError
from ..runtime.startup import (
    RuntimeConfig,
    add_setting_flags,
    initialize,
    resolve_settings,
    settings_of,
)
from ..transfer.snapshot import check_coverable

# ---------------------------------------------------------------------------------------------
# The config as a launch runs it.


@dataclasses.dataclass(frozen=True)
class KillSpec:
    """SIGKILL process `process` right after it dispatches step `at_step` (`--kill STEP:PROCESS`,
    the same as a config fault `{at_step, kill_process}`), or, with a phase (`--kill
    STEP:PROCESS:PHASE`, PHASE one of `KILL_PHASES`), as that phase of the recovery another kill
    at the same step started begins (`{at_step, kill_process, phase: recovery/PHASE}`). A
    kill may also name the phase `admission`: as the first admission of a restarted process at a
    step's start from STEP on moves the state (`{at_step, kill_process, phase: admission}`)."""

    at_step: int
    process: int
    phase: str = "step"  # "step", "recovery/<one of KILL_PHASES>" or "admission"

    @classmethod
    def parse(cls, text: str) -> KillSpec:
        parts = [p.strip() for p in text.split(":")]
        if len(parts) not in (2, 3) or not parts[0].isdigit() or not parts[1].isdigit() or (
                len(parts) == 3 and parts[2] not in (*KILL_PHASES, ADMISSION)):
            raise ConfigError(
                f"--kill {text!r} must look like STEP:PROCESS (after dispatching step STEP) or "
                f"STEP:PROCESS:PHASE (PHASE one of {', '.join(KILL_PHASES)}: in the recovery "
                f"another kill at step STEP started; or {ADMISSION}: as the first admission of a "
                "restarted process from step STEP on moves the state), "
                "e.g. --kill 3:2 --kill 3:1:transfer")
        phase = ("step" if len(parts) == 2 else ADMISSION if parts[2] == ADMISSION
                 else f"recovery/{parts[2]}")
        return cls(int(parts[0]), int(parts[1]), phase)

    def __str__(self) -> str:
        tail = "" if self.phase == "step" else ":" + self.phase.split("/", 1)[-1]
        return f"{self.at_step}:{self.process}{tail}"


# the recovery phases a `--kill` may name (`config.FaultConfig.phase` without `recovery/`)
KILL_PHASES = ("plan", "transfer", "verify", "first_step")
# an admission's phase (`config.FaultConfig.phase`; a script's: `runtime.job.ScriptJob`)
ADMISSION = "admission"


def parse_slow(text: str, processes: int) -> tuple[int, float, int, int]:
    """`P:FACTOR:FROM_STEP:STEPS` -> `RuntimeConfig.slow` (a slow process, for benchmarks)."""
    parts = text.split(":")
    try:
        p, factor, start, steps = int(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])
        if len(parts) != 4:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(
            f"--slow {text!r} must look like PROCESS:FACTOR:FROM_STEP:STEPS, e.g. --slow 1:3:2:50"
        ) from None
    if not (0 <= p < processes and factor >= 1 and start >= 0 and steps >= 1):
        raise ConfigError(
            f"--slow {text!r}: PROCESS in 0 .. {processes - 1}, FACTOR >= 1, FROM_STEP >= 0, "
            "STEPS >= 1"
        )
    return p, factor, start, steps


def parse_spares(text: str | int) -> int:
    """`--spares K`: hot spare processes on top of `--processes` (`parallel.spares`)."""
    try:
        k = int(str(text).strip())
    except ValueError:
        k = -1
    if k < 0 or str(text).strip().lstrip("+") != str(k):
        raise ConfigError(
            f"--spares {text!r}: allowed values: an integer >= 0 (extra processes held outside "
            "the mesh as hot spares, e.g. --spares 1)"
        )
    return k


def resolve_config(
    cfg: Config, n_processes: int, devices_per_process: int, kills: Sequence[KillSpec] = ()
) -> Config:
    """The config as the launch runs it: all devices of all `n_processes` processes (hot spares,
    `parallel.spares`, are the last ones), a host = a process, the `--kill` options added to the
    fault schedule. Raises `ConfigError` for anything that cannot run under launch, and checks
    the whole fault schedule, before any process starts."""
    p = cfg.parallel
    k = p.spares
    if k >= n_processes:
        raise ConfigError(
            f"config 'parallel.spares' (--spares) = {k} with {n_processes} processes in all leaves "
            f"no process to train on; allowed values: 0 .. {n_processes - 1}"
        )
    total = n_processes * devices_per_process
    n = (n_processes - k) * devices_per_process  # the devices the plan trains on
    if p.devices not in (-1, n):
        spares = f", plus {k} spare process(es)" if k else ""
        raise ConfigError(
            f"config 'parallel.devices' = {p.devices} but the launch trains on {n} devices "
            f"({n_processes - k} processes x {devices_per_process}{spares}); allowed values: "
            f"-1, {n}"
        )
    faults = list(cfg.faults) + [FaultConfig(k.at_step, kill_process=k.process, phase=k.phase)
                                 for k in kills]
    faults.sort(key=lambda f: f.at_step)  # stable: a recovery-phase fault stays after its cause
    par = dataclasses.replace(p, devices=n, devices_per_host=devices_per_process)
    out = cfg.replace(parallel=par, faults=tuple(faults))
    topo = Topology(tuple(range(total)), devices_per_process)
    events = resolve_schedule(out.faults, topo, out.train.steps, MULTI_CONTROLLER,
                              out.recovery.worker_restarts)
    killed = {h for e in events for h in e.hosts}
    if killed >= set(range(n_processes)) and not out.recovery.worker_restarts:
        raise ConfigError("the fault schedule kills every process; at least one must survive")
    initial_plan(topo, out)  # a config no plan can run is an error here, not in P processes
    check_coverable(out.snapshot, topo)
    return out


def join_job(rc: RuntimeConfig) -> MultiControllerRuntime | None:
    """This process joins the job described by `rc` (elasjax's loop or a user's script alike):
    its runtime, or None for a process restarted after the run ended (said, left; no error)."""
    # the launcher asks a worker it is about to SIGKILL for its threads' stacks (`local._reap`)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    initialize(rc)
    try:
        return MultiControllerRuntime(rc)
    except JobEndedError as e:  # restarted too late: the run is over, and that is no error
        print(f"[elasjax p{rc.process_id}] {e}", flush=True)
        _shutdown()
        return None


def run_worker(
    cfg: Config,
    rc: RuntimeConfig,
    out: str | Path | None,
    kills: Sequence[KillSpec] = (),
    hooks: Sequence[str] = (),
) -> int:
    """Join the job described by `rc` and train; returns a process exit code. `hooks`:
    `MODULE:FUNCTION` names (`elasjax.observe.events`), called in this process."""
    fns = load_hooks(hooks)
    rt = join_job(rc)
    if rt is None:
        return 0
    cfg = resolve_config(cfg, jax.process_count(), len(jax.local_devices()), kills)
    try:
        from ..loop.trainer import Trainer  # here: the launcher imports this module too

        summary = Trainer(cfg, out, runtime=rt, hooks=fns).run()
    finally:  # an error exit is announced to the peers (`deathnote`), a normal one is not
        rt.close(finished=sys.exc_info()[0] is None)
    rt.log(f"done: {len(summary.losses)} steps, final plan {summary.final_plan.name}")
    _shutdown()
    return 0


def _shutdown() -> None:
    """Leave the job: the coordination service runs in a process of its own
    (`runtime.coordinator`), so no process waits for the others."""
    jax.distributed.shutdown()


# ---------------------------------------------------------------------------------------------
# Worker entry point: `python -m elasjax.launch.process CONFIG --coordinator ... --process-id I`.


def add_process_flags(ap: argparse.ArgumentParser) -> None:
    """The flags every process of a job takes (`elasjax launch` and its workers alike):
    detection timeouts, the benchmark throttle, and modules to import first."""
    add_setting_flags(ap)  # the detector's settings: `startup.SETTINGS`
    ap.add_argument("--slow", default=None, metavar="P:FACTOR:FROM_STEP:STEPS",
                    help="benchmark: make process P FACTOR times slower for STEPS steps")
    ap.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                    help="import MODULE first in every process (one that registers a ModelSpec)")
    ap.add_argument("--hook", dest="hooks", action="append", default=[],
                    metavar="MODULE:FUNCTION", help="call FUNCTION with each step's StepInfo and "
                    "each event, in every process (elasjax.observe.events)")


def worker_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="python -m elasjax.launch.process", description=__doc__)
    ap.add_argument("config", nargs="?", default=None)
    ap.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                    help="the coordination process (python -m elasjax.runtime.coordinator)")
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--devices-per-process", type=int, default=2)
    ap.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    add_process_flags(ap)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--kill", action="append", default=[], metavar="STEP:PROCESS")
    ap.add_argument("--out", default=None)
    ap.add_argument("--die-with-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    return ap


def import_modules(names: Sequence[str]) -> None:
    """Import the user's modules (`--import`), e.g. one that registers a model with
    `elasjax.register_model`. They must not create JAX arrays at import: under launch the
    backend starts only after `jax.distributed` is initialised. The current directory is
    searched first (`events.import_user_module`)."""
    for name in names:
        import_user_module(name)


def worker_main(args: argparse.Namespace) -> NoReturn:
    """One process of a job (`python -m elasjax.launch.process ...`, which the local launcher
    starts, and `elasjax launch --coordinator ...` on a cluster): join it and train. A finished
    run ends the process here (`_leave`); an error is raised to the caller."""
    import_modules(args.imports)
    cfg = load(args.config, args.set)  # its `launch` section: the flags given win over it
    rc = RuntimeConfig(
        args.coordinator, args.num_processes, args.process_id, args.platform,
        args.devices_per_process,
        slow=parse_slow(args.slow, args.num_processes) if args.slow else None,
        **resolve_settings(cfg.launch, settings_of(args)),
    )
    kills = [KillSpec.parse(k) for k in args.kill]
    _leave(run_worker(cfg, rc, args.out, kills, args.hooks))


def _leave(code: int) -> NoReturn:
    """End a worker that finished its run, closed what it owns (the trainer's files, its
    checkpoint manager, its snapshots) and left the job, without joining threads it does not
    own. Orbax's save thread of a checkpoint manager dropped at a recovery
    (`Checkpointer.reopen`) waits at barriers that include the dead process; Python joins such
    threads before it exits, and a survivor that had committed the checkpoint (Orbax's primary
    host) outlived the run until the launcher SIGKILLed it 20 s later, one death counted as two
    (tests/test_multiprocess.py::
    test_the_baselines_recover_a_sigkill_under_launch_as_they_do_in_one_process, its
    checkpoint_restart case; experiments/RESULTS.md, "A survivor held at exit by a dropped
    checkpoint manager")."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = worker_parser().parse_args(argv)
    if args.die_with_parent is not None:
        die_with_parent(args.die_with_parent)  # a killed launcher strands no worker
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
        _fail()


def _fail() -> NoReturn:
    """End a worker whose run raised: the traceback, then exit 1 without the interpreter's
    finalization, as a finished worker ends (`_leave`). Finalized beside XLA's and gloo's
    threads, a worker declared dead after a SIGSTOP ended in SIGABRT ("FATAL: exception not
    rethrown") after its `DeclaredDeadError` line (experiments/stop_probe.py; RESULTS.md, "A
    dead rank between live ones, stood in for")."""
    import traceback

    traceback.print_exc()
    _leave(1)


if __name__ == "__main__":
    sys.exit(main())
