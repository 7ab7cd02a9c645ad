"""The bitwise contract, swept: each deterministic config through failures that shrink its data
degree to every value the planner allows, and a growth back, run as users run it.

The deterministic mode promises that a run with failures ends on the fault-free run's state,
bit for bit (ARCHITECTURE.md, rule 3). What can break that is anything whose bits depend on the
layout: a reduction XLA splits by the shape it sees, a multiply and an add contracted for some
shapes only, a sum left in storage chunks that divide one degree's rows and not another's. So
the check has to visit every layout a config can reach, at the config's own sizes, with the
compiler as users run it (the suite compiles with other XLA:CPU settings: tests/conftest.py).

    python -m elasjax.bench.bitwise                   # every case, one row per data degree
    python -m elasjax.bench.bitwise --chain demo_zero # one run through every degree and back

A **case** is a config of `configs/` whose mode is deterministic (`Config.deterministic`), or a
documented configuration that turns the mode on (`CASES`). For a case, `shrink_path` asks the
planner (pure Python) which plans a chain of single-device failures leads to, from the initial
plan down to the smallest one it allows; each new data degree on the way is a row. Two shapes of
schedule:
- `degree_faults`: the devices that take the initial plan to one degree, failed together at
  one step, then the run goes on: one run per layout (the table of `experiments/RESULTS.md`,
  "The bitwise sweep");
- `chain_faults`: one run down the whole chain, a device at a time, then every failed device
  returns (`join`) and the run grows back (tests/test_bitwise_sweep.py).

Each faulted run is compared with the case's fault-free run of the same steps: every step's
sample digest, loss, gradient norm and state digest (the checksums of every leaf of the
parameters and optimizer state after the step), and the final `state_digest`, bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: str  # a path under the repository's configs/
    overrides: tuple[str, ...] = ()  # `--set` values that make the case (not the sweep's own)


# The documented deterministic configurations besides the configs whose mode is deterministic
# as written (`deterministic_configs` finds those): the pipeline demo with the mode on and its
# re-plans kept pipelined (its own comment, and docs/parallelism.md), and the tensor-parallel
# demo with the mode on (its comment: "Left out (or true): the deterministic mode").
EXTRA_CASES = (
    Case("demo_pipeline", "configs/demo_pipeline.yaml",
         ("train.deterministic=true", "parallel.min_stage=2")),
    Case("demo", "configs/demo.yaml", ("train.deterministic=true",)),
)


def deterministic_configs(root: Path = ROOT) -> list[Case]:
    """Every config in `configs/` whose mode, as written, is deterministic."""
    from ..config import load

    out = []
    for path in sorted((root / "configs").glob("*.yaml")):
        if load(str(path), []).deterministic:
            out.append(Case(path.stem, str(path.relative_to(root))))
    return out


def cases(root: Path = ROOT) -> list[Case]:
    return deterministic_configs(root) + list(EXTRA_CASES)


# The order devices fail in along a chain: hosts broken up and the lowest ids not first, so the
# survivors are not always a prefix of the job's devices.
FAIL_ORDER = (3, 6, 0, 5, 1, 7, 4, 2)

# The sweep's own settings, none of which changes a bit of the computation: the standby and
# the transitions planned ahead are off (they compile and plan beside the run on the same 2
# cores; a standby hit runs the same program), and so are held-out evaluations (not part of the
# state).
SWEEP_SETS = ("standby.enabled=false", "recovery.prepare_transfers=false", "train.eval_every=0")


def load(case: Case, *sets: str):
    from ..config import load as load_config

    return load_config(str(ROOT / case.config), [*case.overrides, *SWEEP_SETS, *sets])


def shrink_path(case: Case) -> list[tuple[tuple[int, ...], object]]:
    """[(devices failed so far, the plan on the survivors)] from the initial plan down the
    chain of single-device failures in `FAIL_ORDER`, as the planner re-plans each (the planner
    is pure Python: nothing runs). The first entry is the initial plan (no device failed); the
    chain ends where the planner finds no plan that keeps the bits (`planner.replan`: past
    it, a mode the default chose gives way and says so)."""
    from ..plan.planner import NoPlanError, Topology, initial_plan, replan

    cfg = load(case, "faults=[]")
    topo = Topology(tuple(range(cfg.parallel.devices)), cfg.parallel.devices_per_host)
    first = initial_plan(topo, cfg)
    out, plan, failed = [((), first)], first, []
    for d in FAIL_ORDER[: len(topo.device_ids) - 1]:
        failed.append(d)
        live = [i for i in topo.device_ids if i not in failed]
        try:  # the plans that keep the bits (a mode the default chose may give way after)
            plan = replan(live, topo, cfg, plan, first, give_way=False)
        except NoPlanError:
            break
        out.append((tuple(failed), plan))
    return out


def layout_of(plan) -> str:
    """A plan's mesh shape as the sweep's rows name it: the data degree, and the stage count
    of a pipelined plan (`3`, `3x2 stages`)."""
    return f"{plan.data}" + (f"x{plan.stage} stages" if plan.stage > 1 else "")


def degrees(case: Case) -> list[tuple[str, tuple[int, ...], object]]:
    """[(layout, devices failed, plan)]: the first point of `shrink_path` at each mesh shape
    (data degree; and stage count, for pipelines) other than the initial plan's."""
    path = shrink_path(case)
    seen, out = {layout_of(path[0][1])}, []
    for failed, plan in path[1:]:
        if layout_of(plan) not in seen:
            seen.add(layout_of(plan))
            out.append((layout_of(plan), failed, plan))
    return out


def _faults(events: list[str]) -> str:
    return "faults=[" + ", ".join(events) + "]"


def degree_faults(failed: tuple[int, ...], at: int = 3) -> tuple[str, int]:
    """(faults, steps): the devices `failed` lost one a step from step `at` on, in order (as
    the chain loses them: each a failure set the default snapshots cover, where losing several
    buddies together would not be), then three more steps on the plan they leave."""
    events = [f"{{at_step: {at + i}, devices: [{d}]}}" for i, d in enumerate(failed)]
    return _faults(events), at + len(failed) + 3


def chain_faults(case: Case, every: int = 2) -> tuple[str, int, list[str]]:
    """(faults, steps, the layout after each event): the devices of `shrink_path` failed one at
    a time, `every` steps apart (one device per event: a failure set the default snapshots
    cover, as two buddies lost together would not be), then every failed device returns at
    once and the run goes on `every + 1` steps after it."""
    path = shrink_path(case)
    events, after, at = [], [], every
    for (failed, plan) in path[1:]:
        events.append(f"{{at_step: {at}, devices: [{failed[-1]}]}}")
        after.append(layout_of(plan))
        at += every
    if len(path) > 1:
        events.append(f"{{at_step: {at}, join: {{devices: {sorted(path[-1][0])}}}}}")
        after.append(layout_of(path[0][1]))
    return _faults(events), at + every + 1, after


def user_env() -> dict[str, str]:
    """This process's environment with XLA's flags as a user's process has them: the suite's
    compile-time savings (tests/conftest.py: the loop emitters, fewer HLO passes) produce other
    kernels, whose bits are not the ones users get (a reduce whose order depended on the shape
    passed the suite's settings and failed the users': experiments/RESULTS.md, "The bitwise
    sweep")."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_cpu_use_fusion_emitters")]
    env["XLA_FLAGS"] = " ".join(flags)
    env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    return env


def train(case: Case, out: Path, *sets: str, timeout: float = 1200) -> dict:
    """`elasjax train` of the case in a process of its own, as a user runs it. Returns what
    `compare` reads: {"rc", "output", "metrics", "end"}."""
    cmd = [sys.executable, "-m", "elasjax.cli", "train", str(ROOT / case.config),
           "--out", str(out)]
    for s in (*case.overrides, *SWEEP_SETS, *sets):
        cmd += ["--set", s]
    p = subprocess.run(cmd, cwd=ROOT, env=user_env(), capture_output=True, text=True,
                       timeout=timeout)
    metrics = _jsonl(out / "metrics.jsonl")
    ends = [e for e in _jsonl(out / "events.jsonl") if e.get("type") == "end"]
    return {"rc": p.returncode, "output": p.stdout[-4000:] + p.stderr[-4000:],
            "metrics": metrics, "end": ends[-1] if ends else None}


# The fault-free run leaves out what only prepares for failures it never has: the pipeline demo's
# async migration builds its fast-path plans before step 0 (`standby.wait_at_start`), a compile
# no step of a fault-free run uses. The step's program, and so every bit, is the same.
FAULT_FREE_SETS = ("faults=[]", "recovery.migration=blocking")


def fault_free(case: Case, out: Path, steps: int) -> dict:
    """The case's fault-free run of `steps` steps (`train`), the reference of its faulted runs."""
    return train(case, out, f"train.steps={steps}", *FAULT_FREE_SETS)


def launch(case: Case, out: Path, *args: str, sets: tuple[str, ...] = (),
           timeout: float = 1200) -> dict:
    """`elasjax launch` of the case (`args`: its flags, e.g. `--processes 4 --kill 3:2`), as a
    user runs it; returns what `compare` reads, as `train` does, with the launch's summary."""
    cmd = [sys.executable, "-m", "elasjax.cli", "launch", str(ROOT / case.config),
           "--out", str(out), "--timeout", str(int(timeout) - 30), *args]
    for s in (*case.overrides, *SWEEP_SETS, *sets):
        cmd += ["--set", s]
    p = subprocess.run(cmd, cwd=ROOT, env=user_env(), capture_output=True, text=True,
                       timeout=timeout, start_new_session=True)
    ends = [e for e in _jsonl(out / "events.jsonl") if e.get("type") == "end"]
    summary = out / "launch.json"
    return {"rc": p.returncode, "output": p.stdout[-4000:] + p.stderr[-4000:],
            "metrics": _jsonl(out / "metrics.jsonl"), "end": ends[-1] if ends else None,
            "events": _jsonl(out / "events.jsonl"),
            "launch": json.loads(summary.read_text()) if summary.exists() else None}


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclasses.dataclass(frozen=True)
class Verdict:
    bitwise: bool
    first_difference: str  # "" where bitwise
    digest: str | None
    reference_digest: str | None
    plans: tuple[str, ...]  # the plans the faulted run stood on, in order


def compare(run: dict, ref: dict) -> Verdict:
    """Every step's samples, loss, gradient norm and state, and the final state, bit for bit."""
    plans = tuple(p for i, p in enumerate(r["plan"] for r in run["metrics"])
                  if i == 0 or p != run["metrics"][i - 1]["plan"])
    digest = run["end"]["state_digest"] if run["end"] else None
    ref_digest = ref["end"]["state_digest"] if ref["end"] else None
    why = ""
    if run["rc"] != 0 or ref["rc"] != 0:
        said = [ln for ln in (run["output"] + ref["output"]).splitlines()
                if ln.startswith("elasjax: ")]
        why = f"exit {run['rc']} (reference {ref['rc']})" + (f": {said[-1][:300]}" if said
                                                            else "")
    else:
        a = {r["step"]: r for r in run["metrics"]}
        b = {r["step"]: r for r in ref["metrics"]}
        if sorted(a) != sorted(b):
            why = f"steps {sorted(set(a) ^ set(b))} in one run only"
        for s in sorted(set(a) & set(b)):
            for k in ("batch_digest", "loss", "grad_norm", "state_digest"):
                if a[s].get(k) != b[s].get(k) and not why:
                    why = (f"step {s} ({a[s]['plan']}): {k} {a[s].get(k)!r} != "
                           f"{b[s].get(k)!r}")
        if not why and digest != ref_digest:
            why = f"final state digest {digest} != {ref_digest}"
    return Verdict(not why, why, digest, ref_digest, plans)


def _row(case: Case, faults: str, degree, v: Verdict) -> str:
    return (f"| {case.name} | `{faults.removeprefix('faults=')}` | {degree} | "
            f"{'yes' if v.bitwise else 'NO'} | {v.digest} | {v.reference_digest} | "
            f"{' -> '.join(p.split('m')[0] for p in v.plans)} | {v.first_difference} |")


HEADER = ("| config | failure set | data degree after (x stages) | bitwise | state digest | fault-free "
          "digest | plans | first difference |\n|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="cases to run (default: all)")
    ap.add_argument("--at", type=int, default=3,
                    help="the first failure's step in a per-degree run")
    ap.add_argument("--chain", action="store_true",
                    help="one run through every degree and a growth back, per case")
    ap.add_argument("--out", default=None, help="where the runs go (default: a temporary dir)")
    args = ap.parse_args(argv)
    chosen = [c for c in cases() if not args.names or c.name in args.names]
    if args.names and len(chosen) != len(args.names):
        known = ", ".join(c.name for c in cases())
        ap.error(f"unknown case in {args.names}; allowed values: {known}")
    out = Path(args.out or tempfile.mkdtemp(prefix="elasjax-bitwise-"))
    print(HEADER, flush=True)
    ok = True
    for case in chosen:
        if args.chain:
            faults, steps, after = chain_faults(case)
            runs = [(faults, " -> ".join(after), steps)]
        else:
            rows = [(*degree_faults(failed, args.at), d) for d, failed, _ in degrees(case)]
            steps = max((n for _, n, _ in rows), default=0)  # one fault-free run for the rows
            runs = [(faults, d, steps) for faults, _, d in rows]
        refs: dict[int, dict] = {}
        for i, (faults, degree, steps) in enumerate(runs):
            if steps not in refs:
                refs[steps] = fault_free(case, out / case.name / f"ref{steps}", steps)
            run = train(case, out / case.name / f"run{i}", f"train.steps={steps}", faults)
            v = compare(run, refs[steps])
            ok &= v.bitwise
            print(_row(case, faults, degree, v), flush=True)
    print(f"all bitwise: {'yes' if ok else 'NO'} (runs under {out})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
