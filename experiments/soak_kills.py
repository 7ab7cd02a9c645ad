"""A soak of real deaths under `elasjax launch` with default flags: does one death stay one death?

    PYTHONPATH=. python experiments/soak_kills.py [--launches 40 --seed 0 --steps 14]
        [--configs configs/demo_zero.yaml,configs/multiprocess.yaml] [--out runs/soak_kills]
        [--kill-from STEP] [--victim P] [--second random|none|any|detect|recovery/plan|...]
        [--set standby.wait_at_start=true --set standby.wait_after_recovery=true]

The MTTR fuzz of issue 83 is this soak: `--second any` puts a second kill in a drawn phase of
the first one's recovery, `--victim 0` kills process 0 first, and the two `--set`s make every
kill fall after the standby is ready (training waits for it at the start and after each
recovery).

Each launch runs four processes x two CPU devices (gloo collectives, loopback) with no flag but
`--processes`, `--devices-per-process` and the schedule: launch i trains the i-th config of
`--configs` (round robin) with one or two SIGKILLs drawn from `--seed` and i: a process killed
right after it dispatched a random step, and for a second kill either another process at a later
step or another process killed during the first one's recovery (its transfer). Each config's
fault-free run (one process, 8 fake devices) is the reference.

Printed per launch: the kills, the recoveries, the survivors lost (a process that was not killed
and did not exit 0: a gloo abort of a healthy survivor shows here as SIGABRT), the launch's exit
code, and the losses against the fault-free run (max relative deviation; "bitwise" where the run
was in the deterministic mode and its final state digest equals the reference's), and each
recovery's MTTR with its phases; the end prints their distribution (median, 90th percentile,
max) over all recoveries and over those after the standby was ready (a `standby_ready` event
before the failure), and every recovery with a phase of 8 s or more. A launch
passes when it exits 0, loses no survivor, has one recovery per kill that fired, and its losses
are within 1e-5 (bitwise in the deterministic mode). Every record also goes to
`<out>/soak.jsonl`. Exit code 1 when a launch fails. Wall-clock figures are this machine's (2
shared cores). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elasjax.observe.compare import compare_runs  # noqa: E402
from elasjax.observe.metrics import read_jsonl  # noqa: E402

PROCESSES = 4
ABORT = "Received data size doesn't match expected size"


def draw(i: int, seed: int, steps: int, kill_from: int = 1, victim: int | None = None,
         second: str = "random") -> list[dict]:
    """Launch i's kills: one or two fault entries (`kill_process`, phase step or recovery).
    The first kill falls at a step in [kill_from, steps - 3), on process `victim` (any when
    None); `second`: "random" (none, a later step or during the recovery, drawn), "none", or
    where a second kill always falls: one of `SECOND_PHASES` ("detect": the same step, the
    two deaths found by one detection; a recovery phase: as that phase of the first one's
    recovery begins, or in its first step), "any" (one of those, drawn)."""
    rng = random.Random(f"{seed}/{i}")
    first = {"at_step": rng.randrange(kill_from, steps - 3),
             "kill_process": rng.randrange(PROCESSES) if victim is None else victim}
    kills = [first]
    if second in SECOND_PHASES or second == "any":
        phase = rng.choice(SECOND_PHASES) if second == "any" else second
        other = rng.choice([p for p in range(PROCESSES) if p != first["kill_process"]])
        kills.append({"at_step": first["at_step"], "kill_process": other,
                      **({} if phase == "detect" else {"phase": phase})})
    elif second == "random" and rng.random() < 0.5:
        other = rng.choice([p for p in range(PROCESSES) if p != first["kill_process"]])
        if rng.random() < 0.5:  # during the first one's recovery
            kills.append({"at_step": first["at_step"], "kill_process": other, "phase": "recovery"})
        else:
            kills.append({"at_step": rng.randrange(first["at_step"] + 1, steps - 1),
                          "kill_process": other})
    return kills


# where `draw`'s second kill may fall (`--second`): with the first one ("detect"), or in a
# phase of its recovery (`faults.RECOVERY_PHASES`)
SECOND_PHASES = ("detect", "recovery/plan", "recovery/transfer", "recovery/verify",
                 "recovery/first_step")


def spec(k: dict) -> str:
    phase = k.get("phase", "step")
    return f"{k['at_step']}:{k['kill_process']}" + (f"({phase})" if phase != "step" else "")


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


def reference(config: str, sets: list[str], out: Path, timeout: float) -> Path:
    ref = out / f"ref_{Path(config).stem}"
    if not (ref / "metrics.jsonl").exists():
        cmd = [sys.executable, "-m", "elasjax.cli", "train", config, "--quiet", "--out", str(ref)]
        for s in [*sets, "faults=[]"]:
            cmd += ["--set", s]
        rc, took = run(cmd, out / f"ref_{Path(config).stem}.log", timeout)
        print(f"reference {config}: exit {rc} in {took:.0f}s", flush=True)
        if rc != 0:
            raise SystemExit(f"the fault-free reference of {config} failed (exit {rc})")
    return ref


def judge(i: int, config: str, kills: list[dict], rc: int, took: float, run_dir: Path,
          ref: Path, restarts: int = 0, steps: int = 0, room: int = 8) -> dict:
    rec = {"launch": i, "config": config, "kills": [spec(k) for k in kills], "exit": rc,
           "wall_s": round(took, 1)}
    try:
        summary = json.loads((run_dir / "launch.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = {"processes": []}
    targets = {k["kill_process"] for k in kills}
    procs = summary.get("processes", [])
    # the schedule's kills (`scheduled_kill`); a restarted worker the launcher reaped because the
    # job ended before it was admitted is not one
    killed = {(s["process"], s.get("incarnation", 0)) for s in procs
              if s.get("signal") == "SIGKILL" and s.get("scheduled_kill")}
    fired = sorted(p for p, _ in killed)
    logs = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("worker*.log")))
    # every survivor stopped with UnrecoverableStateError: the kills took a slice and all its
    # copies (a refusal the snapshot settings explain), not a survivor lost to a fault
    def unadmitted(s) -> bool:
        """A restarted worker still waiting to rejoin when the job ended (the launcher reaps
        it): not a survivor, since it never held any state."""
        if not s.get("incarnation") or s.get("signal") != "SIGKILL":
            return False
        try:
            return " admitted at step " not in Path(s["log"]).read_text(errors="replace")
        except OSError:
            return False

    def survivor(s) -> bool:
        return (s["process"], s.get("incarnation", 0)) not in killed and not unadmitted(s)

    refused = (rc != 0 and "UnrecoverableStateError" in logs and all(
        s.get("returncode") == 1 for s in procs if survivor(s)))
    lost = [] if refused else sorted(
        (s["process"], s.get("signal") or s.get("returncode")) for s in procs
        if survivor(s) and s.get("returncode") not in (0, None))
    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    recs = [e for e in events if e["type"] == "recovery"]
    rec.update(
        fired=fired, survivors_lost=lost, refused=refused, recoveries=len(recs),
        retries=sum(1 for e in recs if not e.get("failed_processes")),
        recovered=sorted(p for e in recs for p in e.get("failed_processes", ())),
        renewed=sum(1 for e in recs if e.get("collectives_renewed")),
        gloo_aborts=logs.count(ABORT),
        mttr_s=[round(e["mttr_s"], 2) for e in recs],
        phases=[phases(e, events) for e in recs],
        renew_s=[round(e.get("renew_s") or 0.0, 3) for e in recs],
        drain_s=[e.get("drain_s") for e in recs],
        compile_s=[round(e.get("compile_s") or 0.0, 2) for e in recs],
        outcome=summary.get("outcome"), message=(summary.get("message") or "")[:300],
    )
    if (run_dir / "metrics.jsonl").exists() and rc == 0:
        cmp = compare_runs(run_dir, ref)
        rec["max_rel_dev"] = cmp["all"]["max_rel"]
        rec["steps"] = cmp["all"]["steps"]
        rec["same_samples"] = cmp["batches_identical"]
        rec["bitwise"] = cmp.get("final_state_identical")
        start = [e for e in events if e["type"] == "start"]
        rec["deterministic"] = bool(start and start[0].get("deterministic"))
    grown_back = True
    if restarts:  # back to full size after each admission, where a kill left room for it
        rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        n = {r["step"]: r["n_devices"] for r in rows}
        full = max(n.values(), default=0)
        joins = [e["step"] for e in events if e["type"] == "join"]
        rec["joins"] = joins
        rec["steps_to_full"] = [
            next((s - j for s in sorted(n) if s >= j and n[s] == full), None) for j in joins]
        rec["growth_stall_s"] = [round(e["stall_s"], 3) for e in events if e["type"] == "growth"]
        rec["final_devices"] = n[max(n)] if n else None
        last_kill = max(k["at_step"] for k in kills)
        rec["room"] = steps - last_kill >= room
        grown_back = not rec["room"] or rec["final_devices"] == full
    ok = (refused and set(fired) == targets) or (
          rc == 0 and not lost and rec["recovered"] == fired and set(fired) == targets
          and rec.get("same_samples") is True
          and rec.get("max_rel_dev", 1.0) <= 1e-5
          and (not rec.get("deterministic") or rec.get("bitwise") is True) and grown_back)
    rec["ok"] = bool(ok)
    return rec


# a recovery's phases as its event reports them (docs/reference.md, "Output files")
PHASES = ("detect_s", "retry_s", "renew_s", "plan_s", "standby_wait_s", "compile_s",
          "transfer_s", "verify_s", "snapshot_s", "first_step_s")
LONG_WAIT_S = 8.0  # the collective timeout of a launch's defaults: a wait this long is a timeout


def phases(e: dict, events: list[dict]) -> dict:
    """One recovery's MTTR, phases and conditions: whether the standby had finished building
    before the failure (a `standby_ready` event earlier in the file), whether it held the plan
    (`standby_hit`), how many attempts it took."""
    before = events[:events.index(e)]
    return {"mttr_s": e["mttr_s"], **{k: e.get(k) for k in PHASES},
            "standby_ready": any(x["type"] == "standby_ready" for x in before),
            "standby_hit": e.get("standby_hit"), "origin": e.get("executable_origin"),
            "attempts": e.get("attempts"), "compiles": e.get("compiles"),
            "failed_phases": e.get("failed_phases"), "step": e["step"]}


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs, nearest rank (no interpolation: a figure that was measured)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, -(-int(q * 100) * len(xs) // 100) - 1))]


def mttr_table(recs: list[dict]) -> str:
    """The MTTR distribution over every recovery and over those after the standby was ready,
    the median of each phase, and every recovery with a phase of LONG_WAIT_S or more."""
    rows = [(r["launch"], p) for r in recs for p in r.get("phases", [])]
    if not rows:
        return "no recoveries"
    out = []
    for name, sel in (("all recoveries", rows),
                      ("after the standby was ready", [x for x in rows if x[1]["standby_ready"]]),
                      ("one attempt, standby ready", [x for x in rows if x[1]["standby_ready"]
                                                      and x[1]["attempts"] == 1])):
        m = [p["mttr_s"] for _, p in sel]
        if not m:
            out.append(f"MTTR {name}: none")
            continue
        med = {k: statistics.median(p[k] or 0.0 for _, p in sel) for k in PHASES}
        out.append(f"MTTR {name} ({len(m)}): median {statistics.median(m):.2f}s, p90 "
                   f"{quantile(m, 0.9):.2f}s, max {max(m):.2f}s; phase medians "
                   + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in med.items()))
    long = [(i, p) for i, p in rows if any((p[k] or 0.0) >= LONG_WAIT_S for k in PHASES)]
    out.append(f"recoveries with a phase of {LONG_WAIT_S:g}s or more: {len(long)}" + "".join(
        f"\n  launch {i} step {p['step']}: " + ", ".join(
            f"{k[:-2]} {p[k]:.2f}" for k in PHASES if (p[k] or 0.0) >= 1.0)
        for i, p in long))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="configs/demo_zero.yaml,configs/multiprocess.yaml")
    ap.add_argument("--launches", type=int, default=40)
    ap.add_argument("--first", type=int, default=0, help="the first launch's index (to resume)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--kill-from", type=int, default=1,
                    help="the first kill's earliest step (later: the standby is more often ready)")
    ap.add_argument("--victim", type=int, default=None,
                    help="the process the first kill takes (default: drawn)")
    ap.add_argument("--second", choices=("random", "none", "any", *SECOND_PHASES),
                    default="random",
                    help="the second kill: drawn (none, a later step, during the recovery's "
                    "transfer), never, or always at the first one's step: found with it "
                    "(detect), as a phase of its recovery begins, in its first step, or any of "
                    "these drawn")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="a config override for every launch and reference (not a flag)")
    ap.add_argument("--out", default="runs/soak_kills")
    ap.add_argument("--worker-restarts", type=int, default=0,
                    help="restart dead workers (they rejoin): the soak of rejoins; a launch "
                    "whose last kill leaves --room steps must end on all its devices")
    ap.add_argument("--room", type=int, default=8)
    ap.add_argument("--judge-only", action="store_true",
                    help="judge the launches already under --out again (no launch is run)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    configs = args.configs.split(",")
    sets = [f"train.steps={args.steps}", *args.sets]
    refs = {c: reference(c, sets, out, args.timeout) for c in configs}
    recs = []
    with (out / ("rejudged.jsonl" if args.judge_only else "soak.jsonl")).open("a") as fh:
        for i in range(args.first, args.first + args.launches):
            config = configs[i % len(configs)]
            kills = draw(i, args.seed, args.steps, args.kill_from, args.victim, args.second)
            run_dir = out / f"launch{i:03d}"
            if args.judge_only:
                if not (run_dir / "launch.json").exists():
                    break
                summary = json.loads((run_dir / "launch.json").read_text())
                took = summary.get("elapsed_s", 0.0)
                rc = 0 if summary.get("outcome") == "finished" else 1
            else:
                cmd = [sys.executable, "-m", "elasjax.cli", "launch", config, "--processes",
                       str(PROCESSES), "--devices-per-process", "2", "--quiet", "--out",
                       str(run_dir), "--timeout", str(args.timeout - 60)]
                if args.worker_restarts:
                    cmd += ["--worker-restarts", str(args.worker_restarts)]
                for s in [*sets, "faults=" + json.dumps(kills)]:
                    cmd += ["--set", s]
                rc, took = run(cmd, out / f"launch{i:03d}.log", args.timeout)
            rec = judge(i, config, kills, rc, took, run_dir, refs[config], args.worker_restarts,
                        args.steps, args.room)
            rec["load"] = round(os.getloadavg()[0], 1)
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            recs.append(rec)
            print(line(rec), flush=True)
    print(summarize(recs), flush=True)
    print(mttr_table(recs), flush=True)
    return 0 if all(r["ok"] for r in recs) else 1


def line(rec: dict) -> str:
    dev = rec.get("max_rel_dev")
    if rec["refused"]:
        why = "ok: refused, a slice lost with its copies (UnrecoverableStateError on every survivor)"
    else:
        why = "ok" if rec["ok"] else "FAIL: " + re.sub(r"\s+", " ", rec["message"])[:160]
    return (f"{rec['launch']:3d} {Path(rec['config']).stem:13s} kills {' '.join(rec['kills']):22s} "
            f"fired {rec['fired']} recoveries {rec['recoveries']} (retries {rec['retries']}, "
            f"renewed {rec['renewed']}) survivors lost {len(rec['survivors_lost'])} "
            f"{rec['survivors_lost'] or ''} exit {rec['exit']} dev "
            f"{'-' if dev is None else f'{dev:.1e}'}{' bitwise' if rec.get('bitwise') else ''} "
            f"gloo-aborts {rec['gloo_aborts']} MTTR {rec['mttr_s']} {rec['wall_s']:.0f}s"
            + (f" joins {rec['joins']} steps to full size {rec['steps_to_full']} growth stalls "
               f"{rec['growth_stall_s']} final devices {rec['final_devices']}"
               if "joins" in rec else "") + f" {why}")


def summarize(recs: list[dict]) -> str:
    lost = sum(len(r["survivors_lost"]) for r in recs)
    devs = [r["max_rel_dev"] for r in recs if r.get("max_rel_dev") is not None]
    det = [r for r in recs if r.get("deterministic") and r.get("max_rel_dev") is not None]
    back = [s for r in recs for s in r.get("steps_to_full", []) if s is not None]
    grow = ""
    if any("joins" in r for r in recs):
        grow = (f"; joins {sum(len(r['joins']) for r in recs)}, steps from admission to full "
                f"size median {statistics.median(back) if back else '-'} max "
                f"{max(back, default='-')}, never back {sum(s is None for r in recs for s in r.get('steps_to_full', []))}; "
                f"ended on all devices {sum(r['final_devices'] == 8 for r in recs)} of {len(recs)} "
                f"({sum(r['room'] for r in recs)} with room after the last kill)")
    return (f"{sum(r['ok'] for r in recs)} of {len(recs)} launches ok; survivors lost {lost} "
            f"(in {sum(bool(r['survivors_lost']) for r in recs)} launches); gloo aborts "
            f"{sum(r['gloo_aborts'] for r in recs)}; refused (a slice lost with its copies) "
            f"{sum(r['refused'] for r in recs)}; kills {sum(len(r['fired']) for r in recs)}, "
            f"recoveries {sum(r['recoveries'] for r in recs)}; max rel dev "
            f"{max(devs, default=0):.1e}; bitwise {sum(r.get('bitwise') is True for r in det)} of "
            f"{len(det)} deterministic" + grow)


if __name__ == "__main__":
    sys.exit(main())
