"""A user's hook that fails the run (`--hook user_failing_hook:fail`): in process 0 it raises
once step `$ELASJAX_TEST_FAIL_STEP` is logged, in every run it is given, so that a supervised
launch meets the same error after each restart (tests/test_supervise.py)."""

import os

from elasjax import StepInfo


def fail(x) -> None:
    step = int(os.environ["ELASJAX_TEST_FAIL_STEP"])
    if isinstance(x, StepInfo) and x.process == 0 and x.step == step:
        raise RuntimeError(f"user_failing_hook: process 0 fails after step {step}, on purpose")
