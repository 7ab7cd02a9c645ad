"""Test setup: 8 fake CPU devices before JAX initialises, and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Tests run many short trainings whose cost is compilation: XLA's optimisation passes cost
# ~30-40% of compile time (measured) and buy nothing at this scale. Every comparison in the
# suite is between runs of the same process, so the setting is the same on both sides.
jax.config.update("jax_disable_most_optimizations", True)

import pytest  # noqa: E402

from elasjax import config  # noqa: E402
from elasjax.step import ExecutableCache  # noqa: E402

# A tiny GPT on synthetic data: every field that shapes an executable is fixed here so that tests
# share compiled plans through `exe_cache`.
TINY = [
    "model.seq_len=16",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_layers=2",
    "model.d_mlp=64",
    "model.dropout=0.1",
    "data.source=synthetic",
    "data.synthetic_samples=1024",
    "train.global_batch=32",
    "train.microbatches=2",
    "train.eval_every=0",
    "parallel.devices=8",
    "parallel.devices_per_host=2",
    "parallel.data=4",
    "parallel.tensor=2",
    # The cost model sees a slow device (fake CPU devices share 2 cores), so compute dominates
    # and the planner uses every survivor; the nominal default would rank this tiny model's
    # layouts by all-reduce latency instead.
    "hardware.name=cpu-fake",
    "hardware.flops=2.0e9",
    # Planning transitions ahead costs ~1 s of background CPU per plan change in a tiny run,
    # which adds up over the suite on 2 cores. It changes no result (a miss plans at the
    # failure), so it is off here and tested on purpose where it matters
    # (test_zero.py, test_zero_train.py, and the CLI demo runs, which use the default: on).
    "recovery.prepare_transfers=false",
]


# data 2 x stage 4 pipelines of the tiny model (4 layers), re-plans kept pipelined
PIPE = [
    "model.n_layers=4", "parallel.data=2", "parallel.stage=4", "parallel.tensor=1",
    "parallel.max_stage=4", "parallel.replan=keep_tensor", "train.microbatches=4",
    "parallel.min_stage=2", "train.steps=10",
]


def tiny_config(*overrides: str) -> config.Config:
    return config.load(None, [*TINY, *overrides])


@pytest.fixture(scope="session")
def exe_cache() -> ExecutableCache:
    return ExecutableCache(max_entries=64)


def skip_if_not_enough_devices(n: int) -> None:
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")


# The suite runs in two xdist workers, one test file at a time each (`--dist loadfile`). Files
# are handed out in collection order, so the longest ones (measured) go first: otherwise a
# long file collected last runs alone at the end while the other worker idles.
LONGEST_FIRST = [
    "test_multiprocess.py",
    "test_zero_train.py",
    "test_pipeline_recovery.py",
    "test_pipeline.py",
    "test_standby_baselines.py",
    "test_zero.py",
    "test_cli.py",
    "test_trainer.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
