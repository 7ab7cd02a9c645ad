"""The MTTR of a user's own loop under launch: random SIGKILLs of examples/own_loop.py.

    PYTHONPATH=. python experiments/fuzz_own_loop.py [--launches 10 --seed 81 --steps 12]
        [--standby] [--out runs/fuzz_own_loop]

Launch 0 is the fault-free reference (4 processes x 2 CPU devices). Each other launch kills one
process drawn from the seed (process 0 included) right after it committed a drawn step, and
reads the script's own record (`--out FILE` of examples/own_loop.py): the recovery (rung,
attempts, verified, standby hit, each phase) and the losses against the reference. A launch
passes when it exits 0, has one verified recovery of the step before the kill, every step once,
and losses within 1e-5 of the reference (the data degree changes the order of the sums: not
bitwise). Prints each launch, then the MTTR's median, 90th percentile and max; exit code 1 when
a launch fails. Wall-clock figures are this machine's (2 shared cores). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "own_loop.py"


def launch(out: Path, name: str, kills: list[str], args: list[str]) -> tuple[int, dict | None]:
    rec = out / f"{name}.json"
    cmd = [sys.executable, "-m", "elasjax.cli", "launch", str(SCRIPT), "--processes", "4",
           "--devices-per-process", "2", "--quiet", "--out", str(out / name),
           *(a for k in kills for a in ("--kill", k)), "--", "--out", str(rec), *args]
    rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        timeout=600).returncode
    return rc, json.loads(rec.read_text()) if rec.exists() else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--seed", type=int, default=81)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--standby", action="store_true", help="the example's --standby")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="fuzz_own_loop-"))
    out.mkdir(parents=True, exist_ok=True)
    args = ["--steps", str(a.steps), *(["--standby"] if a.standby else [])]
    rc, ref = launch(out, "reference", [], args)
    if rc or ref is None:
        print(f"the fault-free launch failed (exit {rc})")
        return 1
    r = random.Random(a.seed)
    mttr, failed = [], 0
    for i in range(a.launches):
        step, proc = r.randint(2, a.steps - 2), r.randint(0, 3)
        rc, run = launch(out, f"launch{i}", [f"{step}:{proc}"], args)
        ok = rc == 0 and run is not None and len(run["recoveries"]) == 1
        line = f"launch {i}: --kill {step}:{proc} exit {rc}"
        if ok:
            x = run["recoveries"][0]
            dev = max(abs(run["losses"][k] - v) / abs(v) for k, v in ref["losses"].items())
            ok = (x["verified"] and x["step"] == step - 1 and x["failed_processes"] == [proc]
                  and run["losses"].keys() == ref["losses"].keys() and dev < 1e-5)
            mttr.append(x["mttr_s"])
            line += (f"; MTTR {x['mttr_s']:.3f}s (detect {x['detect_s']:.3f}, recovery "
                     f"{x['total_s']:.3f}, first step {x['first_step_s']:.3f}); {x['rung']}, "
                     f"attempts {x['attempts']}, standby hit {x['standby_hit']}, verified "
                     f"{x['verified']}; max rel loss dev {dev:.1e}")
        failed += not ok
        print(line + ("" if ok else "  FAILED"), flush=True)
    if mttr:
        q = sorted(mttr)
        p90 = q[min(len(q) - 1, int(round(0.9 * (len(q) - 1))))]
        print(f"{a.launches - failed} of {a.launches} launches ok; MTTR median "
              f"{statistics.median(q):.3f}s, p90 {p90:.3f}s, max {q[-1]:.3f}s")
    print(f"outputs: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
