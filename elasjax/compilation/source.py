"""Where a plan's executables come from: the standby set (built ahead on a thread, or in a
compile worker process), a background compile already under way, the executable cache, or a
compile now. A needed plan never waits in line behind one that is not needed (`get`)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable

import jax

from ..config import Config, ConfigError
from ..layout.state import StateFactory
from ..plan.planner import Plan
from .executables import (
    REBINDABLE, ExecutableCache, Executables, can_load, from_portable, on_devices, warm_up,
)
from .shared import SharedBuilds
from .standby import StandbyCompiler, StandbyCoverageWarning
from .store import ProgramStore
from .worker import CompileWorker


@dataclasses.dataclass(frozen=True)
class Acquired:
    """A plan's executables as `ExecutableSource.get` found them."""

    exe: Executables
    hit: bool  # already compiled in this process
    standby_hit: bool  # ready in the standby when asked for
    wait_s: float  # seconds waited for a background compile


class ExecutableSource:
    """A run's executables. `background`: keep a standby compiler (standby plans, async
    migration's optimal plan, growth); `prepare`: called with each standby-built executable
    (the snapshot pool compiles its checksums for that plan); `log`: the runtime's log;
    `shared`: where the job's processes compile each program once (`shared.SharedBuilds`,
    under `elasjax launch`), None where this process compiles what it needs; `no_worker`: why
    no compile worker process can build this run's plans (`worker.unavailable`, decided once
    by the caller, whose `standby.enabled: auto` reads it too), None where one can."""

    # a queued needed plan waits for the compile under way unless that has more than this
    # fraction of a mean compile left; beyond it, a cold compile now is sooner
    WAIT_BEHIND = 0.25
    # a needed plan (or its program) compiling in the worker is waited for only once the worker
    # has spent this fraction of a compile's CPU time on it; before, it is ended and the plan
    # compiled here with every core, sooner than the rest of a compile at low priority plus the
    # load (a child sharing the cores with training may have barely started)
    WORKER_WAIT_PROGRESS = 0.25

    def __init__(self, cfg: Config, factory: StateFactory, devices, exe_cache: ExecutableCache,
                 *, donate: bool, background: bool,
                 prepare: Callable[[Executables], None], log: Callable[[str], None],
                 no_worker: str | None, shared: SharedBuilds | None = None):
        self.cfg, self.factory, self.devices, self.exe_cache = cfg, factory, devices, exe_cache
        self.shared = shared
        # the job's processes compile each program once (under `elasjax launch`): builds are
        # never ended, the standby takes plans in the job's order
        self.shares = shared is not None
        self.store = ProgramStore.from_setting(cfg.standby.programs_dir, cfg.standby.programs_max_mb)
        self.donate, self._prepare, self._log = donate, prepare, log
        self.errors: list[str] = []  # standby compiles that failed while a recovery waited
        # each plan's name in the job's shared builds (a digest of the config's repr: computed
        # once, not at every pick of `standby_order`)
        self._shared_keys: dict[tuple[Plan, bool], str] = {}
        self.first_compile_cpu_s = 0.0  # CPU seconds of the start's compile (0: none here)
        self.warmed_between_steps = 0  # standby executables warmed by `warm_built`
        self._warm_failed: set[int] = set()
        self.worker: CompileWorker | None = None
        self._worker_held = False  # stopped by `hold_background`
        self.standby: StandbyCompiler | None = None
        if not background:
            return
        if cfg.standby.compiler != "thread":
            why = no_worker
            if why is None:
                # at normal priority (`CompileWorker` says why); under launch the job's
                # other processes wait for what it compiles, and another process's compile at
                # nice 0 did not stall the launch's steps (experiments/RESULTS.md, "A compile on
                # a training process's thread stalls the job's steps")
                self.worker = CompileWorker(
                    cfg, needed=lambda: self.standby is not None and self.standby.needed())
            elif cfg.standby.compiler == "process":
                raise ConfigError(
                    f"config 'standby.compiler' = process: {why}; allowed values here: thread, auto"
                )
        self.standby = StandbyCompiler(
            self._standby_build,
            max_plans=cfg.standby.max_plans,
            cheap=self.rebindable,
            map_budget=cfg.standby.map_budget,
            # never under launch: a build ended there would leave the processes waiting for
            # its program to compile it each for itself (`SharedBuilds.build`)
            cancel=self.worker.kill if self.worker is not None and not self.shares else None,
            shed=self.exe_cache.shed,
            order=self.standby_order if self.shares else None,
            held_s=(lambda: self.worker.stopped_s + self.worker.paced_s)
            if self.worker is not None else None,
            # the worker's pace for the rebinds this process builds beside the steps
            pace=self.worker.pace_rate if self.worker is not None else None,
        )

    def hold_background(self) -> None:
        """From a recovery's executables to its first good step, background builds wait: the
        standby starts none (`StandbyCompiler.hold`) and the compile worker's compile under way
        is stopped (`CompileWorker.pause`). Why: beside a recovery's first step, a program
        loaded or compiled in the background took the cores from it (under launch the demo's
        first step after a kill 1.68 s against a pace of 0.06-0.14 s: experiments/RESULTS.md,
        "gloo's event loop spins"). Call it only once the recovery holds its executables: a
        build it waits for would never start."""
        if self.standby is not None:
            self.standby.hold()
        if self.worker is not None and not self._worker_held:
            self._worker_held = self.worker.pause()

    def release_background(self) -> None:
        """Background builds go on (`hold_background`)."""
        if self.standby is not None:
            self.standby.release()
        if self._worker_held:
            self._worker_held = False
            self.worker.resume()

    # -- getting a plan's executables -----------------------------------------------------------

    def start(self, plan: Plan, *, init: bool = False) -> Executables:
        """The start plan's executables; what a cold compile of it cost in CPU time is what
        `_worker_early` measures a worker's compile against when the worker has finished none
        (not a load from the store or another process: far shorter than a compile). With `init`
        (a fresh start), where the job's processes share their compiles, the process that
        compiles the plan compiles the fresh state's program too and publishes it with the
        plan's, and the others load it (`Executables.compile_init`): each process compiled it
        for itself, the start's second compile (the tiny suite model's: 2.0 s in each of 4
        processes, experiments/RESULTS.md, "The suite's time")."""
        cpu0 = time.process_time()
        got = self.get(plan, init=init, evaluate=True)
        if not got.hit and got.exe.origin == "compiled":
            self.first_compile_cpu_s = time.process_time() - cpu0
        return got.exe

    def get(self, plan: Plan, *, hold: bool = False, init: bool = False,
            evaluate: bool = False) -> Acquired:
        """The plan's executables, and how they were found (`Acquired`); with `hold` (a
        recovery's), background builds wait from the moment they are found built (before a
        reload onto a renewed client) until `release_background`. A standby hit means
        the executable was ready when asked for. A
        needed plan never waits in line: a queued one jumps to the front, or is built here when
        the build under way would take longer than `WAIT_BEHIND` of building it here; with
        `standby.rebind`, when the compile under way is of its program (for other devices),
        that compile is waited for and the plan loaded from it (`executables.rebind`). Either
        compile, when it runs in the compile worker and has not got far
        (`WORKER_WAIT_PROGRESS`), is ended instead and the plan compiled here. A plan built
        here compiles its evaluation with it only with `evaluate` (the start's; a recovery's
        leaves it to its first evaluation, `executables.compile_plan`)."""
        sb, rebind = self.standby, self.cfg.standby.rebind
        if sb is not None:
            key = plan.compile_key
            exe = sb.get(key)
            if exe is not None:
                if hold:
                    self.hold_background()
                return Acquired(self.current(exe, key), True, True, 0.0)
            where = sb.expedite(key)
            busy = sb.busy()
            if busy is not None and (
                busy == key or (rebind and busy.shape_key == key.shape_key)
            ) and self._worker_early():
                took = where == "front" and sb.take(key)  # first: never built twice
                if sb.cancel_busy(busy) or took:
                    busy, where = None, "absent"  # built here
            if (
                rebind and busy is not None and busy != key
                and busy.shape_key == key.shape_key and not self.rebindable(key)
                and (where != "front" or sb.take(key))
            ):  # its program is compiling now for other devices: wait for that, then load it
                t0 = time.perf_counter()
                try:
                    sb.wait(busy)
                except Exception as e:  # noqa: BLE001 - any compile error: recorded, then
                    # compiled here, where an error that recurs is raised
                    self.errors.append(f"{busy.name}: {type(e).__name__}: {e}")
                wait_s = time.perf_counter() - t0
                return Acquired(*self._cached(plan, init=init), False, wait_s)
            left = sb.busy_left_s()
            # building it here: a rebind where its program is compiled, else a compile
            here_s = sb.mean_rebind_s if self.rebindable(key) else sb.mean_compile_s
            long_wait = left is not None and left > self.WAIT_BEHIND * here_s
            # `take` fails if the thread started it meanwhile: then it is waited for, never
            # compiled twice (with a compile worker, whose compile of another program
            # `drop_queued` ended, a queued plan is built here at once: the worker would start
            # afresh, beside training)
            cold = where == "absent" or (
                where == "front" and (long_wait or self.worker is not None) and sb.take(key)
            )
            if not cold:
                t0 = time.perf_counter()
                exe = self.current(sb.wait(key), key)
                return Acquired(exe, False, False, time.perf_counter() - t0)
        return self._cold(plan, init=init, evaluate=evaluate)

    def _cold(self, plan: Plan, *, init: bool = False, evaluate: bool = False) -> Acquired:
        """`plan` built now, not by the standby: compiled on this thread, or loaded from the
        process of the job that compiles it. Under launch the compile worker's compile under
        way, if any, is of another plan (this one was taken from the standby's queue, so the
        worker will not start it) and cannot be ended there (`shares`): it is stopped meanwhile
        (`CompileWorker.pause`), so that the needed compile has the cores."""
        paused = self.shares and self.worker is not None and self.worker.pause()
        if paused:  # a worker exists only beside a standby, whose build it runs
            busy = self.standby.busy()
            self._log(f"stopped the compile worker's compile of {getattr(busy, 'name', busy)} "
                      f"while {plan.name} is built (it continues after)")
        try:
            return Acquired(*self._cached(plan, init=init, evaluate=evaluate), False, 0.0)
        finally:
            if paused:
                self.worker.resume()

    def _cached(self, plan: Plan, compile: Callable[[], Executables] | None = None, *,
                init: bool = False, evaluate: bool = False) -> tuple[Executables, bool]:
        """`plan`'s executables from the cache, else built (`_build`), by `compile` where
        given (a compile worker's) instead of a compile here; with `init`, shared with the
        fresh state's program (`start`); with `evaluate`, a compile here compiles the
        evaluation too (`executables.compile_plan`)."""
        return self.exe_cache.get(
            self.cfg, self.factory, plan, self.devices, donate=self.donate,
            reuse_programs=self.cfg.standby.rebind, build=self._build(plan, compile, init),
            store=self.store, evaluate=evaluate, init=init,
        )

    def _shared_key(self, plan: Plan) -> str:
        """`plan`'s name in the job's shared builds: its program's (`Plan.shape_key`) where
        programs load onto any device set of their shape (`standby.rebind` on a backend of
        `executables.REBINDABLE`: the payload is loaded position for position onto the plan's
        devices), so that one compile serves every process and every device set of that shape;
        else the plan's own."""
        k = (plan, self.donate)
        if k not in self._shared_keys:
            self._shared_keys[k] = self.shared.key(self.cfg, ExecutableCache.key(
                self.cfg, self._program(plan), self.donate, self.factory.tx_key))
        return self._shared_keys[k]

    def _by_program(self, plan: Plan) -> bool:
        """Are the job's shared builds named by program (`_shared_key`)? Only where a compiled
        program can be loaded for other devices: `standby.rebind` on a backend of
        `executables.REBINDABLE`, with JAX's executable loader (`can_load`; without it every
        plan compiles, and the start line's count says so)."""
        return (self.cfg.standby.rebind and can_load()
                and self.devices[plan.device_ids[0]].client.platform in REBINDABLE)

    def _program(self, plan: Plan) -> Plan:
        """What builds `plan`: its program (`Plan.shape_key`) where a compiled program is loaded
        for the other device sets of its shape (`_by_program`), else `plan` itself."""
        return plan.shape_key if self._by_program(plan) else plan

    def programs(self, plans: list) -> int:
        """How many programs `plans` need built (`_program`): what the start line announces
        (`report.standby_line`)."""
        return len({self._program(p) for p in plans})

    def standby_order(self, plans: list) -> list:
        """Where the job's processes share their compiles (`shared`), the order in which this
        process's standby takes the plans that need a compile, so that the processes build
        different plans side by side rather than all waiting on the first one's compiler: those
        another process has published (a load), then those nobody builds yet, first the ones
        this process takes part in, rotated by its index so that processes start on different
        plans, then the ones it does not (its own death's: a compile it would lose with
        itself), and last those another live process is compiling (waited for and loaded when
        nothing else is left) (tests/test_shared_builds.py). Where the builds are named by
        program (`_by_program`), a compile serves every device set, its own death's too: those
        nobody builds are taken in the queue's order, the plans of one more failure before
        those of two (`standby.depth`), each process taking the first one no other has."""
        me = jax.process_index()
        here = {d.id for d in jax.local_devices()}
        by_program = bool(plans) and self._by_program(plans[0])
        published, mine, others, claimed = [], [], [], []
        for p in plans:
            state = self.shared.state(self._shared_key(p))
            if state == "published":
                published.append(p)
            elif state == "claimed":
                claimed.append(p)
            else:
                (mine if by_program or here & set(p.device_ids) else others).append(p)
        k = me % len(mine) if mine and not by_program else 0
        return published + mine[k:] + mine[:k] + others + claimed

    def _build(self, plan: Plan, compile: Callable[[], Executables] | None = None,
               init: bool = False):
        """How `plan` is compiled where it must be: through the job's shared builds (`shared`)
        where there are some, else None (compiled here, or by `compile` where given). With
        `init`, the shared build's compile compiles the fresh state's program too, before it
        publishes (`Executables.portable` then carries it)."""
        sh = self.shared
        if sh is None:
            return None if compile is None else lambda here: compile()
        key = self._shared_key(plan)

        def load(portable, compile_s: float) -> Executables:
            return from_portable(self.cfg, self.factory, plan, self.devices, portable, compile_s)

        def built(here: Callable[[], Executables]) -> Executables:
            exe = (compile or here)()
            if init:
                exe.compile_init()
            return exe

        return lambda here: sh.build(key, plan.name, lambda: built(here), load)

    def _worker_early(self) -> bool:
        """Has the compile worker spent less than `WORKER_WAIT_PROGRESS` of a compile's CPU
        time (its finished compiles' mean, else this process's first compile) on the compile
        under way? False when nothing says, and under launch, where a shared compile is never
        ended (the plan would be compiled here beside it: two compiles of one program in the
        rejoin launch of experiments/RESULTS.md, "A compile on a training process's thread
        stalls the job's steps")."""
        progress = (self.worker.progress()
                    if self.worker is not None and not self.shares else None)
        if progress is None:
            return False
        spent, full = progress
        full = full or self.first_compile_cpu_s
        return full > 0 and spent < self.WORKER_WAIT_PROGRESS * full

    def rebindable(self, plan: Plan) -> bool:
        """Can `plan` be built without compiling (its program is compiled for other devices)?"""
        return self.cfg.standby.rebind and self.exe_cache.program(
            self.cfg, plan, self.donate, self.factory.tx_key) is not None

    def current(self, exe: Executables, key) -> Executables:
        """A standby executable on the current client: reloaded (`executables.rehome`, no
        compile) when the CPU client was renewed after it was built, and kept so (built again
        where it cannot be reloaded: one that JAX's persistent cache loaded, which serves it
        again)."""
        now = on_devices(exe, self.devices)
        if now is None:
            now = self._cached(exe.plan, evaluate=True)[0]
        if now is not exe:
            self.standby.put(key, now)
        return now

    def compiled(self, plan: Plan) -> Executables | None:
        """`plan`'s executables where this process holds them built (the standby's or the
        cache's), as built; None otherwise. Never compiles."""
        if self.standby is not None:
            exe = self.standby.get(plan.compile_key)
            if exe is not None:
                return exe
        if self.exe_cache.has(self.cfg, plan, self.donate, self.factory.tx_key):
            return self._cached(plan)[0]
        return None

    def adopt(self, exe: Executables) -> None:
        """Executables built elsewhere (shipped to a rejoining process: `admission`): cached and
        ready, as a standby build is."""
        self.exe_cache.put(self.cfg, exe.plan, exe, self.donate, self.factory.tx_key)
        self._prepare(exe)
        if self.standby is not None:
            self.standby.put(exe.plan.compile_key, exe)

    def ready(self, plan: Plan) -> Executables:
        """A plan the standby reports ready, on the current client."""
        return self.current(self.standby.get(plan.compile_key), plan.compile_key)

    # -- the standby set ------------------------------------------------------------------------

    def refresh(self, plan: Plan, keys: list) -> list:
        """Build `keys` (the plans `plan`'s likely failures need) in the background, dropping
        what was queued for the plan before; warns when `standby.max_plans` leaves some out.
        Returns the keys the standby builds (none without a standby)."""
        sb = self.standby
        if sb is None:
            return []
        kept = sb.submit(keys)
        if sb.dropped:
            msg = (
                f"standby.max_plans={sb.max_plans} covers {len(keys) - sb.dropped} of the "
                f"{len(keys)} plans of {plan.name}'s likely failures (every single device and "
                "host); the others compile when they are needed (unset max_plans to cover all)"
            )
            self._log(msg)
            warnings.warn(msg, StandbyCoverageWarning, stacklevel=3)
        return kept

    def only(self, plan: Plan, *, from_cache: bool = False) -> None:
        """`plan` is the only one that matters now (a pending cut-over's): build nothing else.
        With `from_cache`, executables already in the cache (a plan the run stood on before)
        are ready at once, not queued behind a build under way."""
        key = plan.compile_key
        self.standby.submit([key])
        self.standby.expedite(key)  # the run waits to cut over to it: never paced (`needed`)
        if from_cache and not self.standby.ready(key) and self.exe_cache.has(
                self.cfg, plan, self.donate, self.factory.tx_key):
            exe = self._cached(plan)[0]  # found: no compile
            self._prepare(exe)
            self.standby.put(key, exe)

    def wait_all(self, warm: bool) -> tuple[float, float]:
        """Block until every queued standby plan is built; with `warm`, run each built one once
        (one process only; on the calling thread, between steps: nothing else runs on the
        devices). Returns (seconds waited for builds, seconds warming)."""
        t0 = time.perf_counter()
        self.standby.wait_all()
        compile_s = time.perf_counter() - t0
        warm_s = 0.0
        if warm and jax.process_count() == 1:
            for exe in self.standby.ready_values():
                if exe.warm_s == 0.0:
                    exe.warm_s = warm_up(exe)
                    warm_s += exe.warm_s
        return compile_s, warm_s

    def warm_built(self, live: frozenset[int]) -> bool:
        """Dispatch the warm-up (`warm_up`, not waited for) of one standby executable built in
        the background and not run yet, on live devices only; called by the training thread
        between steps, so the zeros' runs go to the devices in order between two steps (one
        process only: under launch every process would have to dispatch the same warm-ups in
        the same order). Returns whether one was dispatched."""
        if self.standby is None or not self.cfg.standby.warm or jax.process_count() > 1:
            return False
        for exe in self.standby.ready_values():
            if (exe.warm_s == 0.0 and exe.runs == 0 and id(exe) not in self._warm_failed
                    and live.issuperset(exe.plan.device_ids)):
                try:
                    exe.warm_s = warm_up(exe, wait=False)
                except Exception as e:  # a warm-up is optional: the step that needs it runs cold
                    self._warm_failed.add(id(exe))
                    self._log(f"standby: warming {exe.plan.name} failed ({e!r}); its first run "
                              "will be cold")
                    return False
                self.warmed_between_steps += 1
                return True
        return False

    def _standby_build(self, plan: Plan) -> Executables:
        """A standby plan's executables (the standby thread): compiled, or rebound from its
        program. Where they may be loaded again (`standby.rebind`, or a renewed CPU client under
        `launch`), they are serialized here too (`Executables.portable`, once per program), so
        that a rebind or reload at recovery does not pay for it. `prepare` runs on it too (the
        snapshot checksums of its plan), so that a hit's first snapshot does not compile. The
        evaluation is built with the plan (`executables.compile_plan`), so that a hit's first
        evaluation does not compile either."""
        if self.worker is not None and not (
            self.rebindable(plan)
            or self.exe_cache.has(self.cfg, plan, self.donate, self.factory.tx_key)
        ):  # a compile: in the worker, which a recovery can stop (under launch, where the
            # job's shared builds give this process the program to compile, else loaded)
            def in_worker() -> Executables:
                src, compile_s = self.worker.compile(plan, self.donate)
                return from_portable(self.cfg, self.factory, plan, self.devices, src, compile_s)

            exe = self._cached(plan, in_worker)[0]
        else:
            exe = self._cached(plan, evaluate=True)[0]
            if (self.cfg.standby.rebind or jax.process_count() > 1) and exe.portable_ok:
                exe.portable()
        self._prepare(exe)
        return exe

    def close(self, wait_s: float = 60.0) -> None:
        """Stop the background builds; `wait_s`: how long to wait for one under way in this
        process (`StandbyCompiler.close`)."""
        if self.shared is not None:
            self.shared.close()
        if self.standby is not None:
            if self.worker is not None:
                self.worker.kill()  # a compile under way ends now, not at its end
            self.standby.close(wait_s)
        if self.worker is not None:
            self.worker.close()
