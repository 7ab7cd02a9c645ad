"""What a standby hit's reload costs in one process: a config's start plan compiled, then loaded
again onto its own devices (`executables.rebind`, what a recovery does on a renewed CPU client
under launch), each load followed by a few runs of the step.

    python experiments/probe_reload.py [--config configs/demo.yaml] [--loads 3] [--runs 4]

Prints the compiled program's step times, then per load its seconds and the step times after
it (each run waited for): the first run after a load against the steady step says what a hit's
first step owes to the load itself. Results: experiments/RESULTS.md, "The standby's plans spread
over the processes"."""

import argparse
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from elasjax import config  # noqa: E402
from elasjax.compilation.executables import compile_plan, rebind  # noqa: E402
from elasjax.layout.state import StateFactory, make_optimizer  # noqa: E402
from elasjax.loop.data import DataPipeline  # noqa: E402
from elasjax.plan.planner import Topology, initial_plan  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args(argv)
    cfg = config.load(args.config, ["faults=[]"])
    plan = initial_plan(Topology(tuple(range(cfg.parallel.devices)),
                                 cfg.parallel.devices_per_host), cfg)
    devices = {d.id: d for d in jax.devices()}
    exe = compile_plan(cfg, StateFactory(cfg, make_optimizer(cfg)), plan, devices, donate=False)
    data = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
    state = exe.init()
    batch = exe.put_batch(data.batch(0, plan).arrays())

    def runs(e) -> list[float]:
        out = []
        for _ in range(args.runs):
            t = time.perf_counter()
            jax.block_until_ready(e.train(state, batch))
            out.append(round((time.perf_counter() - t) * 1e3, 1))
        return out

    print(f"{plan.name}: compiled, step ms {runs(exe)}")
    for _ in range(args.loads):
        t = time.perf_counter()
        again = rebind(exe, plan, devices)
        print(f"reload {(time.perf_counter() - t) * 1e3:.0f} ms; step ms after it {runs(again)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
