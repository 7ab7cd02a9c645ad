"""What a run costs as a user runs it: `elasjax train` against a plain JAX script, whole processes.

    python experiments/bench_process.py [--sizes demo,3m] [--steps 5,35] [--rounds 3] [--out DIR]
    python experiments/bench_process.py --windows 200,20 [--sizes demo,3m] [--rounds 3]

`bench_scale.py` times the device loop inside one process, where elasjax's step program is at
parity with plain JAX. A user pays for the process: its start-up, the host work between steps,
and whatever runs beside the step (the standby's compiles, snapshots, metrics). Here each side
is a process of its own, started fresh for every run, on the same 8 fake CPU devices:

  plain script          `user_loop.py`'s loop (the one a JAX/Flax user writes: optax AdamW after
                        clipping, a `lax.scan` of micro-batches, ZeRO by annotation at the
                        config's stage, the state donated) over the config's model, batch and
                        mesh, run as `python experiments/bench_process.py --plain CONFIG`
  elasjax, standby off  `elasjax train CONFIG --quiet --set standby.enabled=false`
  elasjax, defaults     `elasjax train CONFIG --quiet` with the standby as the config leaves it
                        (`auto`: on in one process, built in a compile worker beside training)

Sizes: `demo` is configs/demo.yaml as users run it, without its faults and held-out evaluation
(the plain script has neither); the others are `bench_scale.py`'s ladder at ZeRO-1 (`3m`: d_model
256, 4 layers, d_mlp 1024, 8 heads, 3.3M parameters). Each run's program store is a directory of
its own, so no run loads what an earlier one compiled.

`--windows STEPS,WIDTH` asks another question: how much slower is a step while the standby
builds beside it? One run of STEPS steps per side (standby off, the defaults, the compile worker
paced by `standby.worker_share=0.1`), the mean step of each window of WIDTH steps (each step's
own `step_time_s`: start-up and step 0's compile are not in it) against the standby-off run's,
and the step at which the standby was ready.

Per side, round and size: a run of S1 and one of S2 steps; the marginal step is the difference
of their walls over S2 - S1 (start-up and compiles cancel where they are the same), and the
whole run's wall at S2 is printed too. Rounds interleave the sides; ratios are per round against
the plain script's, reported as the median (min..max). Wall clock on 8 fake devices sharing the
machine's cores: a ratio within one run is the figure, not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

SIDES = {
    "plain script": None,
    "elasjax, standby off": ["standby.enabled=false"],
    "elasjax, defaults": [],
}


def write_config(size: str, steps: int, out: Path) -> Path:
    """The size's config at `steps` steps, written out as YAML (what every side reads)."""
    from elasjax import config
    from elasjax.config.reading import dump

    if size == "demo":
        cfg = config.load(str(ROOT / "configs" / "demo.yaml"),
                          ["faults=[]", "train.eval_every=0", f"train.steps={steps}"])
    else:
        import bench_scale  # (the ladder's sizes; bench_scale turns the standby off and waits
        # for it at start: here the sides say what the standby does)

        cfg = bench_scale.size_config(size, steps, ["zero.stage=1", "standby.enabled=auto",
                                                    "standby.wait_at_start=false"])
    f = out / f"{size}-{steps}.yaml"
    f.write_text(dump(cfg))
    return f


def plain(config_path: str) -> None:
    """The plain script's whole run (`--plain`): build the user's loop for the config, run it.
    (`elasjax train` makes the config's fake devices itself; the plain script says so here.)"""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    from elasjax import config  # the config's reader only: the loop is user_loop's
    from user_loop import UserLoop

    cfg = config.load(config_path, [])
    loop = UserLoop({cfg.train.steps: cfg}, zero=cfg.zero.stage, donate=True)
    loop.wall(cfg.train.steps)


def run(side: str, cfg_path: Path, out: Path, sets: list[str] | None = None) -> float:
    """One whole process of `side` on `cfg_path` (`sets`: its overrides, `SIDES[side]` unless
    given; None: the plain script); its wall in seconds (raises if it failed). An `elasjax
    train` side writes its run to `out/run`."""
    env = {**os.environ, "ELASJAX_CACHE_DIR": str(out / "cache")}
    sets = SIDES[side] if sets is None else sets
    if sets is None:
        cmd = [sys.executable, __file__, "--plain", str(cfg_path)]
    else:
        cmd = [sys.executable, "-m", "elasjax.cli", "train", str(cfg_path), "--quiet",
               "--out", str(out / "run")]
        for s in sets:
            cmd += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{side} on {cfg_path.name}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return wall


def measure(size: str, short: int, long: int, rounds: int, out: Path) -> dict:
    cfgs = {n: write_config(size, n, out) for n in (short, long)}
    walls = {s: {short: [], long: []} for s in SIDES}
    for r in range(rounds):
        for side in SIDES:
            for n in (short, long):
                where = Path(tempfile.mkdtemp(prefix="run-", dir=out))
                walls[side][n].append(run(side, cfgs[n], where))
        print(f"  {size} round {r}: " + ", ".join(
            f"{s} {walls[s][short][-1]:.1f}/{walls[s][long][-1]:.1f}s" for s in SIDES),
            flush=True)
    step = {s: [(b - a) / (long - short) for a, b in zip(walls[s][short], walls[s][long])]
            for s in SIDES}
    res = {"size": size, "steps": [short, long], "rounds": rounds, "sides": {}}
    for s in SIDES:
        ratio = sorted(x / p for x, p in zip(step[s], step["plain script"]))
        wall_ratio = sorted(x / p for x, p in zip(walls[s][long], walls["plain script"][long]))
        res["sides"][s] = {
            "step_ms": [round(x * 1e3, 1) for x in step[s]],
            "step_ratio": [statistics.median(ratio), ratio[0], ratio[-1]],
            "wall_s": [round(x, 2) for x in walls[s][long]],
            "wall_ratio": [statistics.median(wall_ratio), wall_ratio[0], wall_ratio[-1]],
        }
    return res


# --windows: the step with the standby building against the step without it, window by window
WINDOW_SIDES = {
    "standby off": ["standby.enabled=false"],
    "defaults (worker unpaced)": [],
    "worker paced at 0.1": ["standby.worker_share=0.1"],
}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def measure_windows(size: str, steps: int, width: int, rounds: int, out: Path) -> dict:
    """`elasjax train` of `steps` steps per side (`WINDOW_SIDES`), rounds interleaved: each
    step's own time (`step_time_s`: from its dispatch, or the step before's end, to its end; the
    process's start-up and step 0's compile are not in it), the mean of each window of
    `width` steps from step 1 (its wall over its steps), and the step at which the standby was
    seen built. A window's ratio is the side's mean against the standby-off run's of the same
    round."""
    cfg = write_config(size, steps, out)
    per = {s: [] for s in WINDOW_SIDES}  # side -> per round: (window means, ready step, wall, paced s)
    for r in range(rounds):
        for side, sets in WINDOW_SIDES.items():
            where = Path(tempfile.mkdtemp(prefix="run-", dir=out))
            wall = run(side, cfg, where, sets)
            rows = _jsonl(where / "run" / "metrics.jsonl")
            dts = [row["step_time_s"] for row in rows if row["step"] >= 1]
            # a window's mean, not its median: a paced compile slows a few steps a lot, which a
            # median would not see
            wins = [statistics.fmean(dts[i:i + width]) for i in range(0, len(dts), width)
                    if len(dts[i:i + width]) == width]
            ready = [e["step"] for e in _jsonl(where / "run" / "events.jsonl")
                     if e["type"] == "standby_ready"]
            end = [e for e in _jsonl(where / "run" / "events.jsonl") if e["type"] == "end"][-1]
            per[side].append((wins, ready[0] if ready else None, wall,
                              (end.get("standby") or {}).get("worker_paced_s")))
        print(f"  {size} round {r}: " + ", ".join(
            f"{s} {per[s][-1][2]:.1f}s (ready at step {per[s][-1][1]})" for s in WINDOW_SIDES),
            flush=True)
    res = {"size": size, "steps": steps, "width": width, "rounds": rounds, "sides": {}}
    base = [w for w, *_ in per["standby off"]]
    for side in WINDOW_SIDES:
        n = min(len(w) for w, *_ in per[side])
        ratios = [statistics.median(per[side][r][0][i] / base[r][i] for r in range(rounds))
                  for i in range(n)]
        res["sides"][side] = {
            "window_ms": [round(statistics.median(per[side][r][0][i] for r in range(rounds)) * 1e3,
                                1) for i in range(n)],
            "window_ratio": [round(x, 3) for x in ratios],
            "ready_step": [x[1] for x in per[side]],
            "wall_s": [round(x[2], 1) for x in per[side]],
            "paced_s": [x[3] for x in per[side]],
        }
    return res


def window_table(results: list[dict]) -> str:
    lines = []
    for r in results:
        w = r["width"]
        lines += [f"{r['size']}, {r['steps']} steps, mean step of windows of {w} steps from step 1, median of "
                  f"{r['rounds']} rounds; ratio: against the standby-off run of the same round",
                  "| side | window mean step (ms) | ratio per window | max | standby ready at "
                  "step | whole run (s) |", "|---|---|---|---|---|---|"]
        for s, v in r["sides"].items():
            lines.append(f"| {s} | {', '.join(f'{x:.0f}' for x in v['window_ms'])} | "
                         f"{', '.join(f'{x:.2f}' for x in v['window_ratio'])} | "
                         f"{max(v['window_ratio']):.3f} | {v['ready_step']} | "
                         f"{', '.join(f'{x:.1f}' for x in v['wall_s'])} |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    lines = ["| size | side | marginal step per round (ms) | ratio to plain (median, min..max) "
             "| whole run at S2 (s) | wall ratio |", "|---|---|---|---|---|---|"]
    for r in results:
        for s, v in r["sides"].items():
            m, lo, hi = v["step_ratio"]
            wm, wlo, whi = v["wall_ratio"]
            lines.append(f"| {r['size']} (steps {r['steps'][0]}->{r['steps'][1]}) | {s} | "
                         f"{', '.join(f'{x:.0f}' for x in v['step_ms'])} | {m:.3f} "
                         f"({lo:.3f}..{hi:.3f}) | {', '.join(f'{x:.1f}' for x in v['wall_s'])} | "
                         f"{wm:.3f} ({wlo:.3f}..{whi:.3f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="demo,3m")
    ap.add_argument("--steps", default="5,35", help="S1,S2: the two run lengths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--windows", default=None, metavar="STEPS,WIDTH",
                    help="instead: each side's step window by window over one run of STEPS "
                         "steps, standby off / defaults / worker unpaced (`measure_windows`)")
    ap.add_argument("--plain", default=None, help=argparse.SUPPRESS)  # the plain script's child
    args = ap.parse_args(argv)
    if args.plain:
        plain(args.plain)
        return 0
    if args.windows:
        try:
            steps, width = (int(x) for x in args.windows.split(","))
        except ValueError:
            ap.error(f"--windows = {args.windows!r}; allowed: STEPS,WIDTH, two ints")
        if not 0 < width < steps:
            ap.error(f"--windows = {args.windows!r}; allowed: 0 < WIDTH < STEPS")
        out = Path(args.out or tempfile.mkdtemp(prefix="elasjax-bench-process-"))
        out.mkdir(parents=True, exist_ok=True)
        results = [measure_windows(size, steps, width, args.rounds, out)
                   for size in args.sizes.split(",")]
        (out / "windows.json").write_text(json.dumps(results, indent=1))
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
        print(window_table(results))
        return 0
    try:
        short, long = (int(x) for x in args.steps.split(","))
    except ValueError:
        ap.error(f"--steps = {args.steps!r}; allowed: two step counts S1,S2 with S1 < S2")
    if not 0 < short < long:
        ap.error(f"--steps = {args.steps!r}; allowed: two step counts S1,S2 with 0 < S1 < S2")
    if args.rounds < 1:
        ap.error(f"--rounds = {args.rounds}; allowed: an int >= 1")
    out = Path(args.out or tempfile.mkdtemp(prefix="elasjax-bench-process-"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for size in args.sizes.split(","):
        results.append(measure(size, short, long, args.rounds, out))
        (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (the benchmark's own processes "
          "count)")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
