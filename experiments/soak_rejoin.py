"""A soak of membership in both directions under `elasjax launch`: random kills, restarts, rejoins.

    PYTHONPATH=. python experiments/soak_rejoin.py [--steps 200 --kills 6 --seed 0]
        [--config configs/multiprocess.yaml] [--deterministic] [--out runs/soak_rejoin]

Four processes x two CPU devices train `--config` (gloo collectives, loopback) for `--steps`
steps. `--kills` processes are SIGKILLed, one at a time, at random steps (at least `--gap` steps
apart, so that the previous one has rejoined) of random processes, the first training process
(process 0) among them. The launcher restarts every dead worker (`--worker-restarts`, backoff
`--backoff` s); each restarted process rejoins the running job, which grows back onto its
devices. Then the same config runs fault-free in one process, and the two are compared.

Printed: the schedule, the table of recoveries, joins and growths (from `events.jsonl`), the
devices per step, and the checks: the job finished on every device it started with, every
recovery and growth verified, every kill met its process (a kill due before its process rejoined
finds nobody), losses within 1e-5 of the fault-free run (bitwise, equal state digests, with
`--deterministic`). Exit code 1 when a check fails. Wall-clock figures are this machine's (real
SIGKILL, 2 shared cores; the load average is printed). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elasjax.observe.compare import compare_runs  # noqa: E402
from elasjax.observe.metrics import read_jsonl  # noqa: E402


def schedule(steps: int, kills: int, processes: int, gap: int, seed: int) -> list[tuple[int, int]]:
    """(step, process) of each kill: steps at least `gap` apart inside [gap, steps - gap),
    processes at random, process 0 among them."""
    rng = random.Random(seed)
    room = steps - 2 * gap - (kills - 1) * gap
    if room < 1:
        raise SystemExit(f"--steps {steps} leaves no room for {kills} kills {gap} steps apart")
    cuts = sorted(rng.randrange(room) for _ in range(kills))
    at = [gap + c + i * gap for i, c in enumerate(cuts)]
    who = [rng.randrange(processes) for _ in range(kills)]
    if 0 not in who:
        who[rng.randrange(kills)] = 0
    return list(zip(at, who))


def run(cmd: list[str], log: Path, timeout: float) -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with log.open("w") as fh:
        return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                              timeout=timeout, check=False).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/multiprocess.yaml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--gap", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--backoff", type=float, default=1.0)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="runs/soak_rejoin")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = schedule(args.steps, args.kills, args.processes, args.gap, args.seed)
    sets = [f"train.steps={args.steps}", "faults=[]",
            f"train.deterministic={'true' if args.deterministic else 'false'}"]
    print(f"kills (step:process): {' '.join(f'{s}:{p}' for s, p in plan)}", flush=True)
    cli = [sys.executable, "-m", "elasjax.cli"]
    launch = [*cli, "launch", args.config, "--processes", str(args.processes),
              "--devices-per-process", "2", "--worker-restarts", str(args.kills),
              "--restart-backoff", str(args.backoff), "--timeout", str(args.timeout - 60),
              "--out", str(out / "launch")]
    for s in sets:
        launch += ["--set", s]
    for s, p in plan:
        launch += ["--kill", f"{s}:{p}"]
    t0 = time.time()
    rc = run(launch, out / "launch.log", args.timeout)
    took = time.time() - t0
    ref = [*cli, "train", args.config, "--quiet", "--out", str(out / "ref")]
    for s in sets:
        ref += ["--set", s]
    rc_ref = run(ref, out / "ref.log", args.timeout)
    load = os.getloadavg()[0]
    print(f"launch: exit {rc} in {took:.0f}s; fault-free reference: exit {rc_ref}; load average "
          f"{load:.1f}")
    if rc != 0 or rc_ref != 0:
        print((out / "launch.log").read_text()[-3000:])
        return 1
    events = read_jsonl(out / "launch" / "events.jsonl")
    metrics = read_jsonl(out / "launch" / "metrics.jsonl")
    print("\n| step | event | processes | plans | detail | verified |\n|---|---|---|---|---|---|")
    for e in events:
        t = e["type"]
        if t == "recovery":
            print(f"| {e['step']} | recovery | killed {e['failed_processes']} | {e['from_plan']} "
                  f"-> {e['to_plan']} | detect {e['detect_s']:.2f}s ({e['detector']}), MTTR "
                  f"{e['mttr_s']:.2f}s, rung {e['rung']} | {e['verified']} |")
        elif t == "join":
            r = e.get("rejoined") or {}
            print(f"| {e['step']} | join | rejoined {r.get('processes')} | {e['plan']} -> "
                  f"{e.get('interim_plan') or e['best_plan']} | admitted in "
                  f"{(r.get('admit_s') or 0) + r.get('ship_s', 0) + r.get('settle_s', 0):.2f}s "
                  f"(client generation {r.get('generation')}) | - |")
        elif t == "growth":
            print(f"| {e['step']} | growth | - | {e['from_plan']} -> {e['to_plan']} | "
                  f"{e['from_n_devices']} -> {e['n_devices']} devices, stall {e['stall_s']:.3f}s "
                  f"(compile wait {e['compile_wait_s']:.2f}s) | {e['verified']} |")
        elif t == "migration":
            print(f"| {e['step']} | migration | - | {e['from_plan']} -> {e['to_plan']} | stall "
                  f"{e['stall_s']:.3f}s | {e['verified']} |")
    n = [r["n_devices"] for r in metrics]
    runs, last = [], None
    for x in n:
        if x != last:
            runs.append([x, 0])
            last = x
        runs[-1][1] += 1
    print("\ndevices per step: " + " + ".join(f"[{x}]*{k}" for x, k in runs))
    summary = json.loads((out / "launch" / "launch.json").read_text())
    killed = sum(1 for s in summary["processes"] if s["signal"] == "SIGKILL")
    cmp = compare_runs(out / "launch", out / "ref")
    checks = {
        f"every step logged once ({args.steps})": [r["step"] for r in metrics] == list(range(args.steps)),
        f"ends on all {n[0]} devices": n[-1] == n[0],
        f"every kill met its process ({killed} of {len(plan)})": killed == len(plan),
        "every recovery and growth verified": all(
            e["verified"] for e in events if e["type"] in ("recovery", "growth", "migration")),
        f"losses within 1e-5 (max rel dev {cmp['all']['max_rel']:.2e} over "
        f"{cmp['all']['steps']} steps)": cmp["all"]["max_rel"] <= 1e-5,
        "the same samples at every step": cmp["batches_identical"],
    }
    recs = [e for e in events if e["type"] == "recovery"]
    checks[f"one recovery per kill ({len(recs)})"] = len(recs) == len(plan)
    if args.deterministic:
        checks["bitwise: equal state digests"] = cmp.get("final_state_identical") is True
    print()
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
