"""Where a step's time goes: the plain JAX step and elasjax's, compiled side by side.

    python experiments/profile_step.py [--sizes demo,3m,25m] [--reps 5] [--user-donate no]
                                       [--deterministic] [--sliced] [--ops N] [--writes N]
                                       [--out results/profile]

For each size (`bench_scale.SIZES`, configs from `bench_scale.size_config`: batch 32 x 64
tokens, 2 micro-batches, dropout 0.1) on bench_scale's job, 8 fake CPU devices as data 4 x
tensor 2, it AOT-compiles on the same mesh:

  (a) plain JAX ZeRO-1      `user_loop.UserLoop._build`: the step a JAX/Flax user writes, ZeRO-1
                            by annotation (`--user-donate`: no, yes or both; no by default, as (b))
  (b) elasjax ZeRO-1        the trainer's step: `compile_plan(cfg, StateFactory(...), plan,
                            devices, donate=False)` with the initial plan, `Executables.train`
  (b) checksum program      `Executables.checksum`, compiled beside it: not run per step (the
                            step returns its state's checksums itself), only at the start and in
                            recoveries; listed for its compile time and size
  (b') per-device storage   `--sliced`: (b) with every ZeRO storage unit converted per device
                            (`shard_map`) and the gradient constrained whole, the step before
                            issue 46 (`ZeroCodec.annotate_exact` off)
  (c) elasjax deterministic `--deterministic`: (b) with `train.deterministic=true`

and reports per program: XLA's `cost_analysis()` (flops, bytes accessed, transcendentals; per
device, as XLA's cost model counts them) and `memory_analysis()` (per-device argument, output,
temporary bytes); op counts in the optimized HLO (`compiled.as_text()`): fusions, collectives
by kind (async `-start` ops counted as their kind), custom-calls, while loops, copies, and all
instructions (fused computations' bodies included; outside fusions in brackets), each counted
once per occurrence in the text (a loop body once, whatever its trip count); the same counts on
the HLO before optimization (`lowered.as_text(dialect="hlo")`: collectives there are the ones
written out, e.g. in a `shard_map`, the partitioner adds the rest; its custom-calls are
sharding annotations and shard_map boundaries, by target in the JSON); the seconds the
compile took (`Lowered.compile`, recorded by wrapping it while the programs build); and the
device time of a step: the compiled program run alone `--reps` times (median ms, after 2
warm-ups, `block_until_ready` each run) on one batch placed once, its state carried from run
to run (no data pipeline, no host work between steps).

`--ops N` also runs each program 3 times under `jax.profiler.trace` and adds up XLA:CPU's
per-operation spans by kind (`op_ms`): a second table lists the N kinds whose CPU time per step
differs most from (a)'s. It says which operations an extra cost is in (the fusions' names are
XLA's: a fusion is named after its root operations).

`--writes N` adds a table of the MB each program's device writes per step (`written_mb`: every
instruction's output in the optimized HLO outside fusion bodies, loops multiplied by their trip
counts), grouped by phase (forward, backward, the rest of the step) and primitive, the N groups
that differ most from (a)'s. It is the program's static account, not a timing: on fake CPU
devices a step of this size is bound by memory traffic, and the op spans of `--ops` are wall
times of 8 threads sharing the cores (a span includes the time its thread waited for a core), so
they move with what the other threads do; the written bytes do not.

Reading the table: what elasjax's step adds is (b) - (a), row by row. The host time elasjax's
loop spends per step outside its device program (batches, dispatch, checksum reads,
snapshots) is NOT measured here: it is bench_scale's per-step time of the whole run minus this
step time. The 8 fake devices share this machine's cores, so "device time" here is CPU time of
all 8 programs together, and it moves with whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scale  # noqa: E402  (sets 8 fake CPU devices before jax loads)
import user_loop  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from elasjax.compilation.executables import compile_plan  # noqa: E402
from elasjax.loop.data import DataPipeline  # noqa: E402
from elasjax.plan.planner import Topology, initial_plan  # noqa: E402
from elasjax.layout.state import StateFactory, make_optimizer  # noqa: E402
from elasjax.layout.storage import ZeroCodec  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


@contextlib.contextmanager
def compiles():
    """Record (lowered, compiled, seconds) of every `Lowered.compile` inside the block."""
    got, orig = [], jax.stages.Lowered.compile

    def compile(self, *a, **k):
        t0 = time.perf_counter()
        c = orig(self, *a, **k)
        got.append((self, c, time.perf_counter() - t0))
        return c

    jax.stages.Lowered.compile = compile
    try:
        yield got
    finally:
        jax.stages.Lowered.compile = orig


def op_counts(hlo: str) -> dict:
    ops = []  # (computation, opcode)
    comp, fused = None, set()
    for line in hlo.splitlines():
        head = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            comp = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\b([a-z][a-z0-9\-]*)\(", line)
        if m:
            ops.append((comp, m.group(1)))
            if m.group(1) == "fusion":
                fused.update(re.findall(r"calls=%?([\w.\-]+)", line))
    n = Counter(op for _, op in ops)
    out = {"fusion": n["fusion"]}
    out.update({k: n[k] + n[k + "-start"] for k in COLLECTIVES})
    out.update({"custom-call": n["custom-call"], "while": n["while"],
                "copy": n["copy"] + n["copy-start"], "instructions": len(ops),
                "outside fusions": sum(c not in fused for c, _ in ops),
                "custom-call targets": dict(Counter(re.findall(r'custom_call_target="([^"]+)"',
                                                               hlo)))})
    return out


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_NO_WRITE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "call",
             "conditional", "after-all", "partition-id", "replica-id"}


def _array_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) \
            * _DTYPE_BYTES[dtype]
    return total


# the parts of elasjax's step under a `jax.named_scope` of their own (`layout.step`,
# `core.treesum`): the tree sum's per-micro-batch additions and its cross-replica phase, the
# deterministic gradient norm, the ZeRO storage conversions, the optimizer, the state checksums
STEP_SCOPES = ("tree_step", "tree_finish", "grad_norm", "to_storage", "optimizer",
               "from_storage", "checksums")


def written_mb(hlo: str) -> dict:
    """MB one device's program writes per step, by where it comes from: each instruction's output
    in the optimized HLO outside fusion bodies (a fusion counts its own output, an in-place
    dynamic-update-slice only its update: its smallest array operand), a while loop's body
    multiplied by its `known_trip_count` (1 where XLA gives none), a conditional counted as its
    largest branch, `call`s followed. Keyed "phase/primitive": the phase one of elasjax's named
    scopes (`STEP_SCOPES`), else "forward" (under `jvp`), "backward" (under `transpose`) or
    "step", the primitive the last part of the instruction's `op_name` (a fusion's is its
    root's). Static accounting, not a measurement: what the program
    is written to store, not what the caches make of it."""
    comps: dict[str, list] = {}
    cur = None
    for line in re.sub(r"/\*.*?\*/", "", hlo).splitlines():
        head = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and " = " not in line.split("{")[0]:
            cur = head.group(1)
            comps[cur] = []
            if line.lstrip().startswith("ENTRY"):
                entry = cur
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$", line)
        if m and cur is not None:
            comps[cur].append(m.groups())

    memo: dict[str, Counter] = {}

    def total(comp: str) -> Counter:
        if comp in memo:
            return memo[comp]
        out, shapes = Counter(), {}
        for name, shape, op, rest in comps.get(comp, []):
            shapes[name] = shape
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                trip = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
                for k, v in total(body).items():
                    out[k] += v * (int(trip.group(1)) if trip else 1)
            elif op == "call":
                out.update(total(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1)))
            elif op == "conditional":
                names = re.findall(r"%?([\w.\-]+)", re.search(
                    r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)", rest
                ).group(0).split("=", 1)[1])
                out.update(max((total(b) for b in names), key=lambda c: sum(c.values())))
            elif op not in _NO_WRITE:
                size = _array_bytes(shape)
                if "dynamic-update-slice" in name or op == "dynamic-update-slice":
                    args = [_array_bytes(shapes.get(a, "")) for a in
                            re.findall(r"%([\w.\-]+)", rest.split(")")[0])]
                    size = min([a for a in args if a > 8] or [size])
                where = re.search(r'op_name="([^"]*)"', rest)
                path = where.group(1) if where else op
                scope = next((n for n in STEP_SCOPES if f"/{n}/" in path), None)
                phase = (scope if scope else "backward" if "transpose(" in path else
                         "forward" if "jvp(" in path else "step")
                prim = re.sub(r"\.\d+$", "", path.rsplit("/", 1)[-1]) or op
                out[f"{phase}/{prim}"] += size / 2**20
        memo[comp] = out
        return out

    return dict(total(entry))


def describe(lowered, compiled, seconds: float) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per HLO module
        cost = {k: sum(d.get(k, 0) for d in cost) for d in cost for k in d}
    cost = cost or {}
    mem = compiled.memory_analysis()
    try:
        pre = op_counts(lowered.as_text(dialect="hlo"))
    except Exception as e:  # noqa: BLE001
        pre = {"skipped": f"{type(e).__name__}: {e}"}
    return {
        "compile_s": seconds,
        "cost": {k: cost[k] for k in ("flops", "bytes accessed", "transcendentals") if k in cost},
        "memory_mb": {} if mem is None else {
            k: getattr(mem, f"{k}_size_in_bytes") / 2**20
            for k in ("argument", "output", "temp", "alias")},
        "ops": op_counts(compiled.as_text()),
        "written_mb": written_mb(compiled.as_text()),
        "ops_pre": pre,
    }


def step_ms(fn, state, batch, reps: int) -> float:
    """Median ms of `fn(state, batch)` run alone, after 2 warm-ups; the state carried along."""
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        state = jax.block_until_ready(fn(state, batch))[0]
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


# events of a profiler trace that are not an operation's own work: the executor's spans around
# the ops, waits for other threads, and Python
_NOT_OPS = re.compile(r"^(ThunkExecutor|Wait|Rendezvous|InvokeRendezvous|end: |\$|PjitFunction|"
                      r"CommonPjRt|TfrtCpu|PjRt)")


def op_ms(fn, state, batch, runs: int = 3) -> dict:
    """CPU ms per step of each kind of operation, summed over the 8 device threads: `fn` run
    `runs` times under `jax.profiler.trace`, XLA:CPU's per-operation spans added up by name
    with the numeric suffix dropped (`multiply_add_fusion.12` -> `multiply_add_fusion`).
    A collective's span includes its wait for the other devices (`while`: its body's ops are
    listed on their own too)."""
    for _ in range(2):
        state = jax.block_until_ready(fn(state, batch))[0]
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(runs):
                state = jax.block_until_ready(fn(state, batch))[0]
        (path,) = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out: Counter = Counter()
    for e in events:
        if e.get("ph") == "X" and not _NOT_OPS.match(e["name"]):
            out[re.sub(r"[.\d]+$", "", e["name"])] += e.get("dur", 0) / 1e3 / runs
    return dict(out)


def diff_table(result: dict, field: str, title: str, total: str, top: int) -> str:
    """The `top` kinds of a per-program breakdown (`field`: "op_ms" or "written_mb") that differ
    most between the plain step (a) and any elasjax program, a column per program (the checksum
    program left out), and each program's total."""
    rows = {k: r[field] for k, r in result["rows"].items()
            if field in r and "checksum" not in k}
    base_name = next((k for k in rows if k.startswith("(a)")), None)
    if base_name is None or len(rows) < 2:
        return ""
    base = rows[base_name]
    others = [k for k in rows if k != base_name]
    kinds = set(base).union(*(rows[k] for k in others))
    spread = {k: max(abs(rows[o].get(k, 0) - base.get(k, 0)) for o in others) for k in kinds}
    head = [title, base_name] + others
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for k in sorted(kinds, key=lambda k: -spread[k])[:top]:
        lines.append(f"| {k} | {base.get(k, 0):.1f} | "
                     + " | ".join(f"{rows[o].get(k, 0):.1f}" for o in others) + " |")
    lines.append(f"| {total} | " + " | ".join(f"{sum(rows[n].values()):.1f}"
                                               for n in [base_name] + others) + " |")
    return "\n".join(lines)


def profile(size: str, reps: int, donates: list[bool], deterministic: bool,
            sliced: bool = False, ops: bool = False) -> dict:
    rows, meshes = {}, []
    for donate in donates:
        cfg = bench_scale.size_config(size, 100, ["zero.stage=1"])
        with compiles() as got:
            r = user_loop.UserLoop._build(cfg, 1, donate, None)
        meshes.append(r["batch_sh"].mesh)
        name = f"(a) plain JAX ZeRO-1{'' if donate else ' undonated'}"
        rows[name] = describe(*got[-1])
        batch = jax.device_put(user_loop.make_batch(cfg, 0), r["batch_sh"])
        rows[name]["step_ms"] = step_ms(r["train"], r["init"](), batch, reps)
        if ops:
            rows[name]["op_ms"] = op_ms(r["train"], r["init"](), batch)

    for label, extra in [("(b) elasjax ZeRO-1", [])] + (
            [("(b') elasjax ZeRO-1, storage per device", ["sliced"])] if sliced else []) + (
            [("(c) elasjax deterministic ZeRO-1", ["train.deterministic=true"])]
            if deterministic else []):
        ZeroCodec.annotate_exact = "sliced" not in extra
        extra = [x for x in extra if x != "sliced"]
        cfg = bench_scale.size_config(size, 100, ["zero.stage=1", *extra])
        plan = initial_plan(Topology(tuple(range(8)), 2), cfg)
        devices = {d.id: d for d in jax.devices()}
        try:
            with compiles() as got:
                exe = compile_plan(cfg, StateFactory(cfg, make_optimizer(cfg)), plan, devices,
                                   donate=False)
        finally:
            ZeroCodec.annotate_exact = True
        (tl, tc, ts), (cl, cc, cs) = got  # train, then checksum
        assert tc is exe.train and cc is exe.checksum
        meshes.append(exe.mesh)
        rows[label] = describe(tl, tc, ts)
        data = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
        batch = exe.put_batch(data.batch(0, plan).arrays())
        state = exe.init()
        rows[label]["step_ms"] = step_ms(exe.train, state, batch, reps)
        if ops:
            rows[label]["op_ms"] = op_ms(exe.train, state, batch)
        if label.startswith("(b) "):
            rows[label + " checksum"] = describe(cl, cc, cs)
            rows[label + " checksum"]["step_ms"] = step_ms(
                lambda s, _: (s, exe.checksum(s)), state, None, reps)
        n_params = sum(x.size for x in jax.tree.leaves(exe.layout.abstract.params))
    # the same mesh: the same devices in the same (data, tensor) places
    assert len({(m.shape["data"], m.shape["tensor"], tuple(m.device_ids.flat))
                for m in meshes}) == 1, meshes
    return {"size": size, "n_params": n_params, "reps": reps, "rows": rows,
            "mesh": meshes[0].device_ids.tolist()}


def table(result: dict) -> str:
    def cost(key: str, scale: float, digits: int):
        return lambda r: f"{r['cost'][key] / scale:.{digits}f}" if key in r["cost"] else "-"

    cols = [("step ms", lambda r: f"{r['step_ms']:.2f}"),
            ("compile s", lambda r: f"{r['compile_s']:.2f}"),
            ("GFLOP", cost("flops", 1e9, 3)), ("GB accessed", cost("bytes accessed", 1e9, 3)),
            ("transc. M", cost("transcendentals", 1e6, 2)),
            ("arg/out/temp MB", lambda r: "/".join(
                f"{r['memory_mb'].get(k, float('nan')):.1f}" for k in ("argument", "output", "temp")))]
    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
             "collective-permute": "CP", "all-to-all": "A2A"}

    def ops(o: dict) -> str:
        if "skipped" in o:
            return "skipped"
        coll = " ".join(f"{short[k]} {o[k]}" for k in COLLECTIVES if o[k])
        return (f"fus {o['fusion']}, {coll or 'no collectives'}, cc {o['custom-call']}, "
                f"while {o['while']}, copy {o['copy']}, "
                f"instr {o['instructions']} ({o['outside fusions']})")

    head = ["program"] + [c for c, _ in cols] + ["optimized HLO", "HLO before optimization"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, r in result["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f(r) for _, f in cols)
                     + f" | {ops(r['ops'])} | {ops(r['ops_pre'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="demo,3m,25m", help=f"of {', '.join(bench_scale.SIZES)}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--user-donate", choices=("no", "yes", "both"), default="no")
    ap.add_argument("--deterministic", action="store_true", help="also (c)")
    ap.add_argument("--sliced", action="store_true",
                    help="also (b'): (b) with every ZeRO storage unit converted per device, the "
                         "step before issue 46 (`ZeroCodec.annotate_exact` off)")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="also trace each program and list the N op kinds whose CPU time per "
                         "step differs most from (a)'s (`op_ms`)")
    ap.add_argument("--writes", type=int, default=0, metavar="N",
                    help="also list the N phase/primitive groups whose MB written per step "
                         "(static, from the optimized HLO: `written_mb`) differ most from (a)'s")
    ap.add_argument("--out", help="a folder for profile.md and a JSON per size")
    args = ap.parse_args(argv)
    donates = {"no": [False], "yes": [True], "both": [True, False]}[args.user_donate]
    text = [f"profile_step: 8 fake CPU devices (data 4 x tensor 2) on {os.cpu_count()} cores, "
            f"jax {jax.__version__}, median of {args.reps} step runs; AR all-reduce, AG "
            f"all-gather, RS reduce-scatter, CP collective-permute, A2A all-to-all, cc "
            f"custom-call (before optimization: Shardy's sharding annotations and shard_map "
            f"boundaries; the JSON has the targets), "
            f"instr: all instructions (outside fusions); (b) - (a) is what elasjax's step adds"]
    for size in args.sizes.split(","):
        r = profile(size, args.reps, donates, args.deterministic, args.sliced, bool(args.ops))
        text += ["", f"## {size} ({r['n_params'] / 1e6:.2f}M parameters)", "", table(r)]
        if args.ops:
            text += ["", diff_table(r, "op_ms", "op kind (CPU ms per step, 8 devices)", "all ops",
                                    args.ops)]
        if args.writes:
            text += ["", diff_table(r, "written_mb", "MB written per device per step (static)",
                                    "all", args.writes)]
        print("\n".join(text[-6:]), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{size}.json"), "w") as f:
                json.dump(r, f, indent=1)
    if args.out:
        with open(os.path.join(args.out, "profile.md"), "w") as f:
            f.write("\n".join(text) + "\n")
    print("\n" + text[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
