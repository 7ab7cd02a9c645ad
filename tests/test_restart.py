"""The measured restart (`elasjax.bench.restart`): a fresh process restores a checkpoint onto the
survivors' plan and runs the checkpoint's step with the fault-free run's loss."""

import math

import pytest
from conftest import skip_if_not_enough_devices, tiny_config

from elasjax.loop import trainer
from elasjax.bench import restart


@pytest.mark.slow
def test_restart_process_restores_and_reproduces_the_step(tmp_path, exe_cache):
    skip_if_not_enough_devices(8)
    cfg = tiny_config(
        "train.steps=4",
        "faults=[]",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.every=2",
    )
    ref = trainer.run(cfg, exe_cache=exe_cache)  # checkpoints after steps 0, 2 and 4 (keep 2)
    timing = restart.measure_restart(
        cfg, failed=[3], step=2, env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}, timeout_s=240
    )
    assert list(timing.phases) == list(restart.PHASES)
    assert all(v > 0 for v in timing.phases.values()), timing.phases  # each phase was timed
    assert timing.phases["compile"] > 0 and timing.phases["restore"] > 0
    # the parent's spawn-to-result time covers every phase the child measured
    assert timing.total_s >= sum(timing.phases.values()) - 1e-3
    assert timing.exit_s >= timing.total_s
    assert 3 not in timing.devices and timing.checkpoint_step == 2
    # same samples, same keys, state restored bit for bit: the loss of step 2 agrees with the
    # fault-free run to f32 reduction order (ARCHITECTURE.md, rule 3: relative 1e-5)
    assert math.isclose(timing.loss, ref.losses[2], rel_tol=1e-5)


def test_restart_refuses_a_config_without_a_checkpoint():
    with pytest.raises(ValueError, match="checkpoint.dir"):
        restart.measure_restart(tiny_config(), failed=[3])


@pytest.mark.slow
def test_a_restart_process_that_fails_is_a_restart_error_with_its_stderr(tmp_path):
    """The child finds no checkpoint in the directory it is given: `RestartError` says how it
    ended and quotes the end of its stderr, the child's one-line reason."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = tiny_config("train.steps=4", "faults=[]", f"checkpoint.dir={empty}")
    with pytest.raises(restart.RestartError, match=(
            r"restart process reported no result; its stderr ends with:\nrestart: error: config "
            r"'checkpoint.resume_step' = 2: no checkpoint 2 in .*empty \(it holds no committed "
            r"checkpoint\)")):
        restart.measure_restart(cfg, failed=[3], step=2, timeout_s=240,
                                env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"})
