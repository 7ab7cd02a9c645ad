"""Real process kills under `elasjax launch`: detection time, MTTR, false positives, full restart.

    PYTHONPATH=. python experiments/bench_detection.py [--runs 4 --kills-per-run 3]
        [--collective-timeout 1] [--skew-factor 3 --skew-steps 50] [--out runs/bench_detection]

Four processes x two CPU devices train `configs/multiprocess.yaml` (gloo collectives, loopback).

1. Kill runs (`--runs`, standby on: `standby.enabled` + `standby.wait_at_start`): each run
   SIGKILLs `--kills-per-run` processes, one at a time, right after each dispatched a step (its
   peers are inside the step's collectives). Per kill, from the recovery events:
   - kill -> silent: a survivor's heartbeat watcher first saw the dead process silent for the
     liveness timeout (what the fast detector knows);
   - kill -> error: the survivor's in-flight step failed (gloo surfaces the death only at the
     collective timeout);
   - kill -> detected: the arbiter's verdict reached the survivor (the `DeviceFailure`; this is
     the recovery's `detect_s`, the figure the acceptance asks for);
   - the MTTR (death to the first good step) and its phases; standby hit or not.
   With `--no-watch-exits` the kernel's exit watch is off (kill and skew runs), so every death
   is seen as a death on another host would be: by the death notice the dead process's host
   sends (`runtime.deathnote`), and with `--no-death-notices` too by the heartbeat alone (as
   for a whole host lost).
   The first kill of a run recovers with the standby compiled before step 0; later kills of the
   same run find standby executables only if the background compile after the first recovery
   finished, so the table splits the MTTRs by hit.
2. Skew run (no kill): process 1 is made `--skew-factor` times slower (stopped and resumed by
   SIGSTOP/SIGCONT) for `--skew-steps` steps. A false positive is any process declared dead
   (a recovery or failure event) or a run that does not finish with all processes.
3. Full restart: a fresh `elasjax launch` of the survivors (3 processes x 2 devices), timed from
   the launch call to its first logged step (process start, jax.distributed start, compile, state
   init, one step; no checkpoint read, so a real restart would take longer: the ratio is a lower
   bound).

Every figure is wall-clock on this machine (real SIGKILL, shared 2-core machine: see the printed
load average), one launch per line of `runs.jsonl`. Benchmarks, not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elasjax.launch.process import KillSpec  # noqa: E402
from elasjax.launch.local import launch_local  # noqa: E402
from elasjax.observe.metrics import read_jsonl  # noqa: E402

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "multiprocess.yaml")
STANDBY = ["standby.enabled=true", "standby.wait_at_start=true"]


def _events(out: Path) -> list[dict]:
    p = out / "events.jsonl"
    return read_jsonl(p) if p.exists() else []


def _launch(out: Path, overrides, **kw) -> tuple[int, float]:
    t0 = time.time()
    rc = launch_local(CONFIG, overrides, processes=kw.pop("processes", 4), devices_per_process=2,
                      out=out, quiet=True, **kw)
    return rc, time.time() - t0


def kill_run(args, i: int, out: Path) -> list[dict]:
    victims = [(1 + (i + j) % 3) for j in range(args.kills_per_run)]  # never process 0
    victims = list(dict.fromkeys(victims))
    step0, gap = 3, 3
    kills = [KillSpec(step0 + gap * j, v) for j, v in enumerate(victims)]
    steps = step0 + gap * len(kills) + 1
    standby = [*STANDBY, "standby.wait_after_recovery=true"] if args.wait_after_recovery else STANDBY
    rc, wall = _launch(out, [*standby, f"train.steps={steps}"], kills=kills,
                       collective_timeout_s=args.collective_timeout,
                       liveness_timeout_s=args.liveness_timeout,
                       watch_exits=not args.no_watch_exits,
                       death_notices=not args.no_death_notices)
    rows = []
    for e in _events(out):
        if e.get("type") != "recovery":
            continue
        rows.append({
            "run": i, "step": e["step"], "failed_processes": e.get("failed_processes"),
            "kill_to_silent_s": e.get("kill_to_silent_s"),
            "kill_to_error_s": e.get("kill_to_error_s"),
            "kill_to_detect_s": e.get("kill_to_detect_s"),
            "detect_per_process_s": e.get("detect_per_process_s"),
            "detected_by": e.get("detected_by"), "detector": e.get("detector"),
            "collectives_renewed": e.get("collectives_renewed", False),
            "renew_s": e.get("renew_s", 0.0),
            "drain_s": e.get("drain_s"),
            "mttr_s": e["mttr_s"], "standby_hit": e["standby_hit"], "compiles": e.get("compiles"),
            **{k: e[k] for k in ("detect_s", "retry_s", "plan_s", "compile_s", "transfer_s",
                                 "verify_s", "snapshot_s", "first_step_s", "standby_wait_s")},
        })
    print(f"  kill run {i}: exit {rc}, {wall:.0f}s, kills {[str(k) for k in kills]}, "
          f"{len(rows)} recoveries", flush=True)
    return rows


def skew_run(args, out: Path, collective_timeout: int) -> dict:
    start = 2
    steps = start + args.skew_steps + 3
    rc, wall = _launch(out, [f"train.steps={steps}"], collective_timeout_s=collective_timeout,
                       liveness_timeout_s=args.liveness_timeout,
                       slow=f"1:{args.skew_factor:g}:{start}:{args.skew_steps}",
                       watch_exits=not args.no_watch_exits,
                       death_notices=not args.no_death_notices)
    ev = _events(out)
    # a process declared dead; a retry (collectives failed, nobody died) is counted apart
    declared = [e for e in ev if e.get("type") == "failure_before_start"
                or (e.get("type") == "recovery" and e.get("failed_processes"))]
    retries = [e for e in ev if e.get("type") == "recovery" and not e.get("failed_processes")]
    end = [e for e in ev if e.get("type") == "end"]
    m = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    st = {r["step"]: r["step_time_s"] for r in m if "step_time_s" in r}
    slow = [st[s] for s in range(start + 1, start + args.skew_steps) if s in st]
    fast = [st[s] for s in st if s < start or s >= start + args.skew_steps + 1]
    gaps = []
    for w in sorted(out.glob("worker*.log")):
        for line in w.read_text(errors="replace").splitlines():
            if "longest heartbeat silence seen" in line or "heartbeat silences over" in line:
                gaps.append(w.stem + ": " + line.split("] ", 1)[-1][:400])
    launch = json.loads((out / "launch.json").read_text()) if (out / "launch.json").exists() else {}
    errors = [e for e in ev if e.get("type") == "error"]
    return {
        "collective_timeout_s": collective_timeout,
        "error": (errors[0]["error"] + ": " + errors[0]["message"][:300]) if errors else None,
        "exit": rc, "wall_s": wall, "false_positives": len(declared), "retries": len(retries),
        "finished_all": rc == 0 and bool(end) and end[0].get("processes") == [0, 1, 2, 3],
        "outcome": launch.get("outcome"), "steps_logged": len(st),
        "median_step_s_slowed": statistics.median(slow) if slow else None,
        "median_step_s_normal": statistics.median(fast) if fast else None,
        "heartbeat_gaps": gaps,
    }


def full_restart(args, out: Path) -> dict:
    """A fresh launch of the survivors, timed to its first logged step."""
    t0 = time.time()
    first: list[float] = []

    def watch():
        p = out / "metrics.jsonl"
        while not first:
            if p.exists() and p.stat().st_size > 0:
                first.append(time.time())
            time.sleep(0.02)

    out.mkdir(parents=True, exist_ok=True)
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    rc, wall = _launch(out, ["train.steps=2", "parallel.devices=6", "parallel.data=6",
                                  "parallel.tensor=1"],
                       processes=3, collective_timeout_s=args.collective_timeout)
    first.append(float("nan"))
    return {"exit": rc, "to_first_step_s": first[0] - t0, "wall_s": wall}


def _slowest(per_process: dict | None) -> float | None:
    """The slowest survivor's detection, of those that reported one (a survivor whose
    collectives were released before the kill's time was posted reports None)."""
    got = [v for v in (per_process or {}).values() if v is not None]
    return max(got) if got else None


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _stats(xs) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"median {statistics.median(xs):.2f}  min {min(xs):.2f}  max {max(xs):.2f}  (n={len(xs)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--kills-per-run", type=int, default=3, choices=(1, 2, 3))
    ap.add_argument("--collective-timeout", type=int, default=1)
    ap.add_argument("--liveness-timeout", type=float, default=1.0)
    ap.add_argument("--no-watch-exits", action="store_true",
                    help="turn the kernel's exit watch off: every death is seen as one on another "
                         "host would be (its host's death notice, else the heartbeat)")
    ap.add_argument("--no-death-notices", action="store_true",
                    help="no death notices from the dead process's host (`runtime.deathnote`): "
                         "with --no-watch-exits the heartbeat alone decides (a whole host lost)")
    ap.add_argument("--skew-factor", type=float, default=3.0)
    ap.add_argument("--skew-steps", type=int, default=50)
    ap.add_argument("--skew-collective-timeouts", type=int, nargs="*", default=None,
                    metavar="S", help="collective timeouts of the skew runs (default: the kill runs')")
    ap.add_argument("--wait-after-recovery", action="store_true",
                    help="the kill runs also set standby.wait_after_recovery (`train --standby`): "
                         "after each recovery training pauses until the new plan's standby is built")
    ap.add_argument("--skip", action="append", default=[], choices=("kills", "skew", "restart"))
    ap.add_argument("--optimized-xla", action="store_true",
                    help="compile with XLA's optimisations (default: JAX_DISABLE_MOST_OPTIMIZATIONS=1)")
    ap.add_argument("--out", default="runs/bench_detection")
    args = ap.parse_args(argv)
    if not args.optimized_xla:
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cond = (f"real SIGKILL; 4 processes x 2 CPU devices, gloo; collective timeout "
            f"{args.collective_timeout}s; liveness timeout {args.liveness_timeout:g}s (heartbeat "
            f"every 0.1s); {'optimised' if args.optimized_xla else 'JAX_DISABLE_MOST_OPTIMIZATIONS=1'}; "
            f"{os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.1f}; standby "
            f"waits at start{' and after each recovery' if args.wait_after_recovery else ''}; "
            + ("exit watch off (every death seen as on another host)"
               if args.no_watch_exits else "exit watch on (same-host deaths read from the kernel)")
            + ("; death notices off" if args.no_death_notices
               else "; death notices on (the dead process's host announces it)"))
    print(cond, flush=True)
    rows: list[dict] = []
    res: dict = {"conditions": cond}
    if "kills" not in args.skip:
        for i in range(args.runs):
            rows += kill_run(args, i, out / f"kill{i}")
        res["kills"] = rows
    if "skew" not in args.skip:
        res["skew"] = []
        for ct in args.skew_collective_timeouts or [args.collective_timeout]:
            res["skew"].append(skew_run(args, out / f"skew_ct{ct}", ct))
            print(f"  skew run: {res['skew'][-1]}", flush=True)
    if "restart" not in args.skip:
        res["restart"] = full_restart(args, out / "restart")
        print(f"  full restart: {res['restart']}", flush=True)
    res["load_end"] = os.getloadavg()[0]
    (out / "bench_detection.json").write_text(json.dumps(res, indent=2))

    lines = [f"conditions: {cond}; load average at end {res['load_end']:.1f}", ""]
    every = rows
    # recoveries of a kill; a retry (a step whose collectives failed while every process was
    # alive, redone on a new client) has no failed process and is reported apart
    rows = [r for r in every if r["failed_processes"]]
    retries = [r for r in every if not r["failed_processes"]]
    if rows:
        hits = [r for r in rows if r["standby_hit"]]
        miss = [r for r in rows if not r["standby_hit"]]
        lines += [
            f"detection over {len(rows)} kills (seconds; process 0's view, then the slowest survivor's):",
            f"  kill -> silent (heartbeat knows)     {_stats([r['kill_to_silent_s'] for r in rows])}",
            f"  kill -> error (step released)         {_stats([r['kill_to_error_s'] for r in rows])}",
            f"  kill -> detected (verdict, detect_s)  {_stats([r['kill_to_detect_s'] for r in rows])}",
            f"  slowest survivor's detect            "
            f"{_stats([_slowest(r.get('detect_per_process_s')) for r in rows])}",
            "",
            "detector: " + ", ".join(f"{d} {sum(r.get('detector') == d for r in rows)}" for d in
                                     sorted({str(r.get('detector')) for r in rows}))
            + f"; new CPU client after the kill (`collectives`): "
            f"{sum(bool(r.get('collectives_renewed')) for r in rows)} of {len(rows)}, in "
            f"{_stats([r['renew_s'] for r in rows if r.get('collectives_renewed')])}; drain of "
            f"the interrupted block {_stats([r.get('drain_s') for r in rows])}",
            "",
            f"MTTR, death to first good step: standby hit {_stats([r['mttr_s'] for r in hits])}",
            f"                                 standby miss {_stats([r['mttr_s'] for r in miss])}",
            f"retries (collectives failed while every process was alive, step redone): "
            f"{len(retries)}, MTTR {_stats([r['mttr_s'] for r in retries])}",
            "",
            "per kill: run step procs hit renewed | detect plan compile transfer verify snapshot "
            "first_step wait | MTTR",
        ]
        for r in every:
            lines.append(
                f"  {r['run']} {r['step']:>3} {r['failed_processes']} {str(r['standby_hit']):5} "
                f"{str(bool(r.get('collectives_renewed'))):5} | "
                + " ".join(f"{r[k]:.3f}" for k in ("detect_s", "plan_s", "compile_s", "transfer_s",
                                                   "verify_s", "snapshot_s", "first_step_s",
                                                   "standby_wait_s"))
                + f" | {r['mttr_s']:.3f}"
            )
    for s in res.get("skew", []):
        lines += ["", f"skew run (process 1 {args.skew_factor:g}x slower by SIGSTOP/SIGCONT for "
                  f"{args.skew_steps} steps, no kill, collective timeout {s['collective_timeout_s']}s): "
                  f"false positives {s['false_positives']}; retries {s['retries']}; finished with "
                  f"all 4 processes: "
                  f"{s['finished_all']} (outcome {s['outcome']}, {s['steps_logged']} steps logged); "
                  f"median step {_f(s['median_step_s_normal'])} s normal, "
                  f"{_f(s['median_step_s_slowed'])} s slowed"]
        if s["error"]:
            lines.append(f"  stopped: {s['error']}")
        lines += [f"  {g}" for g in s["heartbeat_gaps"]]
    if "restart" in res and rows:
        hit_mttr = [r["mttr_s"] for r in rows if r["standby_hit"]]
        t = res["restart"]["to_first_step_s"]
        lines += ["", f"full restart (fresh 3-process launch to its first step, no checkpoint "
                  f"read): {t:.2f}s"]
        if hit_mttr:
            lines.append(f"ratio full restart / median MTTR (standby hit) = "
                         f"{t / statistics.median(hit_mttr):.1f}x")
    text = "\n".join(lines)
    (out / "bench_detection.md").write_text(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
