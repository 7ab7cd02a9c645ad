"""MTTR of one failure on the demo model: elastic recovery vs checkpoint-restart, phase by phase.

    .venv/bin/python experiments/mttr.py [--steps 20 --fail-step 15 --device 3 --ckpt-every 10]

The demo GPT (`configs/demo.yaml`: data 4 x tensor 2 on 8 fake CPU devices) loses one device
(single-process simulated device loss: its buffers are deleted) and recovers four ways:

  1. elastic, standby hit: `standby.enabled` with `standby.wait_at_start`, so the plans for every
     single-device failure were compiled in the background before step 0;
  2. elastic, cold compile: no standby; the survivors' plan is compiled when the failure hits;
  3. in-process checkpoint restore (`recovery.strategy: checkpoint_restart`): Orbax checkpoints
     every `--ckpt-every` steps; the newest is restored onto the new mesh in the same process
     and the lost steps are redone (own executable cache: no standby, compiled cold);
  4. full restart: a new Python process (`elasjax.bench.restart`: imports, JAX start, plan and mesh,
     compile, Orbax restore, first step) restores the checkpoint run 3 restored, plus the other
     steps it must redo, timed at the step times run 3 measured for exactly those steps.

With `--launch`, two rows of real process deaths follow: 5. `elasjax launch` (4 processes x 2
devices, `configs/multiprocess.yaml`, standby with `wait_at_start`), process 2 SIGKILLed after it
dispatched step 3: real detection (heartbeat + `--collective-timeout`, 1 s by default), the same
phases; 6. a fresh launch of the 3 survivors, spawn to its first logged step (the restart
alternative without its own detection, restore or redone steps: a lower bound).

Writes `mttr.md` (the table), `mttr.json` and `mttr_phases.png` (stacked bars) under `--out`.
Every number is measured in this run. Wall-clock on fake devices sharing the machine's cores:
the ratios between the rows are what to read. Targets (issue 5, benchmarks): elastic MTTR with a
standby hit < 1 s; >= 20x faster than a full restart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import typing
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch

from elasjax import config
from elasjax.loop import trainer
from elasjax.bench import restart  # noqa: E402
from elasjax.compilation.executables import ExecutableCache  # noqa: E402
from elasjax.observe.metrics import read_jsonl  # noqa: E402

PHASES = ("process start", "detect", "plan", "compile", "transfer / restore", "verify",
          "first step", "redo steps")
COLORS = ("#8c564b", "#7f7f7f", "#bcbd22", "#d62728", "#1f77b4", "#9467bd", "#2ca02c", "#ff7f0e")
TARGET_STANDBY_S = 1.0
TARGET_RATIO = 20.0


def demo_config(args, *extra: str) -> config.Config:
    return config.load(args.config, [
        f"train.steps={args.steps}", "train.eval_every=0",
        f"faults=[{{at_step: {args.fail_step}, devices: [{args.device}]}}]", *extra,
    ])


def require_strategy(name: str) -> None:
    allowed = typing.get_args(typing.get_type_hints(config.RecoveryConfig)["strategy"])
    if name not in allowed:
        raise SystemExit(f"recovery.strategy={name} is not available in this elasjax version "
                         f"(allowed: {', '.join(allowed)})")


def run_one(label: str, cfg: config.Config, out: Path, cache: ExecutableCache) -> dict:
    """Train `cfg` with its one failure; its recovery event, redone-step times and step time."""
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    s = trainer.run(cfg, out, exe_cache=cache)
    wall = time.perf_counter() - t0
    if len(s.recoveries) != 1:
        raise RuntimeError(f"{label}: expected one recovery, got {len(s.recoveries)}")
    ev = s.recoveries[0]
    rows = read_jsonl(out / "metrics.jsonl")
    redo = [r for r in rows if r.get("redo")]
    # the first redone step is the recovery's `first_step`; the others are the extra redo cost
    redo_extra = [r["step_time_s"] for r in redo if r["step"] != ev.resumed_at_step]
    after = [r["step_time_s"] for r in rows if r["step"] > ev.step and not r.get("redo")]
    phases = {
        "detect": ev.detect_s, "plan": ev.plan_s, "compile": ev.compile_s,
        "transfer / restore": ev.transfer_s, "verify": ev.verify_s,
        "first step": ev.first_step_s, "redo steps": sum(redo_extra),
    }
    print(f"  {label}: {ev.from_plan} -> {ev.to_plan} via {ev.rung}; MTTR {ev.mttr_s:.3f} s "
          f"(compile {ev.compile_s:.3f} s, standby hit {ev.standby_hit}); "
          f"{ev.steps_lost} steps lost; run {wall:.1f} s")
    return {
        "label": label, "event": ev.to_json(), "phases": phases,
        "compiles": getattr(ev, "compiles", None),
        "total_s": sum(phases.values()), "steps_lost": ev.steps_lost,
        "redo_step_times": redo_extra, "step_time_s": statistics.median(after) if after else 0.0,
        "run_wall_s": wall,
    }


def check_rows_match_names(rows: list[dict]) -> None:
    """Fail loudly when a row's own counters contradict its name: the standby row must have
    hit (the executable ready at detection) and compiled nothing; the cold row must have missed
    and compiled."""
    hit, cold = rows[0], rows[1]
    wrong = []
    if not hit["event"]["standby_hit"] or hit["compiles"] != 0:
        wrong.append(f"row 1 is named 'standby hit' but standby_hit={hit['event']['standby_hit']}"
                     f", {hit['compiles']} XLA compiles after detection")
    if cold["event"]["standby_hit"] or not cold["compiles"]:
        wrong.append(f"row 2 is named 'cold compile' but standby_hit="
                     f"{cold['event']['standby_hit']}, {cold['compiles']} XLA compiles after "
                     "detection")
    if wrong:
        raise SystemExit("mttr.py: " + "; ".join(wrong))


def full_restart(cfg: config.Config, ckpt_row: dict, failed: int) -> dict:
    """Time a fresh process restoring the checkpoint the in-process run restored."""
    ev = ckpt_row["event"]
    t = restart.measure_restart(cfg, [failed], step=ev["resumed_at_step"])
    p = t.phases
    phases = {
        "process start": p["python_start"] + p["imports"] + p["jax_init"],
        "plan": p["plan_mesh"], "compile": p["compile"], "transfer / restore": p["restore"],
        "verify": p["verify"],
        # the parent's spawn-to-result time minus the phases above: the data pipeline and the
        # first step (the first redone step), plus the child's small unmeasured gaps
        "first step": t.total_s - sum(p[k] for k in restart.PHASES if k not in ("data",
                                                                              "first_step")),
        "redo steps": sum(ckpt_row["redo_step_times"]),
    }
    print(f"  full restart: process {t.total_s:.2f} s to its first step (plan {t.plan}, "
          f"checkpoint {t.checkpoint_step}); + {len(ckpt_row['redo_step_times'])} redone steps "
          f"{phases['redo steps']:.2f} s")
    return {"label": "4. full restart (new process)", "restart": t.to_json(), "phases": phases,
            "compiles": None,
            "total_s": sum(phases.values()), "steps_lost": ckpt_row["steps_lost"]}


LAUNCH_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "multiprocess.yaml"


def launch_rows(args, out: Path) -> list[dict]:
    """Rows 5-6, real process deaths (`--launch`): `elasjax launch` with 4 processes x 2
    devices (configs/multiprocess.yaml), standby with `wait_at_start`, process 2 SIGKILLed
    right after it dispatched step 3; then a fresh launch of the 3 survivors timed from spawn to
    its first logged step (the restart alternative, without its detection, checkpoint restore
    or redone steps: a lower bound)."""
    from elasjax.launch.process import KillSpec
    from elasjax.launch.local import launch_local

    run = out / "runs/launch_kill"
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    rc = launch_local(
        str(LAUNCH_CONFIG), ["standby.enabled=true", "standby.wait_at_start=true",
                             "train.steps=6"],
        processes=4, devices_per_process=2, out=run, quiet=True, kills=[KillSpec(3, 2)],
        collective_timeout_s=args.collective_timeout, liveness_timeout_s=1.0,
    )
    events = [e for e in read_jsonl(run / "events.jsonl") if e.get("type") == "recovery"]
    if rc != 0 or len(events) != 1:
        raise SystemExit(f"mttr.py: the launch row ended with exit {rc} and {len(events)} "
                         f"recoveries (expected 0 and 1); see {run}/worker*.log")
    e = events[0]
    renewed = bool(e.get("collectives_renewed"))
    # after a new CPU client the standby executables are reloaded (no compile), but JAX's
    # caches start empty: the small helpers of the transition and checksums compile again
    if not e["standby_hit"] or (e.get("compiles") and not renewed):
        raise SystemExit(f"mttr.py: row 5 is named 'standby hit' but standby_hit="
                         f"{e['standby_hit']}, {e.get('compiles')} XLA compiles after detection "
                         f"with the old CPU client kept")
    phases = {
        "detect": e["detect_s"] + e.get("retry_s", 0.0), "plan": e["plan_s"],
        "compile": e["compile_s"], "transfer / restore": e["transfer_s"] + e["snapshot_s"],
        "verify": e["verify_s"], "first step": e["first_step_s"],
    }
    kill = {
        "label": "5. launch: real SIGKILL, standby hit"
                 + (" (new CPU client: executables reloaded)" if renewed else ""),
        "event": e, "phases": phases,
        "compiles": e.get("compiles"), "total_s": sum(phases.values()), "steps_lost": 0,
        "kill_to_detect_s": e.get("kill_to_detect_s"), "run_wall_s": time.perf_counter() - t0,
    }
    print(f"  {kill['label']}: {e['from_plan']} -> {e['to_plan']}; MTTR {e['mttr_s']:.3f} s "
          f"(detect {e['detect_s']:.3f} s, kill -> detected {_s(e.get('kill_to_detect_s'))})")

    from bench_detection import full_restart as fresh_launch  # the same timing as that bench

    shutil.rmtree(out / "runs/launch_restart", ignore_errors=True)  # its watcher reads metrics
    r = fresh_launch(args, out / "runs/launch_restart")
    if r["exit"] != 0 or r["to_first_step_s"] != r["to_first_step_s"]:  # failed, or no step
        raise SystemExit(f"mttr.py: the fresh launch ended with exit {r['exit']}; see "
                         f"{out / 'runs/launch_restart'}")
    restart_s = r["to_first_step_s"]
    print(f"  6. launch: fresh launch of the survivors: {restart_s:.2f} s to its first step")
    return [kill, {
        "label": "6. launch: fresh launch, spawn to 1st step", "phases": {}, "compiles": None,
        "total_s": restart_s, "steps_lost": 0,
    }]


def _s(x) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


def table(rows: list[dict]) -> str:
    head = "| method | " + " | ".join(PHASES) + " | MTTR total | XLA compiles |"
    lines = [head, "|---" * (len(PHASES) + 3) + "|"]
    for r in rows:
        cells = [f"{r['phases'][k]:.3f}" if k in r["phases"] else "-" for k in PHASES]
        n = "-" if r.get("compiles") is None else str(r["compiles"])
        lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | **{r['total_s']:.3f}** | "
                     f"{n} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), gridspec_kw={"height_ratios": [4, 1.3]})
    fast = rows[0]
    zoom = max(1.6 * fast["total_s"], 1.15 * TARGET_STANDBY_S)
    for ax, sub, xmax in ((axes[0], rows, None), (axes[1], [fast], zoom)):
        labels = [r["label"] for r in sub]
        left = [0.0] * len(sub)
        for ph, col in zip(PHASES, COLORS):
            w = [r["phases"].get(ph, 0.0) for r in sub]
            ax.barh(labels, w, left=left, color=col, label=ph, edgecolor="white", linewidth=0.4)
            left = [a + b for a, b in zip(left, w)]
        for i, r in enumerate(sub):
            ratio = "" if r is fast else f"  ({r['total_s'] / fast['total_s']:.0f}x row 1)"
            ax.text(r["total_s"], i, f" {r['total_s']:.2f} s{ratio}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds (wall-clock)")
        ax.set_xlim(0, xmax or 1.3 * max(r["total_s"] for r in rows))
    axes[1].axvline(TARGET_STANDBY_S, color="k", ls="--", lw=0.8)
    axes[1].text(TARGET_STANDBY_S, -0.45, " target < 1 s", fontsize=8)
    axes[1].set_title("zoom on row 1: the elastic fast path", fontsize=9)
    axes[0].legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    axes[0].set_title("MTTR of one device failure, demo GPT on 8 fake CPU devices "
                      "(single-process simulated device loss)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fail-step", type=int, default=15)
    ap.add_argument("--device", type=int, default=3)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--standby-plans", type=int, default=None,
                    help="standby.max_plans (default: unset, every single-device and "
                         "single-host failure's plan)")
    ap.add_argument("--launch", action="store_true",
                    help="add rows 5-6: a real SIGKILL under `elasjax launch` (4 processes x 2 "
                         "devices, standby) and a fresh launch of the survivors")
    ap.add_argument("--collective-timeout", type=int, default=1,
                    help="--collective-timeout of the launch rows (integer seconds)")
    ap.add_argument("--out", default="results/mttr")
    args = ap.parse_args()
    if not 0 < args.fail_step < args.steps:
        ap.error(f"--fail-step must be in 1 .. {args.steps - 1}")
    require_strategy("checkpoint_restart")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    lost = args.fail_step - args.fail_step // args.ckpt_every * args.ckpt_every
    settings = (
        f"{args.config}, {args.steps} steps, device {args.device} fails before step "
        f"{args.fail_step}; checkpoints every {args.ckpt_every} steps ({lost} steps lost); "
        f"standby.max_plans={args.standby_plans or 'unset (all likely failures)'}; jax {jax.__version__}, "
        f"{len(jax.devices())} fake CPU devices on {os.cpu_count()} cores; "
        "single-process simulated device loss"
    )
    print(f"# MTTR: {settings}")
    cap = [] if args.standby_plans is None else [f"standby.max_plans={args.standby_plans}"]
    # every row its own executable cache: a row compiles (or not) what its name says
    rows = [
        run_one("1. elastic, standby hit", demo_config(
            args, "standby.enabled=true", "standby.wait_at_start=true", *cap),
            out / "runs/elastic_standby", ExecutableCache()),
        run_one("2. elastic, cold compile", demo_config(args, "standby.enabled=false"),
                out / "runs/elastic_cold", ExecutableCache()),
    ]
    check_rows_match_names(rows)
    ck_dir = (out / "runs/ckpt_dir").absolute()
    shutil.rmtree(ck_dir, ignore_errors=True)
    ck_cfg = demo_config(
        args, "recovery.strategy=checkpoint_restart", "standby.enabled=false",
        f"checkpoint.dir={ck_dir}",
        f"checkpoint.every={args.ckpt_every}", f"checkpoint.keep={args.steps + 1}")
    rows.append(run_one("3. checkpoint restore, in process", ck_cfg,
                        out / "runs/ckpt_restore", ExecutableCache()))
    rows.append(full_restart(ck_cfg, rows[2], args.device))

    launched = launch_rows(args, out) if args.launch else []
    rows += launched
    fast = rows[0]["total_s"]
    ratio_restart, ratio_cold = rows[3]["total_s"] / fast, rows[1]["total_s"] / fast
    launch_lines = []
    if launched:
        kill, fresh = launched
        launch_lines = [
            f"- launch (real SIGKILL, real detection: {kill['event'].get('detector', 'heartbeat')}"
            f", --collective-timeout {args.collective_timeout} s, standby ready"
            + (", new CPU client" if kill["event"].get("collectives_renewed") else "")
            + f"): MTTR {kill['total_s']:.3f} s "
            f"(detect {kill['phases']['detect']:.3f} s; kill -> detected "
            f"{_s(kill['kill_to_detect_s'])}); fresh launch of the survivors to its first step "
            f"{fresh['total_s']:.2f} s = {fresh['total_s'] / kill['total_s']:.1f}x "
            f"(target >= {TARGET_RATIO:.0f}x: "
            f"{'met' if fresh['total_s'] / kill['total_s'] >= TARGET_RATIO else 'MISSED'}; the "
            "fresh launch leaves out its own detection, checkpoint restore and redone steps)",
        ]
    hit = rows[0]["event"]["standby_hit"]
    ok1, ok2 = hit and fast < TARGET_STANDBY_S, ratio_restart >= TARGET_RATIO
    report = "\n".join([
        "# MTTR of one failure (seconds, wall-clock)", "", settings, "",
        table(rows), "",
        "MTTR = detect + plan + compile + transfer/restore + verify + first step (+ the other "
        "redone steps and, for the full restart, process start = interpreter + imports + JAX "
        "init). Rows 1-4: one process, simulated device loss (its buffers deleted; detection is "
        "the injector's). Rows 5-6 (--launch): real processes, real SIGKILL, real detection. "
        "Full restart: phases measured in the new process; 'first step' = the parent's "
        "spawn-to-result time minus the phases listed (data pipeline + first step). XLA "
        "compiles: backend compilations on the training thread from detection to the first "
        "step (`RecoveryEvent.compiles`; not counted in the restart process).", "",
        f"- full restart / elastic standby = {ratio_restart:.1f}x "
        f"(target >= {TARGET_RATIO:.0f}x: {'met' if ok2 else 'MISSED'})",
        f"- cold recompile / elastic standby = {ratio_cold:.1f}x",
        f"- in-process checkpoint restore / elastic standby = {rows[2]['total_s'] / fast:.1f}x",
        f"- elastic MTTR with a standby hit = {fast:.3f} s, standby hit: {'yes' if hit else 'NO'} "
        f"(target < {TARGET_STANDBY_S:.0f} s: {'met' if ok1 else 'MISSED'})",
        "- median step time after recovery: "
        + ", ".join(f"{r['label'][:2]} {r['step_time_s']:.3f} s" for r in rows[:3]),
        *launch_lines,
        f"- script runtime {time.perf_counter() - t_start:.0f} s",
    ])
    (out / "mttr.md").write_text(report + "\n")
    (out / "mttr.json").write_text(json.dumps(
        {"settings": settings, "rows": rows, "ratio_restart": ratio_restart,
         "ratio_cold": ratio_cold}, indent=1, default=str))
    try:
        plot(rows, out / "mttr_phases.png")
        wrote = "mttr.md, mttr.json, mttr_phases.png"
    except ModuleNotFoundError as e:  # the plot needs the `experiments` extra
        wrote = (f"mttr.md, mttr.json (no plot: {e}; pip install -e '.[experiments]')")
    print("\n" + report)
    print(f"\nwrote {out}/{wrote}")


if __name__ == "__main__":
    main()
