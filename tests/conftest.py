"""Test setup: 8 fake CPU devices before JAX initialises, and shared fixtures."""

import contextlib
import os
from importlib.metadata import version

# `ELASJAX_TEST_XLA_OPT=1` runs the suite with XLA as users run it; otherwise two settings cut
# compile time, which is most of the suite's time (tiny models, many plans):
# - XLA:CPU's older loop emitters instead of its fusion emitters (the same HLO, other kernels;
#   measured: a tiny plan's backend compile 6.2 s -> 3.0-4.7 s, unoptimised and optimised alike).
#   XLA_FLAGS reach the subprocesses (`launch`, the CLI) too;
# - most of XLA's HLO passes off (below).
XLA_AS_USERS_RUN_IT = os.environ.get("ELASJAX_TEST_XLA_OPT") == "1"
# the emitter flag exists in jaxlib 0.10's XLA only (0.12's aborts on an unknown flag)
_LOOP_EMITTERS = tuple(int(x) for x in version("jaxlib").split(".")[:2]) < (0, 11)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    + ("" if XLA_AS_USERS_RUN_IT or not _LOOP_EMITTERS else " --xla_cpu_use_fusion_emitters=false")
).strip()

# runs that use the default program store (`standby.programs_dir: auto`: the CLI demo runs) keep
# it in a directory of this test process, never in the user's cache
# (pytest-xdist's workers inherit it from the controller, which removes it when it exits)
if "ELASJAX_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["ELASJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="elasjax-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ELASJAX_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402

from elasjax.runtime.dispatch import order_cpu_collectives  # noqa: E402

# XLA:CPU's scheduler that runs a rank's collectives at once can deadlock an execution: the
# tests' processes turn it off as a runtime does before JAX's backends start (`runtime.dispatch`)
order_cpu_collectives()
jax.config.update("jax_num_cpu_devices", 8)
# what elasjax's runtimes need on XLA:CPU, set before any test touches a device (elasjax sets
# it itself only where JAX's backends have not started: `elasjax.runtime.dispatch`)
jax.config.update("jax_cpu_enable_async_dispatch", False)
# Tests run many short trainings whose cost is compilation: XLA's optimisation passes cost
# ~30-40% of compile time (measured) and buy nothing at this scale. Every comparison in the
# suite is between runs of the same process, so the setting is the same on both sides.
# The consistency tests that the project's claims rest on run optimised anyway
# (test_optimized.py); ELASJAX_TEST_XLA_OPT=1 runs the whole suite optimised.
jax.config.update("jax_disable_most_optimizations", not XLA_AS_USERS_RUN_IT)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from elasjax import config  # noqa: E402
from elasjax.compilation.executables import ExecutableCache  # noqa: E402

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
    # The suite's tests were written for the default mode (1e-5 per step, re-plans free to
    # change the tensor degree); the deterministic mode, the default where a config leaves
    # `train.deterministic` out, is asked for where it is tested (test_deterministic*.py, ...).
    "train.deterministic=false",
    # The standby (on by default in one process: `standby.enabled: auto`) compiles every likely
    # failure's plan beside each run: on 2 cores, in every in-process test, that is CPU the
    # suite does not have. It changes no result; it is on where it is tested (test_standby*.py,
    # test_trainer.py's default-standby test, the CLI demo runs, which use the configs as users
    # do).
    "standby.enabled=false",
    # The program store (on by default: `standby.programs_dir: auto`) would make a test's
    # compiles depend on what an earlier test, or an earlier suite, compiled; it is on where it
    # is tested (test_program_store.py) and in the CLI demo runs, in a directory of this session
    # (ELASJAX_CACHE_DIR below).
    "standby.programs_dir=null",
]


# data 2 x stage 4 pipelines of the tiny model (4 layers), re-plans kept pipelined
PIPE = [
    "model.n_layers=4", "parallel.data=2", "parallel.stage=4", "parallel.tensor=1",
    "parallel.max_stage=4", "parallel.replan=keep_tensor", "train.microbatches=4",
    "parallel.min_stage=2", "train.steps=10",
]


def tiny_config(*overrides: str) -> config.Config:
    return config.load(None, [*TINY, *overrides])


# The consistency contract (ARCHITECTURE.md, rule 3): per-step training and held-out losses within relative 1e-5
# of the fault-free run (f32, reduction order differs between meshes; measured ~1e-7), the same
# samples; final parameters allclose(rtol=1e-4, atol=1e-6) (measured max |dp| 1.2e-7 after 12
# steps, parameters of scale ~1e-2).
LOSS_RTOL = 1e-5


RETRY = "collective error (no process died)"


def deaths(events: list[dict]) -> list[dict]:
    """The recovery events of deaths. Any other recovery must be a collective retry: on a loaded
    host (CI runs two tests at once on 2 cores) a live peer can be later than the collective
    timeout inside a step, and the step is redone on fresh collectives, nothing lost, nobody
    declared dead (docs/launch-internals.md, "Retrying a step whose collectives failed among
    live processes"; test_multiprocess.py's test_a_collective_that_times_out_among_live_
    processes_is_retried_on_fresh_collectives asserts the retry itself). A retry never stands in
    for a death, nor a death for a retry: the detector and the failed processes tell them
    apart."""
    recs = [e for e in events if e["type"] == "recovery"]
    deaths = [e for e in recs if e["failed_processes"]]
    for r in recs:
        if not r["failed_processes"]:
            assert r["detector"] == RETRY and r["failed_devices"] == [], r
            assert r["from_plan"] == r["to_plan"] and r["verify"]["leaves"] > 0, r
    return deaths


def assert_same_computation(a, ref, steps=None):
    steps = steps if steps is not None else sorted(ref.losses)
    for s in steps:
        assert a.sample_digests[s] == ref.sample_digests[s], f"different samples at step {s}"
        rel = abs(a.losses[s] - ref.losses[s]) / ref.losses[s]
        assert rel <= LOSS_RTOL, f"step {s}: loss {a.losses[s]} vs {ref.losses[s]} (rel {rel:.2e})"
    for s in set(a.eval_losses) & set(ref.eval_losses):  # held-out loss of the same state
        v = ref.eval_losses[s]
        rel = abs(a.eval_losses[s] - v) / v
        assert rel <= LOSS_RTOL, f"step {s}: held-out loss {a.eval_losses[s]} vs {v} (rel {rel:.2e})"


def assert_params_close(a, b):
    pa, pb = jax.device_get(a.state.params), jax.device_get(b.state.params)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), pa, pb)


@pytest.fixture(scope="session")
def exe_cache() -> ExecutableCache:
    return ExecutableCache(max_entries=64)


@contextlib.contextmanager
def optimised_compiles(max_entries: int = 16):
    """XLA's optimisations on, as users compile (the bitwise tests: the suite's unoptimised
    compiles are not bitwise across meshes), with an executable cache of their own; the suite's
    setting is restored after. Yields the cache."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    try:
        yield ExecutableCache(max_entries=max_entries)
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
        jax.clear_caches()


def skip_if_not_enough_devices(n: int) -> None:
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")


# The suite runs in two xdist workers, one test file at a time each (`--dist loadfile
# --no-loadscope-reorder`: without the flag, xdist hands files out by their number of tests, so
# the one-test files, some of the longest, ran last). Files are handed out in collection order,
# so the longest ones go first (call times per file, measured on 2 cores: experiments/RESULTS.md,
# "The suite's time"): otherwise a long file collected last runs alone at the end while the other
# worker idles.
LONGEST_FIRST = [
    "test_multiprocess.py",
    "test_bitwise_sweep.py",
    "test_readme.py",
    "test_verification.py",
    "test_optimized.py",
    "test_deterministic_zero.py",
    "test_api.py",
    "test_zero_train.py",
    "test_zero.py",
    "test_standby_baselines.py",
    "test_fault_schedules.py",
    "test_pipeline_recovery.py",
    "test_growth.py",
    "test_cli.py",
    "test_user_model.py",
    "test_supervise.py",
    "test_copies.py",
    "test_deterministic_memory.py",
    "test_pipeline.py",
    "test_trainer.py",
    "test_tensorboard.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True, scope="module")
def _collect_the_last_files_garbage():
    """Each test file starts with the garbage of the files before it collected: an xdist worker
    runs many files in one process, and executables held by uncollected cycles keep their memory
    mappings, which the standby's and the executable cache's `map_budget` count (measured: a
    worker passed 32,000 of its 65,530 mappings after half the suite)."""
    import gc

    gc.collect()
    yield
