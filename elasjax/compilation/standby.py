"""Standby executables: compile likely next plans in the background, before they are needed.

In JAX the analogue of a communicator is a mesh plus the executable compiled for it, and
compilation dominates reconfiguration time. A `StandbyCompiler` keeps one background thread that
compiles a queue of plans ahead of time; recovery asks for the plan it needs and, on a hit, skips
compilation entirely. The queue is replaced whenever the trainer's plan changes (the likely next
plans change with it); plans already compiled stay cached. A plan recovery needs jumps the
queue (`expedite`, `wait`); once recovery has planned, the rest of the queue is dropped.

The compile function is the foreground's (`executables.ExecutableCache.get`), so a standby executable
is exactly the executable recovery would otherwise build. Every candidate device set is its own
entry, but a plan whose program is already compiled for other devices only loads it with its own
device assignment (`executables.rebind`, a fraction of a compile): with `cheap`, the thread builds such
plans before the ones that need a compile, so that most candidates are covered early. Where
the compiles run in a worker process (`compile_worker`, `cancel`), a recovery ends a compile of
a program it does not need (`drop_queued`), so that its own build has the cores.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from ..core.counters import within_map_budget
from .worker import CompileCancelled


class StandbyCoverageWarning(UserWarning):
    """`standby.max_plans` leaves some likely failures without a standby executable."""


class StandbyCompiler:
    """Background compilation of plans; thread-safe `get` / `wait` / `submit` / `expedite`.

    `max_plans=None` keeps every plan of the latest `submit` (plus two more: the plan in use
    and a fast path); an int caps the queue and the cache, and `dropped` says how many
    submitted plans the cap left out."""

    STARTED_KEPT = 64

    def __init__(
        self,
        compile_fn: Callable[[Any], Any],
        max_plans: int | None = None,
        cheap: Callable[[Any], bool] | None = None,
        map_budget: float | None = None,
        cancel: Callable[[], bool] | None = None,
        shed: Callable[[float], bool] | None = None,
        order: Callable[[list], list] | None = None,
        held_s: Callable[[], float] | None = None,
        pace: float | None = None,
    ):
        """`cheap(plan)`: can `plan` be built now without an XLA compile (`executables.rebind`)?
        Such plans are built first; a plan made urgent (`expedite`, `wait`, `submit(front=)`)
        always comes before them. `map_budget`: the fraction of the process's memory-mapping
        limit (Linux `vm.max_map_count`) the process may use before background builds stop:
        every loaded CPU executable holds hundreds of mappings, and past the limit LLVM aborts
        the process. Over budget, ready plans no longer submitted are evicted first; then the
        rest of the queue is dropped and counted in `over_budget` (an urgent plan is still
        built). `cancel`: ends the build under way (the worker process it runs in), making
        `compile_fn` raise `CompileCancelled`; None where a build cannot be ended. `shed(budget)`:
        frees mappings held elsewhere for reuse (`ExecutableCache.shed`), asked over budget after
        the stale ready plans and before the queue is dropped. `order(plans)`: the queued
        plans that need a compile, in the order to take them (where processes share their
        compiles: `source.ExecutableSource.standby_order`); the queue's order without it.
        `held_s()`: seconds builds have been held stopped so far (`CompileWorker.pause` and its
        pace), left out of `compile_s`. `pace`: the cores a rebind (`cheap`, built on this
        thread) that nothing waits for may take on average: after one, the next build waits
        `seconds x (1 / pace - 1)` unless a plan is needed meanwhile (`CompileWorker`'s pace,
        for the builds of the training process; `resting_s` sums the waits)."""
        self.compile_fn, self.max_plans, self.cheap = compile_fn, max_plans, cheap
        self.held_s, self.pace = held_s, pace
        self.resting_s = 0.0
        self.order = order
        self.cancel_fn, self.shed_fn = cancel, shed
        self.cancelled = 0  # builds ended by `drop_queued`
        self._waiting: dict = {}  # plan -> callers blocked in `wait` for it
        self.map_budget = map_budget
        self.over_budget = 0  # queued plans dropped because the mapping budget was reached
        self._wanted: set = set()
        self._urgent: set = set()
        self._ready: OrderedDict = OrderedDict()
        self._queue: list = []
        self._busy: Any = None
        self._busy_since = 0.0
        self._busy_cheap = False
        self._busy_urgent = False  # the build under way was made urgent (`needed`)
        self._waiting_all = 0  # callers blocked in `wait_all`
        self._errors: dict = {}
        self._cv = threading.Condition()
        self._stop = False
        self._held = False  # no build starts (`hold`)
        self._capacity = max_plans or 2
        self.compiled = 0  # plans built by an XLA compile
        self.compile_s = 0.0
        self.rebound = 0  # plans built by loading a program compiled for other devices
        self.rebind_s = 0.0
        # plans loaded from a compile elsewhere: another process's (`shared.SharedBuilds`, under
        # launch; the seconds are then mostly the wait for it) or an earlier run's (`store`)
        self.loaded = 0
        self.load_s = 0.0
        self.dropped = 0  # plans of the latest `submit` left out by `max_plans`
        self.started: list = []  # the last STARTED_KEPT plans, in the order compiles started
        self._thread = threading.Thread(target=self._loop, name="elasjax-standby", daemon=True)
        self._thread.start()

    def submit(self, plans: Sequence[Any], *, front: bool = False) -> list:
        """Queue `plans` (deduplicated); with `front`, ahead of the rest, otherwise replacing
        the queue (at most `max_plans` when it is set: `dropped` counts the rest). Returns the
        plans this submission covers, in order: all of them, or the first `max_plans`."""
        with self._cv:
            plans = list(dict.fromkeys(plans))
            new = [p for p in plans if p not in self._ready and p != self._busy]
            if front:
                self._queue = new + [p for p in self._queue if p not in new]
                self._urgent |= set(new)
                self._wanted |= set(plans)
            else:
                self._wanted = set(plans)
                keep = plans if self.max_plans is None else plans[: self.max_plans]
                self.dropped = len(plans) - len(keep)
                if self.max_plans is None:
                    self._capacity = max(self._capacity, len(keep) + 2)
                self._queue = [p for p in new if p in keep]
                self._urgent &= set(self._queue)
                plans = keep
            self._cv.notify_all()
            return plans

    def expedite(self, plan) -> str:
        """Make `plan` the next compile. Returns where it was: "ready", "busy" (compiling now),
        "front" (it was queued and now comes next) or "absent" (neither: the caller compiles
        it). Nothing queued is compiled before an expedited plan."""
        with self._cv:
            if plan in self._ready:
                return "ready"
            if plan == self._busy:
                self._busy_urgent = True
                return "busy"
            if plan in self._queue:
                self._queue.remove(plan)
                self._queue.insert(0, plan)
                self._urgent.add(plan)
                self._cv.notify_all()  # a rest between builds ends (`_rest`)
                return "front"
            return "absent"

    def needed(self) -> bool:
        """Does the run need the build under way now: a caller waits for it (`wait`, or
        `wait_all` for every build), or it was made urgent (`expedite`, `submit(front=)`, a
        pending cut-over's plan)? A build nobody needs yet is one of the likely failures'
        plans, built beside the training steps (`CompileWorker` paces those)."""
        with self._cv:
            return self._busy is not None and (
                self._busy_urgent or self._waiting_all > 0 or self._busy in self._waiting
            )

    def take(self, plan) -> bool:
        """Remove `plan` from the queue (the caller compiles it itself); False if not queued."""
        with self._cv:
            if plan in self._queue:
                self._queue.remove(plan)
                self._urgent.discard(plan)
                return True
            return False

    @property
    def mean_compile_s(self) -> float:
        """Mean seconds of the background compiles so far (0 before the first)."""
        return self.compile_s / self.compiled if self.compiled else 0.0

    @property
    def mean_rebind_s(self) -> float:
        """Mean seconds of the background rebinds so far (0 before the first)."""
        return self.rebind_s / self.rebound if self.rebound else 0.0

    def busy(self) -> Any:
        """The plan being built now, or None."""
        with self._cv:
            return self._busy

    def busy_left_s(self) -> float | None:
        """Expected seconds until the build under way ends (the mean of the builds of its kind
        so far less its elapsed time; None when nothing builds or none of its kind has)."""
        with self._cv:
            if self._busy is None:
                return None
            n, total = (
                (self.rebound, self.rebind_s) if self._busy_cheap else (self.compiled, self.compile_s)
            )
            if not n:
                return None
            return max(total / n - (time.perf_counter() - self._busy_since), 0.0)

    def drop_queued(self, keep: Any = None, spare: Callable[[Any], bool] | None = None) -> int:
        """Drop every queued build but `keep` (a death is known: the cores go to recovery);
        returns how many were dropped. Where builds can be ended (`cancel`), the one under way
        is ended too unless it is `keep` or `spare(it)` (one the recovery will use); otherwise
        it finishes."""
        with self._cv:
            kept = [p for p in self._queue if p == keep]
            n, self._queue = len(self._queue) - len(kept), kept
            busy = self._busy
            if (
                self.cancel_fn is not None and busy is not None and busy != keep
                and not self._busy_cheap  # a rebind runs here, not in the worker
                and not (spare is not None and spare(busy)) and self.cancel_fn()
            ):
                self.cancelled += 1
            return n

    def cancel_busy(self, plan) -> bool:
        """End the build under way if it is `plan` and it can be ended (a compile in the
        worker); True if it was."""
        with self._cv:
            if (
                self.cancel_fn is None or self._busy != plan or self._busy_cheap
                or not self.cancel_fn()
            ):
                return False
            self.cancelled += 1
            return True

    def get(self, plan) -> Any | None:
        with self._cv:
            exe = self._ready.get(plan)
            if exe is not None:
                self._ready.move_to_end(plan)
            return exe

    def ready_values(self) -> list:
        """Every executable built so far (the kept ones)."""
        with self._cv:
            return list(self._ready.values())

    def ready_keys(self) -> list:
        """The plans built so far (the kept ones)."""
        with self._cv:
            return list(self._ready)

    def ready(self, plan) -> bool:
        with self._cv:
            return plan in self._ready

    def error(self, plan) -> BaseException | None:
        """The error of `plan`'s failed compile, if it failed (kept: `wait` still raises it)."""
        with self._cv:
            return self._errors.get(plan)

    def pending(self, plan) -> bool:
        """Is `plan` being compiled or queued?"""
        with self._cv:
            return plan == self._busy or plan in self._queue

    def wait_all(self, timeout: float | None = None) -> bool:
        """Block until the queue is empty and nothing compiles; True if so before `timeout`."""
        with self._cv:
            self._waiting_all += 1
            self._cv.notify_all()  # a rest between builds ends (`_rest`)
            try:
                return self._cv.wait_for(lambda: not self._queue and self._busy is None, timeout)
            finally:
                self._waiting_all -= 1

    def wait(self, plan, timeout: float | None = None) -> Any | None:
        """Block until `plan` is compiled (queueing it first if needed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            if plan not in self._ready and plan != self._busy:
                if plan in self._queue:  # a needed plan never waits in line
                    self._queue.remove(plan)
                self._queue.insert(0, plan)
                self._urgent.add(plan)
                self._cv.notify_all()
            self._waiting[plan] = self._waiting.get(plan, 0) + 1  # an ended build requeues it
            try:
                while plan not in self._ready:
                    if plan in self._errors:
                        raise self._errors.pop(plan)
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return None
                    self._cv.wait(left)
                return self._ready[plan]
            finally:
                self._waiting[plan] -= 1
                if not self._waiting[plan]:
                    del self._waiting[plan]

    def put(self, plan, exe) -> None:
        """Register an executable compiled elsewhere (the foreground)."""
        with self._cv:
            self._ready[plan] = exe
            self._trim()

    def _trim(self) -> None:
        while len(self._ready) > self._capacity:
            self._ready.popitem(last=False)

    def hold(self) -> None:
        """Start no build until `release` (a build under way goes on): a recovery's transfer,
        verification and first step come first. Never while a caller waits for a queued plan
        (`wait` would wait for the release)."""
        with self._cv:
            self._held = True

    def release(self) -> None:
        """Builds start again (`hold`)."""
        with self._cv:
            self._held = False
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: (self._queue and not self._held) or self._stop)
                if self._stop:
                    return
                queued = list(self._queue)
            # outside the lock: `order` may read the job's key-value store, and a recovery's
            # `expedite` must not wait on those reads
            ordered = self._ordered(queued)
            with self._cv:
                if self._stop:
                    return
                if not self._queue or self._held:
                    continue
                plan = self._next(ordered)
                if plan not in self._urgent and not self._within_budget():
                    self.over_budget += len(self._queue)
                    self._queue = []
                    self._cv.notify_all()
                    continue
                self._queue.remove(plan)
                urgent = plan in self._urgent
                self._urgent.discard(plan)
                cheap = self.cheap is not None and self.cheap(plan)
                self._busy, self._busy_since, self._busy_cheap = plan, time.perf_counter(), cheap
                self._busy_urgent = urgent
                self.started.append(plan)
                del self.started[: -self.STARTED_KEPT]
            t0, held0 = time.perf_counter(), self.held_s() if self.held_s else 0.0
            try:
                exe = self.compile_fn(plan)
                err = None
            except CompileCancelled:  # a recovery took the cores
                with self._cv:
                    self._busy = None
                    if plan in self._waiting:  # still waited for: build it next
                        self._queue.insert(0, plan)
                        self._urgent.add(plan)
                    self._cv.notify_all()
                continue
            except Exception as e:  # surfaced to whoever waits for this plan
                exe, err = None, e
            dt = time.perf_counter() - t0 - ((self.held_s() - held0) if self.held_s else 0.0)
            with self._cv:
                needed = self._busy_urgent or self._waiting_all > 0 or plan in self._waiting
                self._busy = None
                if err is None:
                    self._ready[plan] = exe
                    origin = getattr(exe, "origin", "compiled")
                    if origin in ("compiled", "cached"):
                        self.compiled += 1
                        self.compile_s += dt
                    elif origin in ("shared", "stored"):  # compiled elsewhere, loaded here
                        self.loaded += 1
                        self.load_s += dt
                    else:
                        self.rebound += 1
                        self.rebind_s += dt
                    self._trim()
                else:
                    self._errors[plan] = err
                self._cv.notify_all()
                if self.pace is not None and cheap and err is None and not needed:
                    self._rest(dt * (1.0 / self.pace - 1.0))

    def _rest(self, seconds: float) -> None:
        """Under the lock: wait `seconds` before the next build, or until a queued plan is
        needed (`wait`, `wait_all`, `expedite`) or the compiler stops (`pace`)."""
        t0 = time.perf_counter()
        self._cv.wait_for(lambda: self._stop or self._waiting_all > 0 or bool(self._urgent)
                          or any(p in self._waiting for p in self._queue), seconds)
        self.resting_s += time.perf_counter() - t0

    def _within_budget(self) -> bool:
        """Under the lock: is the process within `map_budget` of its mapping limit, after
        evicting ready plans that are no longer submitted if needed?"""
        if self.map_budget is None:
            return True
        collect = True  # garbage collected once, at the first check
        while not within_map_budget(self.map_budget, collect):
            collect = False
            stale = [p for p in self._ready if p not in self._wanted]
            if not stale:  # (without a cache to shed: one more collection, for the dropped)
                return (self.shed_fn or within_map_budget)(self.map_budget)
            self._ready.pop(stale[0])
        return True

    def _ordered(self, queued: list) -> list:
        """`queued` in `order`'s order; [] without one (or where it fails: an order is a
        preference, never in the way)."""
        if self.order is None or len(queued) < 2:
            return []
        try:
            return list(self.order(queued))
        except Exception:  # noqa: BLE001
            return []

    def _next(self, ordered: list) -> Any:
        """The plan to build next (under the lock): the first urgent one, else the first that
        builds without a compile, else the first of `ordered` (`_ordered`, taken just before)
        still queued, else the first queued."""
        for p in self._queue:
            if p in self._urgent:
                return p
        if self.cheap is not None:
            for p in self._queue:
                if self.cheap(p):
                    return p
        for p in ordered:
            if p in self._queue:
                return p
        return self._queue[0]

    def close(self, wait_s: float = 60.0) -> None:
        """Stop: nothing more is built; the thread is waited for up to `wait_s` (a build under
        way in this process, a plan's checksums say, cannot be cancelled). A process that
        ends with `os._exit` (launch's workers) passes 0: waiting held a finished survivor
        past the launcher's grace (docs/limits.md, "A finished survivor held at exit")."""
        with self._cv:
            self._stop = True
            self._queue = []
            self._cv.notify_all()
        if wait_s > 0:
            self._thread.join(timeout=wait_s)


class BackgroundJobs:
    """One daemon thread that runs queued jobs in order (the trainer's transfer-plan
    preparation). `replace` drops the jobs that have not started; a job that raises is counted
    and recorded in `errors`, never surfaced: its only effect would have been a cache entry."""

    def __init__(self, name: str = "elasjax-jobs"):
        self._queue: list[Callable[[], Any]] = []
        self._busy = False
        self._stop = False
        self._cv = threading.Condition()
        self.done = 0
        self.seconds = 0.0
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def replace(self, jobs: Sequence[Callable[[], Any]]) -> None:
        with self._cv:
            self._queue = list(jobs)
            self._cv.notify_all()

    def add(self, jobs: Sequence[Callable[[], Any]]) -> None:
        with self._cv:
            self._queue += list(jobs)
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running; True if so before `timeout`."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _loop(self) -> None:
        _lower_priority()  # the training thread comes first
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    return
                job = self._queue.pop(0)
                self._busy = True
            t0 = time.perf_counter()
            try:
                job()
                err = None
            except Exception as e:  # noqa: BLE001 - recorded; recovery plans again if needed
                err = f"{type(e).__name__}: {e}"
            with self._cv:
                self._busy = False
                self.done += 1
                self.seconds += time.perf_counter() - t0
                if err is not None:
                    self.errors.append(err)
                self._cv.notify_all()

    def close(self, wait_s: float = 60.0) -> None:
        """Stop: nothing more is built; the thread is waited for up to `wait_s` (a build under
        way in this process, a plan's checksums say, cannot be cancelled). A process that
        ends with `os._exit` (launch's workers) passes 0: waiting held a finished survivor
        past the launcher's grace (docs/limits.md, "A finished survivor held at exit")."""
        with self._cv:
            self._stop = True
            self._queue = []
            self._cv.notify_all()
        if wait_s > 0:
            self._thread.join(timeout=wait_s)


def _lower_priority(nice: int = 10) -> None:
    """Lower this thread's CPU priority (Linux: threads have their own nice value), so that
    background work yields the cores to the training thread and XLA's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass
