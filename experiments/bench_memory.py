"""Benchmark: memory stays flat over many failures.

    python experiments/bench_memory.py [--faults 20] [--devices 64] [--zero 1]

Trains the tiny GPT on `--devices` fake CPU devices (hosts of 8, data parallel, ZeRO stage
`--zero` on the interleaved layout, buddy snapshots) through `--faults` single-device failures,
one every two steps, each on a device of a different host in turn. After each recovery it
records the process's resident set size (RSS, from /proc/self/status) and the sizes of the
caches a long elastic run could grow: compiled plans (`ExecutableCache`), state forms
(`StateFactory.layout`) and transition plans (`TransitionPlanCache`). It prints them per recovery
and the ratio of the last RSS to the RSS after the first recovery. Every executable cached is a
new plan here (no plan repeats), so the executable cache runs at its bound from the
`max_entries`-th failure on.

The per-rank ZeRO storage ratio (allocated / ideal share) after each recovery is printed too.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("--faults", type=int, default=20)
ap.add_argument("--devices", type=int, default=64)
ap.add_argument("--zero", type=int, default=1)
args = ap.parse_args()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

import jax  # noqa: E402
jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch

from elasjax import config
from elasjax.loop import trainer
from elasjax.plan import zero  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Measured(trainer.Trainer):
    """The trainer, printing its memory after each recovery (`on_recovery`)."""

    rows: list = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        recover = self.recovery.recover

        def measured(pos, pool, failure, during):
            out = recover(pos, pool, failure, during)
            self.on_recovery(pos.step, out.pos.plan)
            return out

        self.recovery.recover = measured

    def on_recovery(self, step, plan):
        ratio = zero.storage_ratio(plan.zero) if plan.zero is not None else float("nan")
        self.rows.append((
            step, plan.name.split(".")[0], rss_mb(), len(self.exe_cache._d),
            len(self.factory._layouts), len(self.transitions.cache), ratio,
        ))
        r = self.rows[-1]
        print(f"step {r[0]:3d} -> {r[1]:<12} RSS {r[2]:8.1f} MB  executables {r[3]:2d}  "
              f"forms {r[4]:2d}  transition plans {r[5]:2d}  ZeRO storage ratio {r[6]:.4f}",
              flush=True)


def main():
    n, per_host = args.devices, 8
    hosts = n // per_host
    # one device of a different host each time, never the same device twice
    victims = [(k % hosts) * per_host + (k // hosts) % per_host for k in range(args.faults)]
    faults = ", ".join(f"{{at_step: {2 * k + 2}, devices: [{d}]}}" for k, d in enumerate(victims))
    cfg = config.load(None, [
        "model.seq_len=16", "model.d_model=32", "model.n_heads=4", "model.n_layers=2",
        "model.d_mlp=64", "data.source=synthetic",
        "train.deterministic=false", "data.synthetic_samples=4096",
        f"train.steps={2 * args.faults + 3}", f"train.global_batch={n}", "train.microbatches=1",
        "train.eval_every=0", f"parallel.devices={n}", f"parallel.devices_per_host={per_host}",
        f"parallel.data={n}", "parallel.tensor=1", f"zero.stage={args.zero}",
        "hardware.name=cpu-fake", "hardware.flops=2.0e9", f"faults=[{faults}]",
    ])
    with tempfile.TemporaryDirectory() as out:
        t = Measured(cfg, out, progress=False)
        t.run()
    rows = Measured.rows
    print(f"# bench_memory: {args.faults} single-device failures on {n} fake CPU devices "
          f"(jax {jax.__version__}, ZeRO-{args.zero})")
    print(f"RSS after the first recovery {rows[0][2]:.1f} MB, after the last {rows[-1][2]:.1f} MB "
          f"(x{rows[-1][2] / rows[0][2]:.3f}); max over the run {max(r[2] for r in rows):.1f} MB")
    print(f"caches at the end: executables {rows[-1][3]}, forms {rows[-1][4]}, transition plans "
          f"{rows[-1][5]}; max ZeRO storage ratio {max(r[6] for r in rows):.4f}")


if __name__ == "__main__":
    sys.exit(main())
