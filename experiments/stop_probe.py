"""A worker stopped, alive, under `elasjax launch`: how soon is it fenced, and how does it end?

    PYTHONPATH=. python experiments/stop_probe.py [--launches 5 --seed 0 --steps 24
        --stop-s 20 --config configs/demo_zero.yaml --out runs/stop_probe]

Each launch runs four processes x two CPU devices with default flags and no scheduled fault;
once the run's metrics reach a step drawn from `--seed` (after the standby is ready where it
can be: steps 10 .. steps - 6), a worker drawn from the seed (any, process 0 included) is
stopped with SIGSTOP for `--stop-s` seconds, then continued (SIGCONT). Printed per launch:
the recovery's detection (stop -> detected, its detector line), MTTR and phases, how the
stopped worker ended (its exit code and the last line it logged), the launch's exit, and the
run against its fault-free run (bitwise in the deterministic mode). A launch passes when the
survivors finish equal to the fault-free run, the events file is whole, and the stopped worker
was fenced (declared dead at one recovery) and exited with a code, not ended by a signal, or
was still stopped when the job finished and the launcher ended it (its launch.json entry says
`stopped_at_end`).
Wall-clock figures are this machine's (2 shared cores). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from soak_kills import PHASES, PROCESSES, reference, run  # noqa: E402

from elasjax.observe.compare import compare_runs  # noqa: E402
from elasjax.observe.metrics import read_jsonl  # noqa: E402


def last_step(run_dir: Path) -> int:
    try:
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return -1
    for line in reversed(rows):
        try:
            return json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError):
            continue
    return -1


def stopper(run_dir: Path, at_step: int, victim: int, stop_s: float, done: threading.Event,
            record: dict) -> None:
    """Wait for step `at_step` in the run's metrics, then SIGSTOP worker `victim` for `stop_s`."""
    while not done.is_set() and last_step(run_dir) < at_step:
        time.sleep(0.05)
    if done.is_set():
        return
    pid = json.loads((run_dir / "pids.json").read_text())["workers"][victim]
    record["stopped_at"] = time.time()
    record["stopped_after_step"] = last_step(run_dir)
    os.kill(pid, signal.SIGSTOP)
    done.wait(stop_s)
    try:
        os.kill(pid, signal.SIGCONT)
        record["continued_at"] = time.time()
    except ProcessLookupError:  # reaped meanwhile
        record["continued_at"] = None


def judge(run_dir: Path, ref: Path, rec: dict, victim: int) -> dict:
    try:
        events = read_jsonl(run_dir / "events.jsonl")
        rec["events_file"] = "whole"
    except (OSError, json.JSONDecodeError) as e:  # a broken file is a finding, not a crash
        events, rec["events_file"] = [], f"unreadable: {e}"
    recs = [e for e in events if e["type"] == "recovery"]
    try:
        procs = json.loads((run_dir / "launch.json").read_text()).get("processes", [])
    except (OSError, json.JSONDecodeError):
        procs = []
    stopped = next((s for s in procs if s["process"] == victim), {})
    log = Path(stopped.get("log", run_dir / f"worker{victim}.log"))
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    rec.update(
        recoveries=len(recs),
        failed=[e.get("failed_processes") for e in recs],
        detect_s=[round(e["detect_s"], 2) for e in recs],
        mttr_s=[round(e["mttr_s"], 2) for e in recs],
        phases=[{k: e.get(k) for k in PHASES} for e in recs],
        detected_by=[e.get("detected_by", "")[:300] for e in recs],
        victim_exit=stopped.get("signal") or stopped.get("returncode"),
        victim_stopped_at_end=bool(stopped.get("stopped_at_end")),
        victim_last_line=lines[-1][:200] if lines else "",
        others=sorted((s["process"], s.get("signal") or s.get("returncode")) for s in procs
                      if s["process"] != victim),
    )
    if rec["exit"] == 0 and (run_dir / "metrics.jsonl").exists():
        cmp = compare_runs(run_dir, ref)
        rec["max_rel_dev"] = cmp["all"]["max_rel"]
        rec["bitwise"] = cmp.get("final_state_identical")
        start = [e for e in events if e["type"] == "start"]
        rec["deterministic"] = bool(start and start[0].get("deterministic"))
    rec["ok"] = bool(
        rec["exit"] == 0 and rec["failed"] == [[victim]] and rec["events_file"] == "whole"
        and all(code == 0 for _, code in rec["others"])
        # it exited (a code), not ended by a signal; or it was still stopped when the job
        # finished, and the launcher ended it (`launch.local._monitor`)
        and (isinstance(rec["victim_exit"], int) or rec["victim_stopped_at_end"])
        and rec.get("max_rel_dev", 1.0) <= 1e-5
        and (not rec.get("deterministic") or rec.get("bitwise") is True))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo_zero.yaml")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--stop-s", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default="runs/stop_probe")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sets = [f"train.steps={args.steps}"]
    ref = reference(args.config, sets, out, args.timeout)
    recs = []
    for i in range(args.launches):
        rng = random.Random(f"{args.seed}/{i}")
        at_step, victim = rng.randrange(10, args.steps - 6), rng.randrange(PROCESSES)
        run_dir = out / f"launch{i:03d}"
        cmd = [sys.executable, "-m", "elasjax.cli", "launch", args.config, "--processes",
               str(PROCESSES), "--devices-per-process", "2", "--quiet", "--out", str(run_dir),
               "--timeout", str(args.timeout - 60), "--set", "faults=[]"]
        for s in sets:
            cmd += ["--set", s]
        rec = {"launch": i, "stop": f"process {victim} after step {at_step} for {args.stop_s:g}s"}
        done = threading.Event()
        t = threading.Thread(target=stopper, args=(run_dir, at_step, victim, args.stop_s, done,
                                                   rec), daemon=True)
        t.start()
        rec["exit"], took = run(cmd, out / f"launch{i:03d}.log", args.timeout)
        done.set()
        t.join()
        rec["wall_s"] = round(took, 1)
        rec = judge(run_dir, ref, rec, victim)
        recs.append(rec)
        with (out / "probe.jsonl").open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        print(f"{i:3d} stop {rec['stop']}: recoveries {rec['recoveries']} failed {rec['failed']} "
              f"detect {rec['detect_s']} MTTR {rec['mttr_s']} stopped worker's exit "
              f"{rec['victim_exit']}"
              f"{' (stopped when the job finished: ended by the launcher)' if rec['victim_stopped_at_end'] else ''}"
              f" ('{rec['victim_last_line'][-90:]}') exit {rec['exit']} dev "
              f"{rec.get('max_rel_dev', '-')}{' bitwise' if rec.get('bitwise') else ''} "
              f"events file {rec['events_file'][:60]} "
              f"{'ok' if rec['ok'] else 'FAIL'}", flush=True)
        for line in rec["detected_by"]:
            print(f"      detected by: {line}", flush=True)
    print(f"{sum(r['ok'] for r in recs)} of {len(recs)} launches ok; detect "
          f"{sorted(d for r in recs for d in r['detect_s'])}", flush=True)
    return 0 if all(r["ok"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
