"""The one JAX setting elasjax's runtimes need: synchronous dispatch on the CPU backend.

XLA:CPU runs independent executions at once, and two in flight whose collectives span many
devices can deadlock its in-process rendezvous, each holding device threads the other waits for
(XLA:CPU reports "Termination timeout ... only 5 of 7 arrived" and the process aborts; a
7-device train step dispatched twice on one input shows it, and with synchronous dispatch the
same program completes: experiments/RESULTS.md, "Figures moved from code comments"). The
trainer's executions form one chain almost always; an evaluation or checksum beside the next
step does not. The setting (`jax_cpu_enable_async_dispatch = False`) is read
when JAX's CPU client starts and changes nothing on other backends.

Importing elasjax changes no JAX setting. A runtime sets this one when it starts, if JAX's
backends have not started yet, and says so (`require_sync_cpu_dispatch`); a program that touches
devices before (a user's mesh for `ElasticState`, a test suite) sets it itself, first:

    jax.config.update("jax_cpu_enable_async_dispatch", False)
"""

from __future__ import annotations

import warnings

import jax

from ..core import jaxcompat

SETTING = "jax_cpu_enable_async_dispatch"


class AsyncDispatchWarning(UserWarning):
    """JAX's CPU client started with asynchronous dispatch before elasjax could turn it off."""


def require_sync_cpu_dispatch(who: str) -> str:
    """Make CPU dispatch synchronous for `who` (a runtime starting). Returns what was done:
    `"already"` (the setting was off), `"set"` (turned off now, before JAX's backends started),
    or `"too late"` (the backends started with it on: an `AsyncDispatchWarning` says what to
    do; on the CPU backend two collective executions in flight may then deadlock)."""
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
