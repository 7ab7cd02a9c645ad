"""Timing a real restart: the recovery of the checkpoint-restart baseline, in a fresh process.

A job without elastic recovery survives a failure by starting again on the survivors: a new
Python process imports the framework, starts JAX, builds the mesh and plan, compiles the train
step, restores the newest persistent checkpoint onto the new mesh and runs the steps lost since
that checkpoint. `measure_restart` launches exactly that process (`python -m elasjax.bench.restart`)
and times every phase of it, so that the baseline's MTTR is measured rather than modelled:

    python_start  spawn -> first line of this module runs (interpreter, `elasjax` package)
    imports       jax, flax, optax, orbax and elasjax's modules
    jax_init      the first `jax.devices()` call (backend start, fake CPU devices)
    plan_mesh     model shapes (`StateFactory`), the survivors' plan (`planner.replan`), mesh
    compile       `executables.compile_plan` of that plan (cold unless the config sets
                  `standby.cache_dir`, JAX's persistent compilation cache)
    restore       Orbax restore of the checkpoint onto the new mesh and its transition to the
                  plan's form (`checkpoint.restore_onto`), as `trainer.Trainer._restore` does
    verify        the restored state's checksums against the ones saved with the checkpoint
    data          the data pipeline (token source, sampler)
    first_step    one train step on the checkpoint's step

The parent also reports `total_s`, from spawn to the child's result line. Times are wall-clock
on the same machine (the spawn time crosses the process boundary through `time.monotonic`, a
system-wide clock on Linux). The child re-plans the survivors from the config's initial plan:
the plan a restarted job with the same config would run on them, which is also the plan an
in-process recovery from the initial plan chooses.

Failure here is single-process simulated device loss: the child simply does not use the failed
devices' ids; their fake CPU devices still exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULT_PREFIX = "ELASJAX_RESTART_RESULT "
PHASES = (
    "python_start",
    "imports",
    "jax_init",
    "plan_mesh",
    "compile",
    "restore",
    "verify",
    "data",
    "first_step",
)


class RestartError(RuntimeError):
    """The restart process failed or did not report a result."""


@dataclasses.dataclass(frozen=True)
class RestartTiming:
    """Phase times of one measured restart.

    Attributes:
        phases: seconds per phase, in `PHASES` order (measured in the child, `python_start`
            from the parent's spawn time).
        total_s: parent-side wall time from spawn to the child's result line.
        exit_s: parent-side wall time from spawn to the child's exit.
        plan: name of the plan the child compiled for the survivors.
        devices: the survivors' device ids the plan uses.
        checkpoint_step: the step of the restored checkpoint (= the step the first step ran).
        loss: the loss of that first step.
    """

    phases: dict[str, float]
    total_s: float
    exit_s: float
    plan: str
    devices: tuple[int, ...]
    checkpoint_step: int
    loss: float

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "devices": list(self.devices)}


def measure_restart(
    cfg: Any,
    failed: Sequence[int],
    *,
    step: int | None = None,
    n_devices: int = 8,
    python: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
) -> RestartTiming:
    """Launch `python -m elasjax.bench.restart` for the survivors of `failed` and time it.

    Args:
        cfg: the run's `config.Config`; `cfg.checkpoint.dir` must hold the checkpoint.
        failed: device ids lost to the failure (the child plans on the others of the job).
        step: checkpoint step to restore; None = the newest in `cfg.checkpoint.dir`.
        n_devices: fake CPU devices the child starts (`--xla_force_host_platform_device_count`)
            unless the inherited `XLA_FLAGS` already sets a count.
        python: interpreter to run; default the current one.
        env: extra environment variables for the child (e.g. `JAX_DISABLE_MOST_OPTIMIZATIONS`).
        timeout_s: kill the child after this many seconds.

    Returns:
        The phase times, the parent-side totals and what the child ran.

    Raises:
        ValueError: `cfg.checkpoint.dir` is not set or does not exist.
        RestartError: the child failed, timed out or reported no result.
    """
    from ..config import dump  # light: yaml and the dataclasses only

    if cfg.checkpoint.dir is None:
        raise ValueError("measure_restart needs cfg.checkpoint.dir (the checkpoint to restore)")
    if not Path(cfg.checkpoint.dir).is_dir():
        raise ValueError(f"checkpoint.dir {cfg.checkpoint.dir!r} does not exist")
    child_env = dict(os.environ)
    child_env.update(env or {})
    flags = child_env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        child_env["XLA_FLAGS"] = (
            flags + f" --xla_force_host_platform_device_count={n_devices}"
        ).strip()
    root = str(Path(__file__).resolve().parent.parent)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, child_env.get("PYTHONPATH", "")) if p
    )
    ck_dir = str(Path(cfg.checkpoint.dir).absolute())
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=ck_dir))
    with tempfile.TemporaryDirectory(prefix="elasjax_restart_") as tmp:
        cfg_path = Path(tmp) / "config.yaml"
        cfg_path.write_text(dump(cfg))
        err_path = Path(tmp) / "stderr.txt"
        argv = [python or sys.executable, "-m", "elasjax.bench.restart", "--config", str(cfg_path)]
        argv += ["--failed", ",".join(str(int(d)) for d in failed)]
        if step is not None:
            argv += ["--step", str(int(step))]
        with err_path.open("w") as err:
            t0 = time.monotonic()
            argv += ["--spawn-time", repr(t0)]
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, text=True, env=child_env
            )
            result, t_result = _read_result(proc, t0 + timeout_s)
            try:
                rc = proc.wait(timeout=max(t0 + timeout_s - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            t_exit = time.monotonic()
        if result is None or rc != 0:
            tail = err_path.read_text()[-3000:]
            why = "reported no result" if result is None else f"exited with status {rc}"
            raise RestartError(f"restart process {why}; its stderr ends with:\n{tail}")
    return RestartTiming(
        phases={k: float(result["phases"][k]) for k in PHASES if k in result["phases"]},
        total_s=t_result - t0,
        exit_s=t_exit - t0,
        plan=result["plan"],
        devices=tuple(result["devices"]),
        checkpoint_step=int(result["checkpoint_step"]),
        loss=float(result["loss"]),
    )


def _read_result(proc: subprocess.Popen, deadline: float) -> tuple[dict | None, float]:
    """(the child's result, the time its line arrived); kills the child past `deadline`."""
    assert proc.stdout is not None
    while True:
        if time.monotonic() > deadline:
            proc.kill()
            return None, time.monotonic()
        line = proc.stdout.readline()
        if not line:  # end of output: the child exited
            return None, time.monotonic()
        if line.startswith(RESULT_PREFIX):
            t = time.monotonic()
            return json.loads(line[len(RESULT_PREFIX) :]), t


# ---------------------------------------------------------------------------------------------
# The child process. Heavy imports happen inside `restart_child`, so that they are timed.


def restart_child(
    config_path: str,
    failed: Sequence[int],
    *,
    step: int | None = None,
    spawn_time: float | None = None,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the restart in this process and return its result (phase times in seconds).

    Args:
        config_path: YAML config of the run (with `checkpoint.dir`).
        failed: failed device ids; the plan uses the job's other devices.
        step: checkpoint step to restore; None = the newest.
        spawn_time: `time.monotonic()` of the parent at spawn, for the `python_start` phase.
        overrides: dotted `a.b=v` config overrides.

    Returns:
        `{"phases": {...}, "plan", "devices", "checkpoint_step", "loss"}`.
    """
    phases: dict[str, float] = {}
    t = time.monotonic()
    if spawn_time is not None:
        phases["python_start"] = t - spawn_time

    import jax
    import numpy as np

    from ..compilation.executables import compile_plan
    from ..config import ConfigError, load
    from ..core.mesh import make_mesh
    from ..core.rng import check_backend_config
    from ..layout.state import StateFactory, make_optimizer
    from ..loop.data import DataPipeline
    from ..plan.planner import Topology, initial_plan, replan
    from ..transfer import checksum
    from ..transfer.checkpoint import Checkpointer, restore_onto

    t = _lap(phases, "imports", t)
    devices = jax.devices()
    t = _lap(phases, "jax_init", t)

    check_backend_config()
    cfg = load(config_path, overrides)
    if cfg.checkpoint.dir is None:
        raise ConfigError("config 'checkpoint.dir' must name the checkpoint to restore")
    held = cfg.parallel.spares * cfg.parallel.devices_per_host  # hot spares come on top
    n = len(devices) if cfg.parallel.devices == -1 else cfg.parallel.devices + held
    if n > len(devices):
        raise ConfigError(
            f"config 'parallel.devices' = {n} but only {len(devices)} devices are visible"
        )
    cache_dir = getattr(cfg.standby, "cache_dir", None)
    if cache_dir:  # the job's persistent compilation cache: a restart may load, not compile
        from ..loop.trainer import enable_compilation_cache

        enable_compilation_cache(cache_dir)
    job = {d.id: d for d in devices[:n]}
    bad = sorted(set(failed) - set(job))
    if bad:
        raise ValueError(f"failed devices {bad} are not in the job; allowed: {sorted(job)}")
    topo = Topology(tuple(job), cfg.parallel.devices_per_host)
    factory = StateFactory(cfg, make_optimizer(cfg))
    initial = initial_plan(topo, cfg)
    survivors = [d for d in topo.device_ids if d not in set(failed)]
    plan = replan(survivors, topo, cfg, initial, initial)
    make_mesh(plan.mesh_shape, [job[i] for i in plan.device_ids])
    t = _lap(phases, "plan_mesh", t)

    exe = compile_plan(cfg, factory, plan, job)
    t = _lap(phases, "compile", t)

    ckpt = Checkpointer(cfg.checkpoint)
    try:
        # a step that is not there is a CheckpointFormatError saying what the directory holds
        ck_step = ckpt.resolve(-1 if step is None else step)
        state, meta, _ = restore_onto(ckpt, ck_step, factory, exe, devices=job)
        jax.block_until_ready(state)
        t = _lap(phases, "restore", t)
        bad_leaves = checksum.diff(
            meta["checksums"], checksum.rows_to_host(exe.layout.checksum_keys, exe.checksum(state))
        )
        if bad_leaves:
            raise RuntimeError(f"checkpoint {ck_step} fails its checksums: {bad_leaves[:3]}")
        t = _lap(phases, "verify", t)
    finally:
        ckpt.close()
    t = time.monotonic()  # closing the manager is not on the recovery path

    data = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
    host_batch = data.batch(ck_step, plan).arrays()
    t = _lap(phases, "data", t)
    batch = exe.put_batch(host_batch)
    state, met = exe.train(state, batch)
    loss = float(jax.device_get(met["loss"]))
    _lap(phases, "first_step", t)
    if not np.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} after restoring checkpoint {ck_step}")
    return {
        "phases": phases,
        "plan": plan.name,
        "devices": list(plan.device_ids),
        "checkpoint_step": int(ck_step),
        "loss": loss,
    }


def _lap(phases: dict[str, float], name: str, t0: float) -> float:
    t = time.monotonic()
    phases[name] = t - t0
    return t


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m elasjax.bench.restart --config C --failed 3[,4] [--step N] [--devices 8]
    [--set a.b=v]`."""
    ap = argparse.ArgumentParser(
        prog="python -m elasjax.bench.restart",
        description="Restart on the survivors from the newest checkpoint, timing each phase.",
    )
    ap.add_argument("--config", required=True, help="YAML config with checkpoint.dir")
    ap.add_argument("--failed", default="", help="comma-separated failed device ids")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    ap.add_argument("--devices", type=int, default=8,
                    help="fake CPU devices to start unless XLA_FLAGS already sets a count")
    ap.add_argument("--spawn-time", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    try:
        failed = [int(x) for x in args.failed.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--failed must be comma-separated device ids, got {args.failed!r}")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # before JAX starts
        os.environ["XLA_FLAGS"] = (
            flags + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
    from ..config import ConfigError

    try:
        result = restart_child(
            args.config, failed, step=args.step, spawn_time=args.spawn_time, overrides=args.set
        )
    except ConfigError as e:  # a wrong config or checkpoint: its one line, for the parent
        print(f"restart: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    if args.spawn_time is None:  # run by hand: also print a readable table
        for k, v in result["phases"].items():
            print(f"{k:<13}{v:9.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
