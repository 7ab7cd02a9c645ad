"""The one JAX setting elasjax's runtimes need: synchronous dispatch on the CPU backend.

XLA:CPU runs independent executions at once, and two in flight whose collectives span many
devices can deadlock its in-process rendezvous, each holding device threads the other waits for
(XLA:CPU reports "Termination timeout ... only 5 of 7 arrived" and the process aborts; a
7-device train step dispatched twice on one input shows it, and with synchronous dispatch the
same program completes: experiments/RESULTS.md, "Figures moved from code comments"). The
trainer's executions form one chain almost always; an evaluation or checksum beside the next
step does not. The setting (`jax_cpu_enable_async_dispatch = False`) is read
when JAX's CPU client starts and changes nothing on other backends.

XLA:CPU has a second deadlock of the same kind inside one execution: its concurrency-optimised
scheduler lets each rank run two independent collectives at once, and when the ranks that
arrived hold every thread of its pool the others never start (8 threads waiting, ranks 0-1 at
one all-reduce and 0-5 at the other; examples/classifier_loop.py aborted in 5 of 15 runs on jax
0.12 and in none of 16 with that scheduler off: experiments/RESULTS.md, "The newest-JAX smoke's
deadlock again"). jaxlib 0.10's XLA:CPU has it too: the pipeline demo's deterministic run with
two failures aborted after its first step ("Termination timeout for all reduce ... of 40
seconds", the other ranks in a collective permute of the same execution) and ran to the end
with the scheduler off (experiments/RESULTS.md, "The pipeline demo's abort on jax 0.10.2"). A
runtime that starts before JAX's backends therefore turns that scheduler off on every jaxlib
elasjax supports (`SERIAL_COLLECTIVES_FLAG` in `XLA_FLAGS`, unless the user set it; the flag
exists from jaxlib 0.10 on).

Importing elasjax changes no JAX setting. A runtime sets this one when it starts, if JAX's
backends have not started yet, and says so (`require_sync_cpu_dispatch`); a program that touches
devices before (a user's mesh for `ElasticState`, a test suite) sets it itself, first:

    jax.config.update("jax_cpu_enable_async_dispatch", False)
"""

from __future__ import annotations

import os
import warnings
from importlib.metadata import PackageNotFoundError, version

import jax

from ..core import jaxcompat

SETTING = "jax_cpu_enable_async_dispatch"


class AsyncDispatchWarning(UserWarning):
    """JAX's CPU client started with asynchronous dispatch before elasjax could turn it off."""


SERIAL_COLLECTIVES_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _scheduler_runs_collectives_at_once() -> bool:
    """Is this jaxlib's XLA:CPU one whose scheduler may run a rank's collectives at once, and
    which knows `SERIAL_COLLECTIVES_FLAG` (0.10 on: an unknown flag aborts XLA at start)?"""
    try:
        major, minor = (int(x) for x in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (0, 10)


def order_cpu_collectives() -> bool:
    """Before JAX's backends start, on a jaxlib whose XLA:CPU needs it: add
    `SERIAL_COLLECTIVES_FLAG` to `XLA_FLAGS` (the module docstring says why), unless the user
    set that flag either way. Returns whether it was added."""
    flags = os.environ.get("XLA_FLAGS", "")
    if (not _scheduler_runs_collectives_at_once() or SERIAL_COLLECTIVES_FLAG.split("=")[0] in flags
            or jaxcompat.backends_initialized() is not False):
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {SERIAL_COLLECTIVES_FLAG}".strip()
    return True


def require_sync_cpu_dispatch(who: str) -> str:
    """Make CPU dispatch synchronous for `who` (a runtime starting). Returns what was done:
    `"already"` (the setting was off), `"set"` (turned off now, before JAX's backends started),
    or `"too late"` (the backends started with it on: an `AsyncDispatchWarning` says what to
    do; on the CPU backend two collective executions in flight may then deadlock). Before the
    backends start it also orders a rank's collectives where XLA:CPU needs it
    (`order_cpu_collectives`)."""
    order_cpu_collectives()
    if not jax.config.read(SETTING):
        return "already"
    if jaxcompat.backends_initialized() is False:
        jax.config.update(SETTING, False)
        return "set"
    if jax.default_backend() != "cpu":
        return "already"  # the setting is the CPU backend's only
    warnings.warn(
        f"{who}: JAX's CPU client started with asynchronous dispatch, which can deadlock "
        "elasjax's multi-device executions on XLA:CPU (two collectives in flight); run "
        f'jax.config.update("{SETTING}", False) before the first use of any device '
        "(elasjax.runtime.dispatch)",
        AsyncDispatchWarning, stacklevel=3,
    )
    return "too late"
