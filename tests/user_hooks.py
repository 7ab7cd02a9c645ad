"""A user's hook for the tests (`--hook user_hooks:count`): counts the steps and recoveries
this process sees, from the run's `start` event to its `end` event, and writes them to
`$ELASJAX_TEST_HOOK_OUT/hook-<pid>.json` at the end (if that variable is set)."""

import json
import os
from pathlib import Path

from elasjax import Event, StepInfo

COUNTS: dict = {}


def count(x) -> None:
    if isinstance(x, StepInfo):
        COUNTS["steps"].append(x.step)
        COUNTS["process"] = x.process
    elif isinstance(x, Event):
        if x.type == "start":
            COUNTS.clear()
            COUNTS.update(steps=[], recoveries=0, events=[])
        COUNTS["events"].append(x.type)
        if x.type == "recovery":
            COUNTS["recoveries"] += 1
            assert x.record is not None and x.record.step == x.fields["step"]
        if x.type == "end" and os.environ.get("ELASJAX_TEST_HOOK_OUT"):
            out = Path(os.environ["ELASJAX_TEST_HOOK_OUT"]) / f"hook-{os.getpid()}.json"
            out.write_text(json.dumps(COUNTS))
    else:
        raise TypeError(f"a hook got {type(x).__name__}")
