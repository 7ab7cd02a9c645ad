"""What the per-step checksums cost: the checksum executable of a plan's state, alone.

    python experiments/bench_checksums.py [--size 25m] [--zero 0] [--calls 6]

Compiles the plan of `experiments/bench_scale.py`'s size (data 4 x tensor 2 on 8 fake CPU
devices) and times its checksum executable (`Executables.checksum`, the same hashing the train
step does after its update: every element of the state hashed once over the mesh, at its
layout-independent identity) on a fresh state: the median of `--calls` calls, with the state's
size, so that the figure reads as bytes hashed per second. Compare commits with it (the tiling of
`checksum.tile_sums` is what it measures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch
from bench_scale import SIZES, size_config  # noqa: E402

from elasjax.compilation.executables import compile_plan  # noqa: E402
from elasjax.plan.planner import Topology, initial_plan  # noqa: E402
from elasjax.layout.state import StateFactory, make_optimizer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="25m", help=f"{', '.join(SIZES)} or dD:LL")
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args(argv)
    cfg = size_config(args.size, 2, [f"zero.stage={args.zero}"])
    plan = initial_plan(Topology(tuple(range(8)), cfg.parallel.devices_per_host), cfg)
    f = StateFactory(cfg, make_optimizer(cfg))
    exe = compile_plan(cfg, f, plan, {d.id: d for d in jax.devices()})
    state = exe.init()
    jax.block_until_ready(exe.checksum(state))
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        jax.block_until_ready(exe.checksum(state))
        times.append(time.perf_counter() - t0)
    mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / 2**20
    t = statistics.median(times)
    print(f"{args.size} ({f.n_params / 1e6:.1f}M parameters), plan {plan.name}, state {mb:.0f} MB: "
          f"checksum executable {t * 1e3:.1f} ms median of {args.calls} "
          f"({min(times) * 1e3:.1f} .. {max(times) * 1e3:.1f}), {mb / t / 1024:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
