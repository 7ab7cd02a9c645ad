"""A user's script as a process of a job: `elasjax launch SCRIPT.py --processes P ...` starts P of
these (`python -m elasjax.launch.script SCRIPT.py --coordinator ... --process-id I ... -- ARGS`).

The worker joins the job (`jax.distributed` through the coordination process, the
multi-controller runtime with its detectors), hands the runtime to the script's `ElasticState`
(`runtime.job`), then runs the script as `__main__` with `ARGS` as its `sys.argv[1:]`. The
script's loop stays the script's: each step in `with step:` of `ElasticState.steps`, which a
process death interrupts and redoes on the recovered state (docs/api.md, "Your own loop under
launch").

`--kill STEP:PROCESS` counts the steps the script commits (`ElasticState.commit(state, STEP)`):
the process SIGKILLs itself right after that commit was dispatched; `--kill STEP:PROCESS:PHASE`
as that phase of the recovery begins, or with `admission` as the first admission of a
restarted process at a step's start from STEP on moves the state. A kill whose step the
script never committed, an admission kill that never fired (no restart admitted from its step
on), and a script that never committed at all while kills were scheduled, end the worker with
a usage error (exit 2) after the script returned.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections import defaultdict
from pathlib import Path

from ..config import ConfigError, load
from ..runtime.startup import RuntimeConfig, add_setting_flags, resolve_settings, settings_of
from .process import ADMISSION, KillSpec, _fail, _leave, _shutdown, join_job

USAGE_ERROR = 2


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m elasjax.launch.script", description=__doc__)
    ap.add_argument("script")
    ap.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--devices-per-process", type=int, default=2)
    ap.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    add_setting_flags(ap)
    ap.add_argument("--kill", action="append", default=[], metavar="STEP:PROCESS")
    ap.add_argument("--die-with-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    return ap


def check_script(script: str) -> Path:
    """The script's path, or a clear error."""
    path = Path(script)
    if path.suffix != ".py" or not path.is_file():
        raise FileNotFoundError(
            f"launch: script {script!r} is not a Python file here; allowed: a path to a .py "
            "file (your training script) or a config (.yaml)")
    return path


def check_flags(script: str, given: dict) -> None:
    """Refuse the flags that apply to elasjax's own loop (a config), by name. `given`: flag ->
    its value (a false value: not given)."""
    named = [flag for flag, v in given.items() if v]
    if named:
        raise ConfigError(
            f"launch of a script ({script}): {', '.join(named)} apply to elasjax's own loop (a "
            "config); a script takes its own arguments after '--', the detector's flags and "
            "--kill STEP:PROCESS")


def kills_by_step(kills, processes: int) -> dict[int, dict[str, tuple[int, ...]]]:
    """`--kill` options -> step -> phase ("step", "recovery/..." or "admission") -> processes,
    checked against the job's size: a recovery-phase kill needs a kill at its step to start that
    recovery, an admission's a kill at or before its step, and one process must survive."""
    out: dict[int, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for k in kills:
        if not 0 <= k.process < processes:
            raise ValueError(f"--kill {k}: process {k.process} does not exist; allowed "
                             f"processes: 0 .. {processes - 1}")
        out[k.at_step][k.phase].add(k.process)
    for step, phases in out.items():
        if set(phases) - {"step", ADMISSION} and "step" not in phases:
            raise ValueError(
                f"--kill {step}:...:"
                f"{next(p for p in phases if p not in ('step', ADMISSION)).split('/')[1]}: no "
                f"kill at step {step} starts a recovery for it; add --kill {step}:PROCESS")
        if ADMISSION in phases and not any(s <= step and "step" in ph for s, ph in out.items()):
            raise ValueError(
                f"--kill {step}:...:{ADMISSION}: no kill at or before step {step} makes a "
                f"process to restart and admit; add --kill STEP:PROCESS with STEP <= {step} "
                "(and --worker-restarts)")
    if len({p for ph in out.values() for ps in ph.values() for p in ps}) >= processes:
        raise ValueError(f"--kill {' '.join(str(k) for k in kills)} kills every process; at "
                         "least one must survive")
    return {s: {ph: tuple(sorted(ps)) for ph, ps in phases.items()} for s, phases in out.items()}


def run_script(path: Path, argv: list[str], rc: RuntimeConfig,
               kills: dict[int, tuple[int, ...]]) -> int:
    """Join the job, run the script in it, leave; returns the exit code. `kills`:
    `kills_by_step`."""
    from ..runtime import job

    rt = join_job(rc)
    if rt is None:
        return 0
    state = job.ScriptJob(rt, kills)
    job.set_current(state)
    finished = False
    try:
        sys.argv = [str(path), *argv]
        sys.path.insert(0, str(path.resolve().parent))
        runpy.run_path(str(path), run_name="__main__")
        finished = True
    except SystemExit as e:  # the script's own exit
        finished = e.code in (None, 0)
        if not finished:
            raise
    finally:
        rt.close(finished=finished)
    unmet = state.unmet_kills()
    if unmet:
        last = state.last_commit
        said = ("the script never committed a step (ElasticState.commit)" if last is None
                else f"the script's last commit was step {last}")
        rt.log(f"error: --kill {', '.join(f'{s}:{list(p)}' for s, p in unmet)} never happened: "
               f"{said}; allowed kill steps: "
               + ("none" if last is None else f"0 .. {last}"))
        _shutdown()
        return USAGE_ERROR
    late = state.unmet_admission_kills(rt)
    if late:
        rt.log(f"error: --kill {', '.join(f'{s}:{rt.me}:admission' for s in late)} never "
               f"happened: no restarted process was admitted at a step's start from step "
               f"{late[0]} on before the script's last commit ({state.last_commit}); give the "
               "restart time to arrive (more steps, or an earlier kill to restart)")
        _shutdown()
        return USAGE_ERROR
    rt.log("done: the script returned")
    _shutdown()
    return 0


def worker_main(args: argparse.Namespace, script_args: list[str]) -> int:
    """One process of a script's job: the local launcher's workers (`main`) and
    `elasjax launch SCRIPT.py --coordinator ...` / `--cluster` on a cluster, whose scheduler
    starts one per host. Usage errors raise `ConfigError`/`ValueError`/`FileNotFoundError`
    before the job is joined; a finished script ends the process here (`_leave`)."""
    path = check_script(args.script)
    rc = RuntimeConfig(
        args.coordinator, args.num_processes, args.process_id, args.platform,
        args.devices_per_process, **resolve_settings(load(None).launch, settings_of(args)),
    )
    kills = kills_by_step([KillSpec.parse(k) for k in args.kill], args.num_processes)
    try:
        code = run_script(path, script_args, rc, kills)
    except Exception as e:
        print(f"[elasjax p{args.process_id}] the script stopped: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        _fail()
    _leave(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1:]
    args = parser().parse_args(argv)
    if args.die_with_parent is not None:
        from ..runtime.liveness import die_with_parent

        die_with_parent(args.die_with_parent)
    try:
        return worker_main(args, script_args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"[elasjax p{args.process_id}] error: {e}", file=sys.stderr, flush=True)
        return USAGE_ERROR


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
