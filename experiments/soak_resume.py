"""A soak of supervised resumes under `elasjax launch`: does a restarted job start at once?

    PYTHONPATH=. python experiments/soak_resume.py [--launches 20 --seed 0]
        [--config configs/multiprocess.yaml] [--out runs/soak_resume]

Each launch runs `--processes` x 2 CPU devices with checkpoints every 2 steps under
`--max-restarts 1` (one restart: the resumed job must start at its first attempt) and default
detector flags. The coordination process is SIGKILLed once a random step is logged
(`--kill-coordinator`); in every other launch process 0 is SIGKILLed first, at an earlier step,
so that the job had shrunk before it lost its service. The launcher starts a new job on a fresh
coordinator, every process resuming from the newest committed checkpoint.

Printed per launch: the kills, the restarts (1 expected), the outcome, the checkpoint resumed
from, the resumed job's start skew (the latest arrival after the first at its `start/state` and
`start/verify` entry barriers: the project's own rendezvous before the first collective), and
the losses of the resumed steps against the fault-free run (within 1e-5). Exit code 1 when a
launch does not resume at its first attempt or its losses differ. Wall-clock figures are this
machine's (2 shared cores). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elasjax.observe.metrics import read_jsonl  # noqa: E402

SKEW = re.compile(r"(start/\w+) entry barrier: arrivals at the entry barrier: .*?; process (\d+) "
                  r"last, ([0-9.]+)s after the first")


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.time()
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.time() - t0


def skews(log: Path) -> dict[str, tuple[int, float]]:
    """{phase: (the last process, seconds after the first)} of a worker log's start barriers."""
    out: dict[str, tuple[int, float]] = {}
    if log.exists():
        for m in SKEW.finditer(log.read_text(errors="replace")):
            out[m.group(1)] = (int(m.group(2)), float(m.group(3)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/multiprocess.yaml")
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default="runs/soak_resume")
    ap.add_argument("--judge-only", action="store_true",
                    help="judge the launches already in --out again; run nothing")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # the config's device count follows the processes (configs/multiprocess.yaml says 8, data 4)
    sets = [f"train.steps={args.steps}", "faults=[]",
            f"parallel.devices={2 * args.processes}", "parallel.data=-1", "checkpoint.every=2"]
    ref = out / "ref"
    if not (ref / "metrics.jsonl").exists():
        cmd = [sys.executable, "-m", "elasjax.cli", "train", args.config, "--quiet", "--out",
               str(ref)]
        for s in sets[:4]:
            cmd += ["--set", s]
        rc, took = run(cmd, out / "ref.log", args.timeout)
        print(f"reference: exit {rc} in {took:.0f}s", flush=True)
        if rc != 0:
            return 1
    losses = {r["step"]: r["loss"] for r in read_jsonl(ref / "metrics.jsonl")}
    bad, worst = 0, 0.0
    with (out / ("judged.jsonl" if args.judge_only else "soak.jsonl")).open("a") as fh:
        for i in range(args.launches):
            rng = random.Random(f"{args.seed}/{i}")
            at = rng.randrange(3, args.steps - 2)
            kill0 = rng.randrange(1, at) if i % 2 else None
            run_dir, ck = out / f"launch{i:03d}", out / f"ck{i:03d}"
            cmd = [sys.executable, "-m", "elasjax.cli", "launch", args.config, "--processes",
                   str(args.processes), "--devices-per-process", "2", "--quiet",
                   "--max-restarts", "1", "--restart-backoff", "0.5", "--kill-coordinator",
                   str(at), "--out", str(run_dir), "--timeout", str(args.timeout - 60)]
            if kill0 is not None:
                cmd += ["--kill", f"{kill0}:0"]
            for s in [*sets, f"checkpoint.dir={ck}"]:
                cmd += ["--set", s]
            if args.judge_only:  # the launch as it ran: its exit code from its summary
                summary = json.loads((run_dir / "launch.json").read_text())
                rc, took = (0 if summary.get("outcome") == "finished" else 1), 0.0
            else:
                rc, took = run(cmd, out / f"launch{i:03d}.log", args.timeout)
            records = (read_jsonl(run_dir / "supervisor.jsonl")
                       if (run_dir / "supervisor.jsonl").exists() else [])
            restarts = [r for r in records if r["type"] == "restart"]
            end = next((r for r in records if r["type"] == "end"), {})
            sk = skews(run_dir / f"worker{1 if kill0 is not None and args.processes > 1 else 0}.log")
            if not sk:
                sk = skews(run_dir / "worker1.log")
            # every step's loss, from the ended attempt and the resumed job (which trains nothing
            # when it resumes from the checkpoint saved after the last step)
            rows = [r for d in (run_dir / "attempt0", run_dir) if (d / "metrics.jsonl").exists()
                    for r in read_jsonl(d / "metrics.jsonl")]
            dev = max((abs(r["loss"] - losses[r["step"]]) / losses[r["step"]] for r in rows),
                      default=None)
            ok = (rc == 0 and end.get("outcome") == "finished" and len(restarts) == 1
                  and {r["step"] for r in rows} == set(range(args.steps))
                  and dev is not None and dev <= 1e-5)
            bad += not ok
            top = max((v[1] for v in sk.values()), default=0.0)
            worst = max(worst, top)
            rec = {"launch": i, "kill_coordinator": at, "kill_process_0": kill0, "exit": rc,
                   "restarts": len(restarts), "outcome": end.get("outcome"),
                   "from_step": restarts[0]["from_step"] if restarts else None,
                   "start_skew_s": {k: v[1] for k, v in sk.items()},
                   "last_at_barrier": {k: v[0] for k, v in sk.items()},
                   "max_rel_dev": dev, "wall_s": round(took, 1), "ok": ok,
                   "messages": [r.get("message", "")[:200] for r in restarts[1:]]}
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            print(f"{i:3d} kill-coordinator {at}" + (f", process 0 killed at {kill0}" if kill0 else "")
                  + f": exit {rc}, restarts {len(restarts)}, {end.get('outcome')}, resumed from "
                  f"step {rec['from_step']}, start skew "
                  + ", ".join(f"{k} {v[1]:.2f}s (p{v[0]} last)" for k, v in sk.items())
                  + f", max rel dev {'-' if dev is None else f'{dev:.1e}'}, {took:.0f}s "
                  + ("ok" if ok else "FAIL"), flush=True)
    print(f"{args.launches - bad} of {args.launches} resumed at the first attempt with the "
          f"fault-free losses; largest start skew {worst:.2f}s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
