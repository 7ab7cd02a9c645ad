"""A user's hook that fails the run (`--hook user_failing_hook:fail`): in every process it raises
once step `$ELASJAX_TEST_FAIL_STEP` is logged, in every run it is given, so that a supervised
launch meets the same error after each restart (tests/test_supervise.py). (A hook raising in one
process only ends that process, which the others survive as a death.)"""

import os

from elasjax import StepInfo


def fail(x) -> None:
    step = int(os.environ["ELASJAX_TEST_FAIL_STEP"])
    if isinstance(x, StepInfo) and x.step == step:
        raise RuntimeError(f"user_failing_hook: process {x.process} fails after step {step}, "
                           "on purpose")
