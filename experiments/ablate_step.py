"""elasjax's step program with parts taken out, against the plain JAX step: which part costs.

    python experiments/ablate_step.py [--size 3m] [--rounds 3] [--reps 5]

Each program is compiled once and run alone on a batch placed once (`profile_step.step_ms`: the
median of `--reps` runs after 2 warm-ups); rounds alternate the programs and the table gives each
program's median over rounds and its ratio to the plain JAX ZeRO-1 step (`user_loop.py`,
undonated, as elasjax's step). No data pipeline and no host work between steps: this is the
device program only (bench_scale.py times whole loops).

The parts are taken out by replacing them while the program is traced, so the programs are
elasjax's own otherwise, not a copy:
  no grad constraint    `microbatch.accumulate` without the sharding constraint on each
                        micro-batch's gradient (an identity)
  no micro constraint   ... without the constraint on each micro-batch's inputs
  no checksums          the step's stacked state checksums replaced by zeros
  no annotations        every ZeRO storage unit converted per device (`shard_map`), the
                        gradient constrained whole (`ZeroCodec.annotate_exact` off): the step
                        as it was before issue 46
Such programs compute the same state but not the checksums a recovery verifies: they are for
measuring only. ZeRO-0 rows separate the ZeRO-1 storage (`storage.ZeroCodec`) from the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scale  # noqa: E402  (sets 8 fake CPU devices before jax loads)
import profile_step  # noqa: E402
import user_loop  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from elasjax.layout import step as step_mod  # noqa: E402
from elasjax.compilation.executables import compile_plan  # noqa: E402
from elasjax.loop.data import DataPipeline  # noqa: E402
from elasjax.plan.planner import Topology, initial_plan  # noqa: E402
from elasjax.layout.state import StateFactory, StateLayout, make_optimizer  # noqa: E402
from elasjax.layout.storage import ZeroCodec  # noqa: E402


@contextlib.contextmanager
def without(parts: tuple[str, ...]):
    """elasjax's step traced with `parts` replaced (see the module docstring)."""
    accumulate, sums = step_mod.accumulate, StateLayout.stacked_checksums

    def ablated(*args, **kwargs):
        if "grad constraint" in parts:
            kwargs["grad_constraint"] = lambda g: g
        if "micro constraint" in parts:
            kwargs["micro_constraint"] = lambda mb: mb
        return accumulate(*args, **kwargs)

    step_mod.accumulate = ablated
    if "annotations" in parts:
        ZeroCodec.annotate_exact = False
    if "checksums" in parts:
        StateLayout.stacked_checksums = (
            lambda self, state, mesh=None: jnp.zeros((len(self.checksum_keys), 2), jnp.uint32))
    try:
        yield
    finally:
        step_mod.accumulate, StateLayout.stacked_checksums = accumulate, sums
        ZeroCodec.annotate_exact = True


def plain(size: str, zero: int):
    cfg = bench_scale.size_config(size, 100, [f"zero.stage={zero}"])
    r = user_loop.UserLoop._build(cfg, zero, False, None)
    return r["train"], r["init"](), jax.device_put(user_loop.make_batch(cfg, 0), r["batch_sh"])


def elasjax(size: str, zero: int, parts: tuple[str, ...] = (), extra=()):
    cfg = bench_scale.size_config(size, 100, [f"zero.stage={zero}", *extra])
    plan = initial_plan(Topology(tuple(range(8)), 2), cfg)
    with without(parts):
        exe = compile_plan(cfg, StateFactory(cfg, make_optimizer(cfg)), plan,
                           {d.id: d for d in jax.devices()}, donate=False)
    data = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
    return exe.train, exe.init(), exe.put_batch(data.batch(0, plan).arrays())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="3m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    progs = {
        "plain JAX ZeRO-0": plain(a.size, 0),
        "plain JAX ZeRO-1": plain(a.size, 1),
        "elasjax ZeRO-0": elasjax(a.size, 0),
        "elasjax ZeRO-1": elasjax(a.size, 1),
        "elasjax deterministic ZeRO-1": elasjax(a.size, 1, extra=["train.deterministic=true"]),
        "elasjax deterministic ZeRO-1 without annotations": elasjax(
            a.size, 1, ("annotations",), extra=["train.deterministic=true"]),
    }
    for parts in (("annotations",), ("grad constraint",), ("micro constraint",),
                  ("checksums",), ("grad constraint", "micro constraint", "checksums")):
        progs["elasjax ZeRO-1 without " + ", ".join(parts)] = elasjax(a.size, 1, parts)
    times: dict[str, list[float]] = {k: [] for k in progs}
    for r in range(a.rounds):
        for name, (fn, state, batch) in progs.items():
            times[name].append(profile_step.step_ms(fn, state, batch, a.reps))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in times.items()), flush=True)
    base = statistics.median(times["plain JAX ZeRO-1"])
    print(f"\n| device program, {a.size} | ms (median of {a.rounds} rounds) | / plain JAX ZeRO-1 |")
    print("|---|---|---|")
    for name, v in times.items():
        print(f"| {name} | {statistics.median(v):.0f} | {statistics.median(v) / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
