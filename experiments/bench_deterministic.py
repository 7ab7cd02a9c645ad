"""Benchmark: the step-time cost of the bitwise deterministic mode.

    python experiments/bench_deterministic.py [--steps 10] [--config configs/demo_pipeline.yaml]

Compiles a config's initial plan (default configs/demo.yaml: data 4 x tensor 2) twice, in the normal
mode and with `train.deterministic: true`, and times train steps of both alternately in one run
(same batches). Deterministic mode computes each canonical micro-batch's gradient on one replica
without cross-replica reduction and adds them in one fixed binary tree over the canonical
indices (`elasjax.core.treesum`): the printed ratio is what bitwise reproducibility across meshes
costs here. Wall-clock on 8 fake CPU devices sharing 2 cores.

Memory: the tree keeps at most ceil(log2 K) + 3 gradient-sized registers per device for K
canonical micro-batches (whatever the replica count), and the step adds the broadcast sum and
its normalised copy. The script prints XLA's `memory_analysis()` of both train executables
(temporary bytes per device) next to that bound, `(ceil(log2 K) + 5) * P * 4` bytes for P
parameters.
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
from elasjax.plan import planner
from elasjax.core import treesum  # noqa: E402
from elasjax.compilation.executables import compile_plan  # noqa: E402
from elasjax.loop.data import DataPipeline  # noqa: E402
from elasjax.layout.state import StateFactory, make_optimizer  # noqa: E402


def setup(path: str, deterministic: bool):
    over = [f"train.deterministic={str(deterministic).lower()}"]
    if config.load(path, []).parallel.stage > 1:
        over.append("parallel.min_stage=2")  # deterministic pipelines stay pipelined
    cfg = config.load(path, over)
    devs = {d.id: d for d in jax.devices()}
    topo = planner.Topology(tuple(range(8)), cfg.parallel.devices_per_host)
    plan = planner.initial_plan(topo, cfg)
    f = StateFactory(cfg, make_optimizer(cfg))
    exe = compile_plan(cfg, f, plan, devs)
    return cfg, plan, exe, exe.init()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--config", default="configs/demo.yaml")
    args = ap.parse_args()
    runs = {m: setup(args.config, m) for m in (False, True)}
    cfg = runs[False][0]
    data = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
    times = {False: [], True: []}
    for i in range(args.steps + 1):
        for mode, (_, plan, exe, state) in runs.items():
            batch = exe.put_batch(data.batch(i, plan).arrays())
            t0 = time.perf_counter()
            state, met = exe.train(state, batch)
            jax.block_until_ready(state)
            if i:  # step 0 warms up
                times[mode].append(time.perf_counter() - t0)
            runs[mode] = (runs[mode][0], plan, exe, state)
    normal, det = np.median(times[False]), np.median(times[True])
    print(f"# bench_deterministic: {args.config}, plan {runs[False][1].name} on 8 fake CPU "
          "devices (2 shared cores)")
    print(f"step time: normal {normal * 1e3:.1f} ms, deterministic {det * 1e3:.1f} ms "
          f"(x{det / normal:.2f}); compile {runs[False][2].compile_s:.1f} s vs "
          f"{runs[True][2].compile_s:.1f} s")
    plan, state = runs[True][1], runs[True][3]
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    temp = {m: r[2].train.memory_analysis().temp_size_in_bytes for m, r in runs.items()}
    K = plan.n_canonical
    regs = treesum.register_bound(K) + 2
    bound = regs * n_params * 4
    print(f"temporary memory per device (XLA memory_analysis): normal {temp[False] / 1e6:.2f} MB, "
          f"deterministic {temp[True] / 1e6:.2f} MB; extra {(temp[True] - temp[False]) / 1e6:.2f} MB "
          f"vs the stated bound (ceil(log2 K) + 5) x params x 4 B = {regs} x {n_params} x 4 B "
          f"= {bound / 1e6:.2f} MB (K = {K})")


if __name__ == "__main__":
    main()
