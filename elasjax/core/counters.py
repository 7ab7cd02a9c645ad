"""What the process compiles and maps: a counter of XLA compilations on one thread (to prove that
a recovery compiled nothing) and the share of the memory-mapping limit in use (loaded
executables map memory)."""

from __future__ import annotations

import contextlib
import gc
import threading

import jax
import jax.monitoring


def map_usage() -> float | None:
    """The fraction of this process's memory-mapping limit in use (Linux; None elsewhere)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return used / limit if limit > 0 else None


def within_map_budget(budget: float, collect: bool = True) -> bool:
    """Is this process within `budget` (a fraction) of its memory-mapping limit? Where it is not,
    garbage is collected (unless `collect` is False) and the use measured again: executables of
    ended runs held only by reference cycles keep their mappings until a collection, and are not
    in use (tests/test_standby_baselines.py::test_garbage_executables_do_not_count_against_the_mapping_budget).
    A full collection of a large heap takes up to a second: a caller that frees mappings in a
    loop collects once, not at every turn. Never while the collector is held (`gc.disable`: a
    recovery holds it until its first good step, tests/test_trainer.py::
    test_no_garbage_collection_runs_from_a_failure_to_its_first_good_step).
    True where the platform does not say."""
    usage = map_usage()
    if usage is None or usage <= budget:
        return True
    if not (collect and gc.isenabled()):
        return False
    gc.collect()
    usage = map_usage()
    return usage is None or usage <= budget


# helper thread -> the thread it compiles for (`on_behalf_of`): a compile split over threads
# (`executables.compile_plan`) still counts as its caller's
_ON_BEHALF: dict[int, int] = {}


@contextlib.contextmanager
def on_behalf_of(thread_id: int):
    """Within it, this thread's compiles count as thread `thread_id`'s (`CompileCounter`)."""
    me = threading.get_ident()
    _ON_BEHALF[me] = thread_id
    try:
        yield
    finally:
        _ON_BEHALF.pop(me, None)


class CompileCounter:
    """Counts XLA backend compilations made on one thread (JAX's monitoring events), and on the
    threads that compile for it (`on_behalf_of`), so that a recovery can prove it compiled
    nothing. Use as a context manager; `count` is live."""

    EVENT = "/jax/core/compile/backend_compile_duration"
    # recorded only when JAX's persistent compilation cache served an executable (loaded, not
    # compiled): count these with `CompileCounter(event=CompileCounter.CACHE_HIT)`
    CACHE_HIT = "/jax/compilation_cache/cache_retrieval_time_sec"

    def __init__(self, thread: threading.Thread | None = None, event: str = EVENT):
        self.thread_id = (thread or threading.current_thread()).ident
        self.event = event
        self.count = 0
        self.seconds = 0.0

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        me = threading.get_ident()
        if event == self.event and _ON_BEHALF.get(me, me) == self.thread_id:
            self.count += 1
            self.seconds += duration

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)
