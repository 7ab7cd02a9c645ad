"""Benchmark: recovering ZeRO state after a device and then a host failure, three ways.

    python experiments/bench_recovery.py [--d-model 512 --layers 24] [--steps 3]

On 8 fake CPU devices (4 hosts of 2) a GPT's ZeRO-1 training state (~75M parameters with the
defaults) is built, snapshotted to buddies and host memory, and one device (then a whole host)
fails. For each ZeRO layout (interleaved, contiguous) the script prints, side by side in one run:

  (a) whole-state `jax.device_put`: the naive reshard. Every leaf's full value is assembled on the
      host from live shards and snapshot copies and put onto the new plan's shardings;
  (b) elasjax's planned transfers (`reshard.transition`): only the lost pieces move, each once.
      As in the trainer, the transition was planned before the failure (from shard descriptions,
      in the background: `recovery.prepare_transfers`), so (b) executes copies; (b0) is the same
      transition planned at the failure (a cold plan), and the planning time is printed too;
  (c) a numpy memcpy of the bytes (b) moves, as the physical floor;
  (d) one `jax.device_put` of that many bytes between two devices: JAX's own copy path, which
      every device-to-device transfer through JAX pays;

with bytes moved, transfer count, largest per-device transfer count, and ratios. It then measures
the snapshot cost: train-step time without snapshots, with them as the trainer takes them
(overlapping the next step), and with each waited for (its whole cost), alternating in one run;
and the bytes snapshotted per step. Wall-clock on fake devices that share 2 cores; the ratios
within one run are what to read. Targets (issue 3): snapshot overhead <= 10% of step time;
(b) >= 2x faster than (a); (b) within 3x of (c).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch
import numpy as np  # noqa: E402

from elasjax import config
from elasjax.plan import planner  # noqa: E402
from elasjax.runtime.faults import inject  # noqa: E402
from elasjax.core.mesh import make_mesh  # noqa: E402
from elasjax.runtime.inprocess import InProcessRuntime  # noqa: E402
from elasjax.layout.state import StateFactory, make_optimizer  # noqa: E402
from elasjax.transfer.copies import CopyThreads  # noqa: E402
from elasjax.transfer.reshard import TransitionPlanCache, transition  # noqa: E402
from elasjax.transfer.shards import ShardStore, describe_state  # noqa: E402
from elasjax.transfer.snapshot import SnapshotPool  # noqa: E402


def build(args, layout: str):
    cfg = config.load(None, [
        f"model.d_model={args.d_model}", f"model.n_heads={args.heads}", f"model.n_layers={args.layers}",
        f"model.d_mlp={4 * args.d_model}", f"model.seq_len={args.seq}", "model.dropout=0.0",
        "data.source=synthetic",
        "train.deterministic=false", "data.synthetic_samples=256",
        f"train.global_batch={args.batch}", "train.microbatches=1", "train.eval_every=0",
        f"train.steps={args.steps + 2}",
        "parallel.devices=8", "parallel.devices_per_host=2", "parallel.data=8", "parallel.tensor=1",
        "zero.stage=1", f"zero.layout={layout}", "snapshot.buddy=true", "snapshot.host=true",
        "zero.shrink=in_place",  # what (b) measures: survivors keep their partitions
        "hardware.flops=2.0e9",
    ])
    return cfg


def whole_state_device_put(store: ShardStore, snaps, new_layout, new_mesh, old_layout):
    """(a): assemble every leaf's canonical value on the host, then put the whole state."""
    t0 = time.perf_counter()
    f = new_layout.factory
    # canonical leaves from the old storage: rebuild old-layout arrays on the host
    host_leaves = []
    for path, shape, dtype, shards in zip(store.paths, store.shapes, store.dtypes, store.shards):
        full = np.zeros(shape, dtype)
        for s in shards + snaps.get(path, []):
            full[tuple(slice(a, b) for a, b in s.box)] = np.asarray(s.data)
        host_leaves.append(full)
    old_state = jax.tree_util.tree_unflatten(store.treedef, host_leaves)
    canon = jax.jit(old_layout.to_canonical)(old_state) if old_layout.codec else old_state
    put = jax.device_put(canon, f.shardings(new_mesh))
    state = jax.jit(new_layout.from_canonical, out_shardings=new_layout.shardings(new_mesh))(put)
    jax.block_until_ready(state)
    return state, time.perf_counter() - t0


THREADS = CopyThreads()  # one per core, as the trainer's runtime has


def planned_transition(store, new_sh, devs, snaps, lay, new_lay, plans):
    """(b): `reshard.transition`, with a plan cache (a prepared plan) or without (cold)."""
    info: dict = {}
    t0 = time.perf_counter()
    out, log = transition(store, new_sh, devices=devs, extra_sources=snaps, old_layout=lay,
                          new_layout=new_lay, plans=plans, info=info, threads=THREADS)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out, log, info


def memcpy_floor(nbytes: int) -> float:
    src = np.ones(max(nbytes // 4, 1), np.float32)
    best = float("inf")
    for _ in range(7):
        dst = np.empty_like(src)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def device_put_floor(nbytes: int) -> float:
    """One `jax.device_put` of `nbytes` between two devices: JAX's own copy path, the floor any
    device-to-device transfer through JAX pays (best of 3)."""
    devs = jax.devices()
    x = jax.device_put(np.ones(max(nbytes // 4, 1), np.float32), devs[1])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.device_put(x, devs[2]).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def recovery_rows(args, layout: str):
    cfg = build(args, layout)
    devs = {d.id: d for d in jax.devices()}
    topo = planner.Topology(tuple(range(8)), 2)
    f = StateFactory(cfg, make_optimizer(cfg))
    plan = planner.initial_plan(topo, cfg)
    rows = []
    live = set(topo.device_ids)
    state = None
    for failed, hosts, label in (([3], set(), "device 3"), ([0, 1], {0}, "host 0")):
        lay = f.layout(plan)
        mesh = make_mesh(plan.mesh_shape, [devs[i] for i in plan.device_ids])
        if state is None:
            state = jax.jit(lay.init_fn, out_shardings=lay.shardings(mesh))()
        pool = SnapshotPool(cfg.snapshot, topo, InProcessRuntime(topology=topo))
        pool.configure(state, lay.shardings(mesh), mesh, live)
        pool.take(state, 0)
        pool.complete()
        described = describe_state(state, failed)  # what the trainer describes before a failure
        store, lost = inject(state, tuple(failed))
        live = live - set(failed)
        new_plan = planner.replan(sorted(live), topo, cfg, plan, plan)
        new_lay = f.layout(new_plan)
        new_mesh = make_mesh(new_plan.mesh_shape, [devs[i] for i in new_plan.device_ids])
        new_sh = new_lay.shardings(new_mesh)
        # the plan prepared before the failure, from descriptions only (the trainer does this in
        # a background thread after every plan change)
        plans = TransitionPlanCache()
        t0 = time.perf_counter()
        plans.prepare(described, new_sh, pool.describe_sources(set(failed), hosts),
                      old_layout=lay, new_layout=new_lay)
        t_prep = time.perf_counter() - t0
        snaps = pool.sources(set(failed), hosts, version=0)
        # (a) naive whole-state reshard (timed twice, best; the first run includes compiles)
        t_a = min(whole_state_device_put(store, snaps, new_lay, new_mesh, lay)[1] for _ in range(2))

        args_b = (store, new_sh, devs, snaps, lay, new_lay)
        # (b) planned transfers with the prepared plan (7 runs: first and best). Each run's
        # state is dropped before the next, as recovery drops the old state
        t_runs = []
        for _ in range(7):
            new_state = None
            dt, new_state, log, info = planned_transition(*args_b, plans)
            assert info["plan_hit"], "the prepared plan was not used"
            t_runs.append(dt)
        written = info["bytes_written"]
        t_b_first, t_b = t_runs[0], min(t_runs)
        # (b0) the same, planned at the failure (best of 2)
        cold = []
        for _ in range(2):
            new_state = None
            dt, new_state, log, info = planned_transition(*args_b, None)
            cold.append((dt, info["plan_s"]))
        t_b0, t_plan = min(cold)
        t_c = memcpy_floor(log.bytes_moved)
        t_d = device_put_floor(log.bytes_moved)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(new_state))
        rows.append({
            "layout": layout, "failure": label, "plan": f"{plan.name} -> {new_plan.name}",
            "state_MB": state_bytes / 1e6, "lost_MB": lost / 1e6,
            "moved_MB": log.bytes_moved / 1e6, "kept_MB": log.kept_bytes / 1e6,
            "written_MB": written / 1e6,
            "transfers": log.transfers, "max_per_device": log.max_per_device(),
            "a_s": t_a, "b_s": t_b, "b_first_s": t_b_first, "b0_s": t_b0, "plan_s": t_plan,
            "prep_s": t_prep, "c_s": t_c, "d_s": t_d,
        })
        plan, state = new_plan, new_state
    return rows


def snapshot_cost(args):
    """Train-step time without snapshots, with snapshots as the trainer takes them (dispatched
    after the step, completed at the next step boundary: they may overlap the next step), and
    with each snapshot waited for right after its step (serial: its whole cost). The modes
    alternate in blocks of two steps, `args.steps` rounds; medians of the per-step times."""
    from elasjax.compilation.executables import compile_plan
    from elasjax.loop.data import DataPipeline

    cfg = build(args, "interleaved")
    devs = {d.id: d for d in jax.devices()}
    topo = planner.Topology(tuple(range(8)), 2)
    f = StateFactory(cfg, make_optimizer(cfg))
    plan = planner.initial_plan(topo, cfg)
    exe = compile_plan(cfg, f, plan, devs)
    state = exe.init()
    pool = SnapshotPool(cfg.snapshot, topo, InProcessRuntime(topology=topo))
    pool.configure(state, exe.state_shardings, exe.mesh, set(topo.device_ids))
    data = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
    times: dict[str, list[float]] = {"off": [], "overlapped": [], "serial": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    i = 0
    for rnd in range(args.steps + 1):  # round 0 warms up (compiles) and is not counted
        for mode in times:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(2):
                batch = exe.put_batch(data.batch(i, plan).arrays())
                pool.complete()  # the step boundary: the previous snapshot has landed
                state, _ = exe.train(state, batch)
                jax.block_until_ready(state)
                if mode != "off":
                    pool.take(state, i + 1)
                    if mode == "serial":
                        pool.complete()
                i += 1
            pool.complete()  # a block ends with its snapshots done: their whole cost counts
            if rnd:
                times[mode].append((time.perf_counter() - t0) / 2)
                cpu[mode].append((time.process_time() - c0) / 2)
    med = {k: float(np.median(v)) for k, v in times.items()}
    med_cpu = {k: float(np.median(v)) for k, v in cpu.items()}
    return med, med_cpu, pool.bytes_per_step, len(pool.records)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5,
                    help="snapshot cost: rounds of 2 steps per mode (medians)")
    ap.add_argument("--skip-snapshot-cost", action="store_true")
    args = ap.parse_args()
    cfg = build(args, "interleaved")
    n = StateFactory(cfg, make_optimizer(cfg)).n_params
    print(f"# bench_recovery: ZeRO-1 state of a {n / 1e6:.1f}M-parameter GPT on 8 fake CPU devices "
          f"(4 hosts x 2), jax {jax.__version__}; wall-clock on 2 shared cores\n")
    rows = []
    for layout in ("interleaved", "contiguous"):
        rows += recovery_rows(args, layout)
    print("| layout | failure | plan change | lost MB | moved MB | written MB | kept in place MB | transfers | "
          "max xfers/device | (a) device_put s | (b) planned s (first run) | (b0) cold s "
          "(of which planning) | (c) memcpy s | (d) one device_put s | a/b | b/c | b0/c | b/d |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = max(r["c_s"], 1e-9)
        print(f"| {r['layout']} | {r['failure']} | {r['plan']} | {r['lost_MB']:.1f} | "
              f"{r['moved_MB']:.1f} | {r['written_MB']:.1f} | {r['kept_MB']:.1f} | {r['transfers']} | "
              f"{r['max_per_device']} | "
              f"{r['a_s']:.3f} | {r['b_s']:.4f} ({r['b_first_s']:.4f}) | {r['b0_s']:.4f} "
              f"({r['plan_s']:.4f}) | {r['c_s']:.4f} | {r['d_s']:.4f} | "
              f"{r['a_s'] / r['b_s']:.1f}x | {r['b_s'] / c:.1f}x | {r['b0_s'] / c:.1f}x | "
              f"{r['b_s'] / max(r['d_s'], 1e-9):.1f}x |")
    print("\nwritten MB: every byte the planned path writes into new shards, local pieces included "
          "(moved MB crosses devices; (c) copies moved MB). (b) is the best of 7 runs, the first "
          "in brackets; (c) is the best of 7.")
    print("(b) ran a plan prepared before the failure from shard descriptions; preparing it "
          "took " + ", ".join(f"{r['prep_s']:.3f}s" for r in rows) + " (background work in the "
          "trainer). (b0) plans at the failure.")
    inter = {r["failure"]: r for r in rows if r["layout"] == "interleaved"}
    for r in rows:
        if r["layout"] == "contiguous":
            i = inter[r["failure"]]
            print(f"\n{r['failure']}: contiguous moves {r['moved_MB'] / max(i['moved_MB'], 1e-9):.1f}x "
                  f"the bytes of interleaved ({r['moved_MB']:.1f} vs {i['moved_MB']:.1f} MB)")
    if not args.skip_snapshot_cost:
        med, med_cpu, nbytes, nrec = snapshot_cost(args)
        print(f"\nsnapshot cost ({nbytes / 1e6:.1f} MB snapshotted per step in {nrec} shards, buddy + "
              f"host; medians over {args.steps} rounds of 2 steps per mode):")
        print("| per step | without | as the trainer takes them (overlapping the next step) | "
              "each waited for after its step |")
        print("|---|---|---|---|")
        for name, m in (("wall-clock s", med), ("process CPU s", med_cpu)):
            off = m["off"]
            print(f"| {name} | {off:.3f} | {m['overlapped']:.3f} "
                  f"({100 * (m['overlapped'] - off) / off:+.1f}%) | {m['serial']:.3f} "
                  f"({100 * (m['serial'] - off) / off:+.1f}%) |")


if __name__ == "__main__":
    main()
