"""The fault-free cost of elasticity at a ladder of model sizes, against plain JAX.

    python experiments/bench_scale.py [--sizes demo,3m,25m,100m] [--steps S1,S2] [--rounds 3]
                                      [--modes all] [--rss] [--failures] [--out results/scale]

For each GPT size of the ladder (the demo's 137k parameters, ~3M, ~25M, ~100M; `--sizes` also
takes `dD:LL` for d_model D and LL layers), on 8 fake CPU devices as data 4 x tensor 2 (hosts of
2 devices), with the same global batch (32 sequences of 64 tokens, 2 micro-batches) and
optimizer (AdamW after global-norm clipping), in one process; the data is elasjax's data pipeline
but for the plain JAX loops (random tokens from numpy):

  plain JAX replicated  `user_loop.py`: the loop a JAX/Flax user writes. Of elasjax only the
                        model (`elasjax.models.gpt`) and the config's sizes; its own mesh,
                        logical-axis rules, optax AdamW, loss (`GPT.apply`, cross-entropy, mean
                        over the step's tokens), micro-batch `lax.scan`, dropout keys and numpy
                        batches; the state laid out by annotation (ZeRO-0)
  plain JAX ZeRO-1      the same, the optimizer state also sharded over `data` by annotation (on
                        the first dimension `data` divides): XLA's ZeRO-1, what plain JAX gives
  plain JAX ZeRO-3      the parameters sharded over `data` too
  elasjax grad + plain loop replicated / ZeRO-1 / ZeRO-3
                        the same annotations and optimizer update in a plain jitted loop, around
                        elasjax's gradient function (`step.make_grad_fn`: per-sample weights and
                        normaliser counts, host-made key ids, sharding constraints on each
                        micro-batch and on the accumulator), state factory, data pipeline and
                        batch shardings: no checksums, no ZeRO storage layout, no snapshots.
                        Against `plain JAX` it isolates the gradient function's cost from the
                        loop's (before issue 46 these rows were named `plain replicated`, `plain
                        ZeRO-1`, `plain ZeRO-3`; `--modes` still takes those names)
  plain JAX ZeRO-1 undonated + ElasticState
                        that loop handing each step's state to `ElasticState.commit` (elasjax's
                        pieces, `docs/api.md`: the state's checksums and snapshots of its unique
                        shards, hosts of 2 devices): what the pieces cost a user's own loop
  ... undonated         either plain loop without donating its state (on XLA:CPU donation can
                        make the step slower; elasjax's loop there does not donate when
                        snapshots run beside the step): a ratio's plain reference is the faster
                        of the two
  elasjax ZeRO-k ...    `trainer.Trainer` (the whole loop: batches, step, checksums read two steps
                        late, snapshots as configured), no faults, no evaluation
  elasjax deterministic ZeRO-1 without remat
                        the same with `model.remat=none`: the GPT's layer loop keeping every
                        intermediate for the backward, as before `model.remat` (whose `auto` is
                        `dots`): the "before", beside the default
  elasjax ZeRO-1 sliced storage
                        the same with every ZeRO storage unit converted per device
                        (`ZeroCodec.annotate_exact` off): elasjax's step as it was before issue
                        46, measured beside the default as the "before"

The headline ratios are elasjax's loops against the `plain JAX` loops; beside them the same
loops against the `elasjax grad + plain loop` ones, and those against `plain JAX`.

In every round each loop runs twice, a whole run of S1 and of S2 steps (`--steps S1,S2`; a run
builds its state and, for elasjax, takes its snapshots and plans its likely transitions before
step 0, as a job would); a step costs (wall(S2) - wall(S1)) / (S2 - S1), so start-up and the
last reads cancel. Rounds alternate the loops. The table gives the median over rounds and the
median of the per-round ratios (each round runs the loops back to back, so a ratio compares
loops under the same machine state). XLA's `memory_analysis()`
of each step executable gives its per-device bytes (arguments, outputs, temporaries).

`--rss` runs each loop again alone in a child process and reports its peak resident set size.
`--failures` trains elasjax ZeRO-1 through a device failure and a host failure, and reports the
recovery phases, the time lost per failure and the goodput (`metrics.failure_costs`), the bytes
moved against a memcpy of as many bytes on this machine, and the standby build with
`--standby`.

`--check` runs `user_loop`'s step and elasjax's (`compile_plan`) on the same parameters and the
same batches at the demo size and compares the losses, parameters and optimizer states
(`--check-cases`: ZeRO stage:dropout pairs).

`--one-device` runs every loop on the default backend's first device alone (a GPU where one is
at hand; data 1 x tensor 1, so ZeRO stages shard nothing), `--seq-len` and `--global-batch` size
the batch.

8 fake devices share this machine's cores: the figures compare loops on one machine in one run,
not devices. Results go to `--out` (a JSON per size, `scale.md`, and a plot of the ratios).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # user_loop

import jax  # noqa: E402
jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from elasjax import config
from elasjax.loop import trainer  # noqa: E402
from elasjax.compilation.executables import ExecutableCache, compile_plan  # noqa: E402
from elasjax.loop.data import DataPipeline  # noqa: E402
from elasjax.core.mesh import DATA, make_mesh, replicated  # noqa: E402
from elasjax.plan.planner import Topology, initial_plan  # noqa: E402
from elasjax.core.sharding import batch_shardings  # noqa: E402
from elasjax.layout.state import StateFactory, TrainState, make_optimizer  # noqa: E402
from elasjax.layout.step import abstract_batch, make_grad_fn  # noqa: E402
from elasjax.layout.storage import ZeroCodec  # noqa: E402
from user_loop import UserLoop, memory_mb, timed_run  # noqa: E402

SIZES = {  # name -> (d_model, layers, heads)
    "demo": (64, 2, 4),
    "3m": (256, 4, 8),
    "25m": (512, 8, 8),
    "100m": (1024, 8, 16),
    "350m": (1024, 24, 16),
}
# the job's shape: 8 fake CPU devices as data 4 x tensor 2 (hosts of 2), or with `--one-device`
# the default backend's first device alone (a GPU where one is at hand); `--seq-len` and
# `--global-batch` size the batch (an accelerator needs more work per step than the CPU default)
JOB = {"devices": 8, "per_host": 2, "data": 4, "tensor": 2, "seq_len": 64, "batch": 32}
# the run lengths S1, S2 per size: S2 - S1 steps take about 20-40 s here, so that the start-up's
# spread (a few hundred ms) is small against them
LENGTHS = {"demo": (5, 205), "3m": (2, 52), "25m": (2, 10), "100m": (2, 5)}

# loop -> (kind, arguments): "user" and "plain" take (ZeRO stage, donate), "elasjax" config
# overrides
MODES = {
    "plain JAX replicated": ("user", (0, True)),
    "plain JAX ZeRO-1": ("user", (1, True)),
    "plain JAX ZeRO-3": ("user", (3, True)),
    "plain JAX replicated undonated": ("user", (0, False)),
    "plain JAX ZeRO-1 undonated": ("user", (1, False)),
    "plain JAX ZeRO-3 undonated": ("user", (3, False)),
    # the same loop handing each step to `ElasticState.commit` (elasjax's pieces, docs/api.md)
    "plain JAX ZeRO-1 undonated + ElasticState": ("user", (1, False, True)),
    "elasjax grad + plain loop replicated": ("plain", (0, True)),
    "elasjax grad + plain loop ZeRO-1": ("plain", (1, True)),
    "elasjax grad + plain loop ZeRO-3": ("plain", (3, True)),
    "elasjax grad + plain loop replicated undonated": ("plain", (0, False)),
    "elasjax grad + plain loop ZeRO-1 undonated": ("plain", (1, False)),
    "elasjax grad + plain loop ZeRO-3 undonated": ("plain", (3, False)),
    "elasjax ZeRO-0": ("elasjax", ["zero.stage=0"]),
    "elasjax ZeRO-1 no snapshots": ("elasjax", ["zero.stage=1", "snapshot.buddy=false",
                                                   "snapshot.host=false"]),
    "elasjax ZeRO-1": ("elasjax", ["zero.stage=1"]),
    "elasjax ZeRO-1 sliced storage": ("elasjax sliced", ["zero.stage=1"]),
    "elasjax ZeRO-2": ("elasjax", ["zero.stage=2"]),
    "elasjax ZeRO-3": ("elasjax", ["zero.stage=3"]),
    "elasjax deterministic": ("elasjax", ["zero.stage=0", "train.deterministic=true"]),
    "elasjax deterministic ZeRO-1": ("elasjax", ["zero.stage=1", "train.deterministic=true"]),
    "elasjax deterministic ZeRO-1 no snapshots": (
        "elasjax", ["zero.stage=1", "train.deterministic=true", "snapshot.buddy=false",
                    "snapshot.host=false"]),
    "elasjax deterministic ZeRO-1 without remat": (
        "elasjax", ["zero.stage=1", "train.deterministic=true", "model.remat=none"]),
}
# the names the `elasjax grad + plain loop` rows had before issue 46 (RESULTS.md's commands)
OLD_NAMES = {
    f"plain {z}{u}": f"elasjax grad + plain loop {z}{u}"
    for z in ("replicated", "ZeRO-1", "ZeRO-3") for u in ("", " undonated")
}
# the ratios the table reports: (loop, its reference). A plain reference is the faster of the
# plain loop that donates its state (`donate_argnums`, what a JAX user writes) and the same loop
# without donation, per round, where both ran: on XLA:CPU donation can make the step slower (its
# in-place updates add copies), and elasjax's default loop on the CPU backend does not donate
# (`SnapshotPool.fusion_helps`). The headline: elasjax's loops against the plain JAX loops;
# then the same against elasjax's gradient function in a plain loop, and that against plain JAX
# (the gradient function's own cost).
RATIOS = [
    ("elasjax ZeRO-0", "plain JAX replicated"),
    ("elasjax ZeRO-1 no snapshots", "plain JAX ZeRO-1"),
    ("elasjax ZeRO-1", "plain JAX ZeRO-1"),
    # the default mode (`train.deterministic: auto` is on wherever the config allows it)
    ("elasjax deterministic ZeRO-1", "plain JAX ZeRO-1"),
    ("elasjax ZeRO-2", "plain JAX ZeRO-1"),
    ("elasjax ZeRO-3", "plain JAX ZeRO-3"),
    ("elasjax ZeRO-0", "elasjax grad + plain loop replicated"),
    ("elasjax ZeRO-1 no snapshots", "elasjax grad + plain loop ZeRO-1"),
    ("elasjax ZeRO-1", "elasjax grad + plain loop ZeRO-1"),
    ("elasjax deterministic ZeRO-1", "elasjax grad + plain loop ZeRO-1"),
    ("elasjax ZeRO-2", "elasjax grad + plain loop ZeRO-1"),
    ("elasjax ZeRO-3", "elasjax grad + plain loop ZeRO-3"),
    ("elasjax grad + plain loop replicated", "plain JAX replicated"),
    ("elasjax grad + plain loop ZeRO-1", "plain JAX ZeRO-1"),
    ("elasjax grad + plain loop ZeRO-3", "plain JAX ZeRO-3"),
    ("elasjax ZeRO-1", "elasjax ZeRO-1 no snapshots"),
    ("elasjax ZeRO-1 sliced storage", "plain JAX ZeRO-1"),
    ("elasjax ZeRO-1", "elasjax ZeRO-1 sliced storage"),
    ("elasjax deterministic", "elasjax ZeRO-0"),
    ("elasjax deterministic ZeRO-1", "elasjax ZeRO-1"),
    ("elasjax deterministic ZeRO-1 without remat", "plain JAX ZeRO-1"),
    ("elasjax deterministic ZeRO-1", "elasjax deterministic ZeRO-1 without remat"),
    ("elasjax deterministic ZeRO-1 no snapshots", "plain JAX ZeRO-1"),
    ("elasjax deterministic ZeRO-1", "elasjax deterministic ZeRO-1 no snapshots"),
    # what the pieces cost a user's own loop
    ("plain JAX ZeRO-1 undonated + ElasticState", "plain JAX ZeRO-1 undonated"),
]


def mode_names(text: str) -> list[str]:
    """`--modes`, `--rss-modes`: comma-separated loop names (the old names of the `elasjax grad
    + plain loop` rows too), or 'all'; an unknown name is an error naming the allowed ones."""
    if text == "all":
        return list(MODES)
    names = [OLD_NAMES.get(m, m) for m in text.split(",")]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        raise ValueError(f"unknown {unknown}; allowed: {', '.join(MODES)}")
    return names


def size_config(size: str, steps: int, extra=()) -> config.Config:
    if size in SIZES:
        d, layers, heads = SIZES[size]
    else:  # dD:LL
        d, layers = (int(x) for x in size.lstrip("d").split(":"))
        heads = max(4, d // 64)
    return config.load(None, [
        f"model.d_model={d}", f"model.n_layers={layers}", f"model.n_heads={heads}",
        f"model.d_mlp={4 * d}", f"model.seq_len={JOB['seq_len']}", "model.dropout=0.1",
        "data.source=synthetic", "train.deterministic=false", "data.synthetic_samples=4096",
        f"train.steps={steps}", f"train.global_batch={JOB['batch']}", "train.microbatches=2",
        "train.eval_every=0", f"parallel.devices={JOB['devices']}",
        f"parallel.devices_per_host={JOB['per_host']}", f"parallel.data={JOB['data']}",
        f"parallel.tensor={JOB['tensor']}", "faults=[]", "standby.wait_at_start=true",
        # the fault-free step without the standby's background compiles (`standby.enabled:
        # auto` is on in one process; what it costs a run is measured on its own:
        # experiments/RESULTS.md, "The standby on by default"); `--standby` turns it on
        "standby.enabled=false", *extra,
    ])


def _with_data(sh: NamedSharding, shape) -> NamedSharding:
    """`sh` with `data` added on the first dimension it divides (what a user annotating ZeRO
    writes); unchanged where none does."""
    n = sh.mesh.shape[DATA]
    spec = list(sh.spec) + [None] * (len(shape) - len(sh.spec))
    for i, (a, s) in enumerate(zip(spec, shape)):
        if a is None and s % n == 0 and s >= n:
            spec[i] = DATA
            return NamedSharding(sh.mesh, PartitionSpec(*spec))
    return sh


class Plain:
    """elasjax's gradient function (`make_grad_fn`), state factory and data in a plain jitted
    loop; ZeRO by annotation (the `elasjax grad + plain loop` rows). One program per run length
    (the learning-rate schedule depends on it)."""

    def __init__(self, size: str, zero: int, lengths: tuple[int, ...], donate: bool = True):
        self.runs = {n: self._build(size_config(size, n), zero, donate) for n in lengths}

    @staticmethod
    def _build(cfg: config.Config, zero: int, donate: bool) -> dict:
        topo = Topology(tuple(range(cfg.parallel.devices)), cfg.parallel.devices_per_host)
        plan = initial_plan(topo, cfg)
        f = StateFactory(cfg, make_optimizer(cfg))
        devs = {d.id: d for d in jax.devices()}
        mesh = make_mesh(plan.mesh_shape, [devs[i] for i in plan.device_ids])
        ab = abstract_batch(plan, f.model)
        bsh = batch_shardings(mesh, ab)
        sh = f.shardings(mesh)
        if zero >= 1:
            opt = jax.tree.map(lambda s, a: _with_data(s, a.shape) if a.ndim else s,
                               sh.opt_state, f.abstract.opt_state)
            params = sh.params if zero < 3 else jax.tree.map(
                lambda s, a: _with_data(s, a.shape), sh.params, f.abstract.params)
            sh = TrainState(sh.step, params, opt)
        grad_fn = make_grad_fn(cfg, f.model, mesh, sh, None)
        tx = f.tx

        def step(state, batch):
            loss, grads = grad_fn(state.params, batch, state.step)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            return TrainState(state.step + 1, optax.apply_updates(state.params, updates),
                              opt_state), {"loss": loss}

        t0 = time.perf_counter()
        train = jax.jit(
            step, in_shardings=(sh, bsh), out_shardings=(sh, {"loss": replicated(mesh)}),
            donate_argnums=0 if donate else (),
        ).lower(f.abstract, ab).compile()
        return {"plan": plan, "train": train, "compile_s": time.perf_counter() - t0,
                "init": jax.jit(f._init, out_shardings=sh), "bsh": bsh,
                "data": DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)}

    def wall(self, steps: int) -> float:
        """Seconds for a whole run of `steps` steps (`user_loop.timed_run`)."""
        r = self.runs[steps]

        def train(state, batch):
            state, met = r["train"](state, batch)
            return state, met["loss"]

        def batch_at(s):
            return {k: jax.device_put(v, r["bsh"][k])
                    for k, v in r["data"].batch(s, r["plan"]).arrays().items()}

        return timed_run(r["init"], train, batch_at, steps)

    @property
    def compile_s(self) -> float:
        return max(r["compile_s"] for r in self.runs.values())

    def memory(self) -> dict:
        return memory_mb(next(iter(self.runs.values()))["train"])


class Elastic:
    """`trainer.Trainer` on the size's config with `overrides`; executables shared by rounds
    (each run length compiles once, in a warm-up run)."""

    def __init__(self, size: str, overrides, lengths: tuple[int, ...], cache: ExecutableCache,
                 sliced: bool = False):
        self.cfgs = {n: size_config(size, n, overrides) for n in lengths}
        # `sliced`: ZeRO storage converted per device for every unit, as before issue 46
        # (`ZeroCodec.annotate_exact`); its executables are its own
        self.sliced = sliced
        self.cache = ExecutableCache(max_entries=16) if sliced else cache
        self.snapshot_bytes = 0
        for n in lengths:
            self.wall(n)  # compiles

    def wall(self, steps: int) -> float:
        t0 = time.perf_counter()
        ZeroCodec.annotate_exact = not self.sliced
        try:
            t = trainer.Trainer(self.cfgs[steps], None, exe_cache=self.cache)
            t.run()
        finally:
            ZeroCodec.annotate_exact = True
        wall = time.perf_counter() - t0
        self.snapshot_bytes = t.pool.bytes_per_step
        self.exe, _ = t.exe_cache.get(t.cfg, t.factory, t.initial, t.devices, donate=t.donate)
        return wall

    @property
    def compile_s(self) -> float:
        return self.exe.compile_s

    def memory(self) -> dict:
        return memory_mb(self.exe.train)


def build(mode: str, size: str, lengths: tuple[int, ...], cache: ExecutableCache):
    kind, arg = MODES[mode]
    if kind == "user":
        return UserLoop({n: size_config(size, n) for n in lengths}, *arg[:2],
                        elastic=len(arg) > 2 and arg[2])
    if kind == "plain":
        return Plain(size, arg[0], lengths, arg[1])
    return Elastic(size, arg, lengths, cache, sliced=kind == "elasjax sliced")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(mode: str, size: str, steps: int) -> None:
    """One loop alone (`--rss`): prints its peak resident set size while it runs `steps` steps,
    after its build (the process's high-water mark, VmHWM, is reset once the loop is built and
    compiled: the compiler's own peak is not the loop's), and the resident size before the run.
    Every loop has made one whole run before (an elasjax loop compiles in one)."""
    loop = build(mode, size, (steps,), ExecutableCache())
    if isinstance(loop, (Plain, UserLoop)):
        loop.wall(steps)  # as an elasjax loop's build does: one whole run first
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
    before = _status_mb("VmRSS")
    loop.wall(steps)
    print(json.dumps({"rss_mb": _status_mb("VmHWM"), "before_mb": before}))


def measure_size(size: str, modes: list[str], short: int, long: int, rounds: int) -> dict:
    """Per loop and round, a run of `short` and of `long` steps: a step costs the difference of
    their wall times over `long - short` (start-up, compiles and the last reads cancel)."""
    cache = ExecutableCache(max_entries=64)
    loops = {}
    for m in modes:
        t0 = time.perf_counter()
        loops[m] = build(m, size, (short, long), cache)
        print(f"  built {m} in {time.perf_counter() - t0:.1f}s", flush=True)
    f = StateFactory(size_config(size, short), make_optimizer(size_config(size, short)))
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes:
            a = loops[m].wall(short)
            b = loops[m].wall(long)
            times[m].append((b - a) / (long - short))
        print(f"  round {r}: " + ", ".join(f"{m} {times[m][-1] * 1e3:.0f} ms" for m in modes),
              flush=True)
    out = {"size": size, "n_params": f.n_params, "steps": [short, long], "rounds": rounds,
           "load": os.getloadavg()[0], "loops": {}, "ratios": {}}
    for m in modes:
        out["loops"][m] = {"ms": [t * 1e3 for t in times[m]],
                           "median_ms": statistics.median(times[m]) * 1e3,
                           "memory": loops[m].memory(),
                           "compile_s": loops[m].compile_s}
        if isinstance(loops[m], Elastic):
            out["loops"][m]["snapshot_mb_per_step"] = loops[m].snapshot_bytes / 2**20
    for a, b in RATIOS:
        refs = [m for m in (b, b + " undonated") if m in times]
        if a in times and refs:
            per_round = sorted(x / min(ys) for x, *ys in zip(times[a], *(times[m] for m in refs)))
            b = b if len(refs) == 1 else f"{b} (faster of donated, undonated)"
            out["ratios"][f"{a} / {b}"] = {
                "median": statistics.median(per_round), "min": per_round[0], "max": per_round[-1]}
    return out


def rss_rows(size: str, modes: list[str], steps: int) -> dict:
    out = {}
    for m in modes:
        got = subprocess.run(
            [sys.executable, __file__, "--child", m, "--sizes", size, "--steps", str(steps),
             "--seq-len", str(JOB["seq_len"]), "--global-batch", str(JOB["batch"]),
             *(["--one-device"] if JOB["devices"] == 1 else [])],
            capture_output=True, text=True, check=True,
        )
        got = json.loads(got.stdout.strip().splitlines()[-1])
        out[m] = got["rss_mb"]
        print(f"  peak RSS {m}: {out[m]:.0f} MB (resident {got['before_mb']:.0f} MB before the "
              f"run)", flush=True)
    return out


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def failures(size: str, steps: int, standby: bool) -> dict:
    """elasjax ZeRO-1 through a device failure (step steps//3) and a host failure
    (2 * steps // 3): recovery phases, time lost per failure, goodput, bytes moved."""
    from elasjax.observe.metrics import read_jsonl

    faults = (f"faults=[{{at_step: {steps // 3}, devices: [3]}}, "
              f"{{at_step: {2 * steps // 3}, hosts: [0]}}]")
    extra = ["zero.stage=1", faults] + (["standby.enabled=true"] if standby else [])
    cfg = size_config(size, steps, extra)
    with tempfile.TemporaryDirectory() as out:
        summary = trainer.run(cfg, out)
        events = read_jsonl(os.path.join(out, "events.jsonl"))
    bw = memcpy_gbps()
    rows = []
    for r in summary.recoveries:
        rows.append({
            "step": r.step, "failed": r.failed_devices, "to_plan": r.to_plan,
            "mttr_s": r.mttr_s, "phases": {k: getattr(r, k) for k in (
                "detect_s", "plan_s", "compile_s", "transfer_s", "verify_s", "snapshot_s",
                "first_step_s")},
            "standby_hit": r.standby_hit, "bytes_moved": r.bytes_moved,
            "memcpy_floor_s": r.bytes_moved / (bw * 1e9),
        })
    end = next(e for e in events if e["type"] == "end")
    costs = [e for e in events if e["type"] == "failure_cost"]
    standby_ev = [e for e in events if e["type"] == "standby_ready"]
    return {"recoveries": rows, "memcpy_gbps": bw, "failure_costs": costs,
            "goodput": end.get("goodput"), "standby": standby_ev}


def table(results: list[dict]) -> str:
    lines = ["| loop | " + " | ".join(f"{r['size']} ({r['n_params'] / 1e6:.2f}M)" for r in results)
             + " |", "|---" * (len(results) + 1) + "|"]
    modes = list(dict.fromkeys(m for r in results for m in r["loops"]))
    for m in modes:
        cells = []
        for r in results:
            lp = r["loops"].get(m)
            cells.append("" if lp is None else f"{lp['median_ms']:.0f} ms")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("| **ratios** (median of per-round ratios, min..max) |" + " |" * len(results))
    for key in dict.fromkeys(k for r in results for k in r["ratios"]):
        cells = []
        for r in results:
            x = r["ratios"].get(key)
            cells.append("" if x is None else
                         f"**{x['median']:.3f}** ({x['min']:.3f}..{x['max']:.3f})")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| **per-device step memory, MB** (XLA: arguments + outputs - aliased + temporaries) |"
                 + " |" * len(results))
    for m in modes:
        cells = []
        for r in results:
            mem = r["loops"].get(m, {}).get("memory") or {}
            cells.append("" if not mem else
                         f"{mem['args_mb'] + mem['out_mb'] - mem['alias_mb'] + mem['temp_mb']:.0f}"
                         f" (temp {mem['temp_mb']:.0f})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if any("rss" in r for r in results):
        lines.append("| **peak RSS while it runs, MB** (the loop alone in a process, after its build) |" + " |" * len(results))
        for m in dict.fromkeys(m for r in results for m in r.get("rss", {})):
            lines.append(f"| {m} | " + " | ".join(
                f"{r['rss'][m]:.0f}" if m in r.get("rss", {}) else "" for r in results) + " |")
    snap = [r["loops"].get("elasjax ZeRO-1", {}).get("snapshot_mb_per_step") for r in results]
    if any(s is not None for s in snap):
        lines.append("| snapshot MB per step (elasjax ZeRO-1) | " + " | ".join(
            "" if s is None else f"{s:.1f}" for s in snap) + " |")
    for r in results:
        if "failures" in r:
            lines += ["", failures_text(r["size"], r["failures"])]
    return "\n".join(lines)


def failures_text(size: str, f: dict) -> str:
    lines = [f"{size}, elasjax ZeRO-1 through a device and a host failure (detection simulated: "
             f"the fault is injected; memcpy on this machine {f['memcpy_gbps']:.1f} GB/s):",
             "| step | failed | plan | MTTR s | phases s | first step x pace | time lost s | "
             "bytes moved | memcpy floor s |", "|---|---|---|---|---|---|---|---|---|"]
    for r, c in zip(f["recoveries"], f["failure_costs"]):
        ph = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in r["phases"].items() if v >= 0.005)
        x = c.get("first_step_x")
        lines.append(
            f"| {r['step']} | {r['failed']} | {r['to_plan']} | {r['mttr_s']:.2f} | {ph} | "
            f"{'' if x is None else f'{x:.2f}'} | {c['time_lost_s']:.2f} | "
            f"{r['bytes_moved'] / 2**20:.0f} MB | {r['memcpy_floor_s']:.3f} |")
    for ev in f.get("standby") or []:
        lines.append(f"\nstandby ready {'at start' if ev['step'] is None else 'after step ' + str(ev['step'])}: "
                     f"{ev['plans']} plans ({ev['compiled']} compiled in {ev['compile_s']:.1f} s, "
                     f"{ev['rebound']} rebound in {ev['rebind_s']:.1f} s), training waited "
                     f"{ev['wait_s']:.1f} s")
    g = f.get("goodput") or {}
    if g:
        bad = ", ".join(f"{k} {v:.1f}" for k, v in (g.get("badput") or {}).items() if abs(v) >= 0.05)
        lines.append(f"\ngoodput {g['goodput'] or float('nan'):.3f} (wall {g['wall_s']:.1f} s); badput s: {bad}")
    return "\n".join(lines)


def check(cases: str = "0:0,1:0,3:0,1:0.1", steps: int = 3) -> bool:
    """`user_loop`'s step against elasjax's (`compile_plan`, the trainer's executable) at the demo
    size, for each `ZERO:DROPOUT` case: both start from elasjax's initial parameters (and fresh
    AdamW states) and take the same batches, `steps` of them (elasjax's data pipeline; the user
    loop gets each step's samples in global sample order, so the dropout keys match too). Per
    step: the two losses (relative difference <= 1e-5), then the parameters and optimizer
    states after it (allclose, rtol 1e-4). The learning rate warms up from 0, so step 0 leaves
    the parameters as they were: the parameter comparisons that test the update come after
    step 1 and later. Prints a line per step; returns whether every case agreed."""
    import user_loop

    ok = True
    devices = {d.id: d for d in jax.devices()}
    for case in cases.split(","):
        zero, dropout = case.split(":")
        cfg = size_config("demo", 10, [f"zero.stage={zero}", f"model.dropout={dropout}"])
        B, T = cfg.train.global_batch, cfg.model.seq_len
        plan = initial_plan(Topology(tuple(range(cfg.parallel.devices)),
                                     cfg.parallel.devices_per_host), cfg)
        exe = compile_plan(cfg, StateFactory(cfg, make_optimizer(cfg)), plan, devices,
                           donate=False)
        canonical = jax.jit(exe.layout.to_canonical)
        user = user_loop.UserLoop({10: cfg}, int(zero), donate=False).runs[10]
        e_state = exe.init()
        u_state = user["init"]()
        u_state["params"] = jax.device_put(canonical(e_state).params,
                                           user["state_sh"]["params"])
        data = DataPipeline(cfg.data, cfg.model, cfg.rng, B)
        print(f"ZeRO-{zero}, dropout {dropout}, plan {plan.name}:", flush=True)
        for s in range(steps):
            hb = data.batch(s, plan)
            order = np.argsort(hb.sample_ids.reshape(-1))
            assert (hb.sample_ids.reshape(-1)[order] == s * B + np.arange(B)).all()
            assert (hb.weights == 1).all()
            u_batch = {k: hb.fields[k].reshape(B, T)[order] for k in ("inputs", "targets")}
            e_state, met = exe.train(e_state, exe.put_batch(hb.arrays()))
            u_state, u_loss = user["train"](u_state, jax.device_put(u_batch, user["batch_sh"]))
            el, ul = float(met["loss"]), float(u_loss)
            rel = abs(el - ul) / abs(el)
            e = canonical(e_state)
            line = [f"  step {s}: loss elasjax {el:.7f} user {ul:.7f} rel diff {rel:.1e}"]
            good = rel <= 1e-5
            for name, x, y in (("params", e.params, u_state["params"]),
                               ("opt state", e.opt_state, u_state["opt"])):
                xs = [np.asarray(a) for a in jax.tree.leaves(x)]
                ys = [np.asarray(a) for a in jax.tree.leaves(y)]
                assert [a.shape for a in xs] == [a.shape for a in ys], name
                close = all(np.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(xs, ys))
                diff = max(float(np.max(np.abs(a - b), initial=0)) for a, b in zip(xs, ys))
                line.append(f"{name} after it: max |diff| {diff:.1e}, allclose {close}")
                good = good and close
            print(", ".join(line) + ("" if good else "  <- DIFFERS"), flush=True)
            ok = ok and good
    return ok


def where() -> str:
    if JOB["devices"] == 1:
        return f"one device: {jax.devices()[0].device_kind}"
    return f"{JOB['devices']} fake CPU devices, d{JOB['data']}t{JOB['tensor']}"


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["n_params"] for r in results]
    for key in results[0]["ratios"]:
        ax.plot(x, [r["ratios"].get(key, {}).get("median", np.nan) for r in results], "o-",
                label=key)
    ax.axhline(1.03, color="gray", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("per-step time ratio")
    ax.set_title(f"fault-free step cost ({where()}, measured)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="demo,3m,25m,100m")
    ap.add_argument("--modes", default="all", help="comma-separated loop names, or 'all'")
    ap.add_argument("--steps", default=None,
                    help="S1,S2: the two run lengths (default: per size, LENGTHS)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--rss-modes",
                    default="plain JAX ZeRO-1,elasjax ZeRO-1 no snapshots,elasjax ZeRO-1",
                    help="the loops --rss measures (each alone in a process)")
    ap.add_argument("--failures", action="store_true")
    ap.add_argument("--standby", action="store_true")
    ap.add_argument("--failure-steps", type=int, default=12)
    ap.add_argument("--out", default="results/scale")
    ap.add_argument("--one-device", action="store_true",
                    help="the default backend's first device alone (data 1 x tensor 1)")
    ap.add_argument("--seq-len", type=int, default=JOB["seq_len"])
    ap.add_argument("--global-batch", type=int, default=JOB["batch"])
    ap.add_argument("--check", action="store_true",
                    help="compare user_loop's step with elasjax's on the same parameters and "
                         "batches (demo size) and exit")
    ap.add_argument("--check-cases", default="0:0,1:0,3:0,1:0.1",
                    help="--check: comma-separated ZERO:DROPOUT pairs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    JOB.update(seq_len=args.seq_len, batch=args.global_batch)
    if args.one_device:
        JOB.update(devices=1, per_host=1, data=1, tensor=1)
    if args.check:
        ok = check(args.check_cases)
        print("user loop and elasjax agree" if ok else "user loop and elasjax DIFFER")
        return 0 if ok else 1
    if args.child:
        child(mode_names(args.child)[0], args.sizes, int((args.steps or "2,4").split(",")[-1]))
        return 0
    try:
        modes = mode_names(args.modes)
        rss_modes = mode_names(args.rss_modes)
    except ValueError as e:
        ap.error(f"--modes/--rss-modes: {e}")
    os.makedirs(args.out, exist_ok=True)
    results = []
    for size in args.sizes.split(","):
        print(f"# size {size}", flush=True)
        short, long = ((int(x) for x in args.steps.split(",")) if args.steps
                       else LENGTHS.get(size, (2, 6)))
        r = measure_size(size, modes, short, long, args.rounds)
        if args.rss:
            r["rss"] = rss_rows(size, rss_modes, long)
        if args.failures:
            r["failures"] = failures(size, args.failure_steps, args.standby)
        results.append(r)
        with open(os.path.join(args.out, f"{size}.json"), "w") as f:
            json.dump(r, f, indent=1, default=str)
        print(table(results), flush=True)
    lengths = ", ".join(f"{r['size']} {r['steps'][0]},{r['steps'][1]}" for r in results)
    text = (f"bench_scale: runs of S1,S2 steps ({lengths}) x {args.rounds} rounds per loop, "
            f"{where()} ({os.cpu_count()} cores), batch {JOB['batch']} x {JOB['seq_len']} "
            f"tokens, jax {jax.__version__}, load average "
            f"{os.getloadavg()[0]:.1f} at the end\n\n" + table(results) + "\n")
    with open(os.path.join(args.out, "scale.md"), "w") as f:
        f.write(text)
    plot(results, os.path.join(args.out, "scale.png"))
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
