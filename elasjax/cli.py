"""`elasjax train | plan | compare | sim | launch`: parsing and wiring only; the work is in the
library."""

from __future__ import annotations

import argparse
import json
import os
import sys

# `train --standby` and `launch --standby`: every likely failure's plan built before step 0,
# and again after each recovery (`config.StandbyConfig`)
STANDBY = ["standby.enabled=true", "standby.wait_at_start=true", "standby.wait_after_recovery=true"]

OPTIMIZER_HELP = (
    "train with this optax optimizer instead of the built-in AdamW (= --set "
    "train.optimizer=MODULE:ATTR): ATTR is a GradientTransformation or a zero-argument callable "
    "returning one; MODULE is imported as with --import. train.lr, warmup_steps, weight_decay "
    "and (outside deterministic mode) grad_clip must then keep their defaults"
)

TENSORBOARD_HELP = (
    "also write TensorBoard scalars (loss, step time, devices, MTTR and its phases, time lost "
    "per failure, goodput) to DIR (= --set metrics.tensorboard_dir=DIR); needs "
    "pip install 'elasjax[tensorboard]'"
)


def _ensure_devices(n: int = 8) -> None:
    """Fake CPU devices must be requested before JAX starts; keep a user's own setting."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={n}").strip()


def _optimizer_override(args) -> list[str]:
    """`--optimizer MODULE:ATTR` is `--set train.optimizer=MODULE:ATTR` (after the other
    overrides, so it wins): the config then names the optimizer, and under `launch` every
    worker builds it from the config it is given."""
    if args.optimizer is None:
        return []
    return [f"train.optimizer={json.dumps(args.optimizer)}"]


def _tensorboard_override(args) -> list[str]:
    """`--tensorboard DIR` is `--set metrics.tensorboard_dir=DIR` (after the other overrides):
    under `launch` the workers get it with the config."""
    if args.tensorboard is None:
        return []
    return [f"metrics.tensorboard_dir={json.dumps(args.tensorboard)}"]


def _train(args) -> int:
    from . import config
    from .launch.process import import_modules
    from .loop import trainer
    from .observe.events import load_hooks
    from .observe.tensorboard import check_available

    import_modules(args.imports)
    standby = STANDBY if args.standby else []
    cfg = config.load(args.config, [*standby, *args.set, *_optimizer_override(args),
                                    *_tensorboard_override(args)])
    check_available(cfg)
    trainer.run(cfg, args.out, progress=not args.quiet, hooks=load_hooks(args.hooks))
    return 0


def _plan(args) -> int:
    from . import config
    from .plan.planner import Topology, initial_plan, rank_candidates, stage_options

    cfg = config.load(args.config, args.set)
    n = args.devices
    if n is None:  # the config's own device count, as the loop takes it (hot spares on top)
        if cfg.parallel.devices == -1:
            raise config.ConfigError("plan: the config has parallel.devices = -1 (all visible "
                                     "devices); give --devices N")
        n = cfg.parallel.devices + cfg.parallel.spares * cfg.parallel.devices_per_host
    topo = Topology(tuple(range(n)), cfg.parallel.devices_per_host)
    if args.coverage:  # the layout needs a device per id: fake CPU ones, before JAX starts
        _ensure_devices(n)
    try:
        fail = {int(x) for x in args.fail.split(",")} if args.fail else set()
    except ValueError:
        raise config.ConfigError(f"--fail {args.fail}: allowed values: comma-separated device "
                                 f"ids from 0 to {n - 1}, e.g. --fail 3,5") from None
    bad = sorted(fail - set(topo.device_ids))
    if bad:
        raise config.ConfigError(f"--fail names devices {bad}; allowed values: 0 .. {n - 1}")
    init = initial_plan(topo, cfg)
    print(f"initial plan on {n} devices: {init.describe()}")
    print(f"  predicted step {init.predicted_step_s * 1e3:.3f} ms ({cfg.hardware.name} cost model)")
    if args.coverage:
        _print_coverage(cfg, init, topo, set(topo.device_ids))
        if not fail:
            _schedule_coverage(cfg, init, topo)
    if fail:
        live = [d for d in topo.device_ids if d not in fail]
        from . import config as c

        tensors = c.allowed_tensor_degrees(cfg.model)
        if cfg.parallel.replan == "keep_tensor":
            tensors = [init.tensor]
        mmb = cfg.train.max_micro_batch or init.micro_batch
        ranked = rank_candidates(
            live, topo, cfg, tensors=tensors, max_micro_batch=mmb,
            stages=stage_options(cfg), previous_partition=init.partition or None,
        )
        if not ranked:
            print(f"no plan fits the {len(live)} survivors")
            return 1
        print(f"after failing {sorted(fail)} ({len(live)} live): {ranked[0][0].describe()}")
        if args.coverage:  # the plan the loop moves to (`replan`), with its snapshots
            from .plan.planner import replan

            _print_coverage(cfg, replan(live, topo, cfg, init, init), topo, set(live))
        if cfg.parallel.spares:
            from .plan.planner import substitute_spares

            kept = substitute_spares(init, live, topo)
            if kept is not None:
                print(f"  hot spares (parallel.spares = {cfg.parallel.spares}) keep the shape "
                      f"instead, and recovery uses: {kept.describe()}")
        print(f"  {'plan':<30}{'devices':>8}{'step ms':>10}{'compute':>10}{'tp comm':>10}{'dp comm':>10}{'overhead':>10}")
        for p, c_ in ranked[: args.top]:
            print(
                f"  {p.name:<30}{p.n_devices:>8}{c_.total_s * 1e3:>10.3f}{c_.compute_s * 1e3:>10.3f}"
                f"{c_.tensor_comm_s * 1e3:>10.3f}{c_.data_comm_s * 1e3:>10.3f}{c_.overhead_s * 1e3:>10.3f}"
            )
    return 0


def _schedule_coverage(cfg, init, topo) -> None:
    """The coverage of the plan the loop moves to after each failure of the config's fault
    schedule (in-process runtime), up to the first event whose outcome is decided at run time
    (devices returning: the loop grows only if it pays, `recovery.grow_min_gain`)."""
    from .plan.planner import NoPlanError, replan
    from .runtime.faults import resolve_schedule

    live, plan = list(topo.device_ids), init
    for ev in resolve_schedule(cfg.faults, topo, cfg.train.steps):
        if ev.kind == "stall":
            continue
        if ev.is_join:
            print(f"step {ev.at_step}: {ev.spec} return; the loop decides at run time whether "
                  "to grow, so the coverage of later plans is not predicted here")
            return
        live = [d for d in live if d not in ev.device_ids]
        try:
            plan = replan(live, topo, cfg, plan, init)
        except NoPlanError as e:
            print(f"step {ev.at_step}: {ev.spec} fail: {e}")
            return
        print(f"step {ev.at_step}: {ev.spec} fail ({len(live)} live): {plan.describe()}")
        _print_coverage(cfg, plan, topo, set(live))


def _print_coverage(cfg, plan, topo, live: set[int]) -> None:
    """Which single and double failures the loop's committed state survives on `plan`, with the
    config's snapshot settings (`recovery.plan_coverage`; shapes and shardings only)."""
    import jax

    from .loop.recovery import plan_coverage

    cpus = jax.devices("cpu")
    if len(cpus) < len(topo.device_ids):
        from .config import ConfigError

        raise ConfigError(
            f"--coverage lays the state out on {len(topo.device_ids)} CPU devices and JAX has "
            f"{len(cpus)}; set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{len(topo.device_ids)} before JAX starts"
        )
    cov, pool = plan_coverage(cfg, plan, topo, live, {d.id: d for d in cpus})
    snap = pool.cfg
    auto = ", automatic" if pool.given.auto else ""
    print(f"  coverage of {plan.name} (snapshot: buddy {str(snap.buddy).lower()}, host "
          f"{str(snap.host).lower()}, copies {snap.copies}{auto}; {topo.devices_per_host} "
          "devices per host):")
    print("    " + str(cov).replace("\n", "\n    "))
    print("    " + pool.cost_line(cfg.hardware))
    if snap.host:  # the rule above is the in-process runtime's (`transfer.coverage`)
        print("    (under `elasjax launch` a host copy lives in its buddy's process: there it "
              "survives only what that buddy survives)")


def _compare(args) -> int:
    from .observe.compare import compare_runs, format_report

    print(format_report(compare_runs(args.run, args.reference, args.common_steps)))
    return 0


def _sim(args) -> int:
    from .sim.run import main as sim_main

    return sim_main(args.config, args.set, args.out)


def _launch(args) -> int:
    from .launch import local, process

    if args.config.endswith(".py"):  # a user's script
        from .launch import script

        script.check_flags(args.config, {
            "--set": args.set, "--standby": args.standby, "--spares": args.spares,
            "--slow": args.slow, "--import": args.imports, "--hook": args.hooks,
            "--optimizer": args.optimizer, "--tensorboard": args.tensorboard,
            "--max-restarts": args.max_restarts, "--kill-coordinator": args.kill_coordinator})
        if args.cluster or args.coordinator is not None:
            return _launch_script_here(args)
    kills = [process.KillSpec.parse(k) for k in args.kill]
    if args.standby:
        args.set = [*STANDBY, *args.set]
    args.set = [*args.set, *_optimizer_override(args), *_tensorboard_override(args)]
    spares = None if args.spares is None else process.parse_spares(args.spares)
    if args.cluster:
        if args.processes is not None:
            raise process.ConfigError("--cluster joins a cluster's job as one of its processes; "
                                     "allowed with --cluster: --processes not given")
        _cluster_address(args)
    if args.coordinator is None:  # start the processes here, on loopback
        if args.num_processes is not None or args.process_id is not None:
            raise process.ConfigError("--num-processes/--process-id need --coordinator")
        if args.processes is None:
            raise process.ConfigError("give --processes P (local) or --coordinator HOST:PORT")
        return local.launch_local(
            args.config,
            args.set,
            processes=args.processes,
            devices_per_process=args.devices_per_process,
            out=args.out,
            kills=kills,
            slow=args.slow,
            imports=args.imports,
            hooks=args.hooks,
            timeout_s=args.timeout,
            quiet=args.quiet,
            spares=spares,
            max_restarts=args.max_restarts,
            restart_backoff_s=args.restart_backoff,
            kill_coordinator=args.kill_coordinator,
            worker_restarts=args.worker_restarts,
            script_args=args.script_args,
            **process.settings_of(args),
        )
    if args.kill_coordinator is not None:
        raise process.ConfigError(
            "--kill-coordinator is for a local launch (--processes P), whose launcher runs the "
            "coordination process; allowed with --coordinator: not given")
    if args.max_restarts:
        raise process.ConfigError(
            f"--max-restarts {args.max_restarts} supervises a local launch (--processes P), "
            "which starts and reaps every process; a process joining a cluster with "
            "--coordinator is restarted by the cluster's own scheduler; allowed values with "
            "--coordinator: 0"
        )
    if args.worker_restarts:
        raise process.ConfigError(
            f"--worker-restarts {args.worker_restarts} restarts the workers of a local launch "
            "(--processes P); on a cluster the scheduler restarts a worker with its own command, "
            "and the restarted process rejoins the running job by itself; allowed values with "
            "--coordinator: 0"
        )
    if spares is not None:  # a cluster's --num-processes counts the spares too
        args.set = [*args.set, f"parallel.spares={spares}"]
    if args.num_processes is None or args.process_id is None:  # join a cluster as one process
        raise process.ConfigError("--coordinator needs --num-processes and --process-id")
    return process.worker_main(args)  # the one worker entry point


def _cluster_address(args) -> None:
    """`--cluster`: the coordinator, the process count and this process's id taken from the
    cluster's environment where not given; an error naming what none gives."""
    from .config import ConfigError
    from .core import jaxcompat

    args.coordinator, args.num_processes, args.process_id = jaxcompat.cluster_params(
        args.coordinator, args.num_processes, args.process_id)
    missing = [flag for flag, v in (("--coordinator", args.coordinator),
                                    ("--num-processes", args.num_processes),
                                    ("--process-id", args.process_id)) if v is None]
    if missing:
        raise ConfigError(
            f"--cluster found no value for {', '.join(missing)} in the environment (JAX "
            "detects SLURM, Open MPI, Kubernetes and Cloud TPU jobs); pass them by hand")


def _launch_script_here(args) -> int:
    """This process joins a cluster's job running a user's script (`--cluster`, or
    `--coordinator` with `--num-processes` and `--process-id`): `launch.script.worker_main`."""
    from .launch import script

    if args.processes is not None:
        raise script.ConfigError(
            "--cluster/--coordinator joins a cluster's job as one of its processes; --processes "
            "starts a local job; allowed: one of them")
    if args.out is not None:
        raise script.ConfigError(
            "--out names the local launcher's directory (its workers' logs); a script on a "
            "cluster writes its own outputs; allowed there: --out not given")
    if args.cluster:
        _cluster_address(args)
    if args.num_processes is None or args.process_id is None:
        raise script.ConfigError("--coordinator needs --num-processes and --process-id")
    args.script = args.config
    return script.worker_main(args, args.script_args)


def _add_train(sub) -> None:
    """`elasjax train`: one process, failures simulated."""
    t = sub.add_parser("train", help="train with the config's fault schedule")
    t.add_argument("config")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.steps=10")
    t.add_argument("--out", default=None, help="output directory (config.yaml, metrics.jsonl, events.jsonl)")
    t.add_argument("--quiet", action="store_true", help="no progress bar or summary table")
    t.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (one that registers a ModelSpec)")
    t.add_argument("--hook", dest="hooks", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="call FUNCTION with each step's StepInfo and each event "
                        "(elasjax.observe.events)")
    t.add_argument("--optimizer", default=None, metavar="MODULE:ATTR", help=OPTIMIZER_HELP)
    t.add_argument("--tensorboard", default=None, metavar="DIR", help=TENSORBOARD_HELP)
    t.add_argument(
        "--standby", action="store_true",
        help="wait for the standby: build the plan of every likely failure before step 0 and "
        "again after each recovery, training paused meanwhile (the default builds them in the "
        "background without pausing: standby.enabled auto; = --set standby.enabled=true "
        "--set standby.wait_at_start=true --set standby.wait_after_recovery=true); each pause "
        "lasts as long as building those plans (figures for configs/demo.yaml: "
        "experiments/RESULTS.md)",
    )


def _add_plan(sub) -> None:
    """`elasjax plan`: the planner's choice, after failures, and what the state survives."""
    p = sub.add_parser("plan", help="print the plan for N devices and after failures")
    p.add_argument("config")
    p.add_argument("--devices", type=int, default=None,
                   help="devices of the job (default: the config's parallel.devices, spares "
                   "included)")
    p.add_argument("--fail", default="", help="comma-separated device ids")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--top", type=int, default=8, help="candidates to list")
    p.add_argument("--coverage", action="store_true",
                   help="which single and double device and host failures the committed state "
                   "survives on the plan (and on the plan after --fail), with the config's "
                   "snapshot settings; from shapes and shardings, nothing is compiled")


def _add_compare(sub) -> None:
    """`elasjax compare`: a run against a reference run."""
    c = sub.add_parser("compare", help="loss deviation of a run against a reference run")
    c.add_argument("run")
    c.add_argument("reference")
    c.add_argument("--common-steps", action="store_true",
                   help="runs that logged different steps: compare the steps both logged "
                   "(otherwise refused)")


def _add_sim(sub) -> None:
    """`elasjax sim`: the cluster-scale simulator."""
    s = sub.add_parser("sim", help="cluster-scale simulator (pure numpy; results are simulated)")
    s.add_argument("config")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--out", default=None, help="write tables.md, results.json and plots here")


def _add_launch(sub) -> None:
    """`elasjax launch`: one process per host, real deaths."""
    m = sub.add_parser(
        "launch", help="train as P processes on jax.distributed; survive killed processes"
    )
    m.add_argument("config", help="a config (.yaml, elasjax's loop) or your own training script "
                   "(.py, run in every process with the arguments after '--'; its ElasticState "
                   "survives the kills: docs/api.md)")
    m.add_argument("--processes", type=int, default=None, help="local processes to start")
    m.add_argument("--devices-per-process", type=int, default=2, help="CPU devices per process")
    m.add_argument("--spares", default=None, metavar="K",
                   help="hot spares: K more processes outside the mesh; one takes a dead "
                   "process's place, so the mesh keeps its size (= parallel.spares)")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    m.add_argument("--out", default=None, help="metrics.jsonl, events.jsonl, worker logs")
    m.add_argument("--kill", action="append", default=[], metavar="STEP:PROCESS[:PHASE]",
                   help="SIGKILL process PROCESS right after it dispatches step STEP; with "
                   "PHASE (plan, transfer, verify, first_step) as that phase of the recovery "
                   "another kill at step STEP started begins (for a script: the step it "
                   "commits; and PHASE admission: as the first admission of a restarted process "
                   "from step STEP on moves the state)")
    m.add_argument("--kill-coordinator", type=int, default=None, metavar="STEP",
                   help="local launch: SIGKILL the coordination process once step STEP is "
                   "logged (the loss of its node; the job ends, or restarts under "
                   "--max-restarts; not repeated in a restart)")
    m.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="join a cluster as one process (with --num-processes, --process-id), "
                   "through the coordination process at HOST:PORT (python -m "
                   "elasjax.runtime.coordinator)")
    m.add_argument("--cluster", action="store_true",
                   help="join a cluster's job: --coordinator, --num-processes and --process-id "
                   "from the environment where not given (SLURM, Open MPI, Kubernetes, Cloud "
                   "TPU: what jax.distributed.initialize() detects)")
    m.add_argument("--num-processes", type=int, default=None)
    m.add_argument("--process-id", type=int, default=None)
    m.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    m.add_argument("--optimizer", default=None, metavar="MODULE:ATTR",
                   help=OPTIMIZER_HELP + "; every process builds it")
    m.add_argument("--tensorboard", default=None, metavar="DIR",
                   help=TENSORBOARD_HELP + "; the process writing metrics.jsonl writes them")
    from .launch.process import add_process_flags

    add_process_flags(m)
    m.add_argument("--standby", action="store_true",
                   help="build every likely failure's plan before step 0, and again after each "
                   "recovery, training paused meanwhile (standby.enabled, standby.wait_at_start, "
                   "standby.wait_after_recovery; without it the standby builds in the "
                   "background while training goes on, each program compiled by one process)")
    m.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="local launch: when the job cannot continue (the coordination process lost, "
                   "unrecoverable state, an error exit), reap every process and start the job "
                   "again from its newest checkpoint (needs checkpoint.dir), at most N times; "
                   "recorded in supervisor.jsonl (0: never)")
    m.add_argument("--worker-restarts", type=int, default=0, metavar="N",
                   help="local launch: start a worker that died again (the same process id), at "
                   "most N times in all; it rejoins the running job, which grows back onto its "
                   "devices (0: never)")
    m.add_argument("--restart-backoff", type=float, default=2.0, metavar="S",
                   help="seconds before the first restart, doubled before each next one (of the "
                   "job, or of one worker)")
    m.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="local launch: kill every process after this many seconds (restarts "
                   "included)")
    m.add_argument("--quiet", action="store_true")


def parser() -> argparse.ArgumentParser:
    """The `elasjax` command line: one subcommand per `_add_*`."""
    ap = argparse.ArgumentParser(prog="elasjax", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (_add_train, _add_plan, _add_compare, _add_sim, _add_launch):
        add(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:  # a launched script's own arguments
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1:]
    args = parser().parse_args(argv)
    args.script_args = script_args
    if args.cmd == "launch":  # before anything creates a JAX backend in this process
        from .config import ConfigError
        from .runtime.multicontroller import RejoinUnsupportedError
        from .transfer.shards import UnrecoverableStateError

        try:
            return _launch(args)
        except (ConfigError, ValueError, FileNotFoundError, RejoinUnsupportedError) as e:
            print(f"elasjax: error: {e}", file=sys.stderr)
            return 2
        except UnrecoverableStateError as e:
            print(f"elasjax: training stopped: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    if args.cmd == "sim":  # the simulator is pure numpy: dispatch before anything imports JAX
        from .config import ConfigError

        try:
            return _sim(args)
        except (ConfigError, FileNotFoundError) as e:
            print(f"elasjax: error: {e}", file=sys.stderr)
            return 2
    if args.cmd == "train":
        _ensure_devices(8)
    from .config import ConfigError
    from .observe.compare import RunsDifferError
    from .plan.planner import NoPlanError
    from .transfer.shards import UnrecoverableStateError

    try:
        return {"train": _train, "plan": _plan, "compare": _compare}[args.cmd](args)
    except (ConfigError, FileNotFoundError, RunsDifferError) as e:
        print(f"elasjax: error: {e}", file=sys.stderr)
        return 2
    except (UnrecoverableStateError, NoPlanError) as e:
        print(f"elasjax: training stopped: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
