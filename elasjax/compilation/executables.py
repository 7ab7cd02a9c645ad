"""The executables of one plan and their lifecycle: compiled ahead (`compile_plan`), serialized and
loaded (`Portable`, `from_portable`), moved onto other devices or a renewed client without a
compile (`rebind`, `rehome`), warmed, and cached by program (`ExecutableCache`). Recovery measures
`compile_plan` as its `compile_s` phase.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .. import models
from ..config import Config
from ..core import jaxcompat
from ..core.counters import CompileCounter, on_behalf_of, within_map_budget
from ..core.mesh import make_mesh, replicated
from ..core.sharding import batch_shardings
from ..layout.state import StateFactory, StateLayout, TrainState
from ..layout.step import abstract_batch, make_eval_step, make_train_step
from ..plan.planner import Plan
from ..transfer.checksum import rebind_checksums
from ..transfer.shards import index_to_box


@dataclasses.dataclass
class Executables:
    """Compiled functions of one plan on one mesh."""

    plan: Plan
    mesh: Mesh
    layout: StateLayout
    state_shardings: TrainState
    batch_shardings: dict
    train: Any
    checksum: Any  # state -> uint32[n, 2] checksums, rows in `layout.checksum_keys` order
    eval: Any
    compile_s: float
    batch_abstract: dict[str, jax.ShapeDtypeStruct] = dataclasses.field(default_factory=dict)
    warm_s: float = 0.0  # seconds of its warm-up (`warm_up`), 0 if never warmed
    runs: int = 0  # training steps run on it (the first run of an executable is slower)
    make_eval: Any = None  # mesh -> the eval function on it (`rebind` re-makes it)
    # "compiled" here; "cached": loaded from JAX's persistent compilation cache (`standby.
    # cache_dir`) by `compile_plan`; "rebound" from a compile for other devices (`rebind`;
    # `compile_s` is then the load); "reloaded" onto a renewed client's devices of the same ids;
    # "shipped": sent compiled to a rejoining process (`admission`); "shared": compiled by another
    # process of the job (`shared.SharedBuilds`); "stored": loaded from the program store
    # (`store.ProgramStore`, compiled in this run or an earlier one)
    origin: str = "compiled"
    _init: Any = dataclasses.field(default=None, repr=False, compare=False)  # `compile_init`
    _portable: Any = dataclasses.field(default=None, repr=False, compare=False)
    _portable_lock: Any = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )
    _eval_exe: Any = dataclasses.field(default=None, repr=False, compare=False)  # `eval_for`
    _eval_other: Any = dataclasses.field(default=None, repr=False, compare=False)  # other shapes

    def eval_for(self, params, batch):
        """The evaluation's executable for these arguments: built with the plan where it was
        built ahead (`compile_plan(evaluate=True)`: the standby's and the start's plans, and
        what they were loaded or rebound from), else compiled on first use (`make_eval`), apart
        from its run, so that the loop compiles it before the step's collectives are in flight
        (`stepping.Stepper.dispatch` says why). A batch of another shape than the step's (the
        torchft_like baseline's surviving columns) gets an executable of its own."""
        if not all(batch[k].shape == a.shape for k, a in self.batch_abstract.items()):
            if self._eval_other is None:
                self._eval_other = self.eval.lower(params, batch).compile()
            return self._eval_other
        if self._eval_exe is None:
            self._eval_exe = self.eval.lower(params, batch).compile()
        return self._eval_exe

    @property
    def portable_ok(self) -> bool:
        """Can `portable` serialize these executables? Not when JAX's persistent cache loaded
        them: XLA:CPU cannot serialize a loaded executable again (the copy loads, and fails when
        run: "Function add_multiply_fusion.8 not found"; jax 0.10.2). An executable loaded by
        `rebind` keeps the form it was loaded from."""
        return self._portable is not None or self.origin != "cached"

    def portable(self) -> "Portable":
        """The train and checksum executables serialized (once; `rebind` loads them)."""
        if not self.portable_ok:
            raise ValueError(
                f"the executables of {self.plan.name} were loaded from JAX's persistent "
                "compilation cache and cannot be serialized again (XLA:CPU); compile them instead"
            )
        with self._portable_lock:
            if self._portable is None:
                self._portable = Portable(
                    tuple(d.id for d in self.mesh.devices.flat),
                    jaxcompat.serialize(self.train),
                    jaxcompat.serialize(self.checksum),
                )
            # a fresh state's program and an evaluation compiled here go along (one loaded came
            # from `_portable`, which then has it)
            if self._init is not None and self._portable.init is None:
                self._portable = dataclasses.replace(
                    self._portable, init=jaxcompat.serialize(self._init))
            if self._eval_exe is not None and self._portable.eval is None:
                self._portable = dataclasses.replace(
                    self._portable, eval=jaxcompat.serialize(self._eval_exe))
            return self._portable

    @property
    def client(self):
        """The backend client the executables run on (that of the mesh's devices)."""
        return self.mesh.devices.flat[0].client

    def put_batch(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Global batch arrays from the host batch (every process holds the whole host batch
        and places its own devices' slices)."""
        out = {}
        for k, v in arrays.items():
            sh = self.batch_shardings[k]
            if sh.is_fully_addressable:
                out[k] = jax.device_put(v, sh)
            else:
                out[k] = jax.make_array_from_callback(v.shape, sh, lambda i, v=v: v[i], dtype=v.dtype)
        return out

    def compile_init(self) -> None:
        """Compile the fresh state's program now, not at its first run: under `jax.distributed`
        a program compiled at its run reaches its collectives as late as that process's compile
        is slow (`start.start`). Loaded instead where the serialized form these executables
        came from carries it (compiled by the process of the job that compiled the plan)."""
        if self._init is not None:
            return
        src = self._portable
        if src is not None and src.init is not None and can_load():
            self._init = _load(src.init, src.device_ids, list(self.mesh.devices.flat))
            return
        self._init = jax.jit(self.layout.init_fn, out_shardings=self.state_shardings).lower().compile()

    def init(self) -> TrainState:
        self.compile_init()
        return self._init()

    def from_canonical(self, full: TrainState) -> TrainState:
        """A canonical (ZeRO-0, unpipelined) state in this plan's form (checkpoints written
        before the saved form was recorded)."""
        if self.layout.codec is None and self.layout.stage_layout is None:
            return full
        return jax.jit(self.layout.from_canonical, out_shardings=self.state_shardings)(full)


def _frame(cfg: Config, factory: StateFactory, plan: Plan, devices: dict[int, jax.Device]):
    """What a plan's executables run in, short of compiling: (mesh, layout, state shardings,
    abstract batch, batch shardings, the eval-function maker)."""
    mesh = make_mesh(plan.mesh_shape, [devices[i] for i in plan.device_ids])
    layout = factory.layout(plan)
    ab = abstract_batch(plan, factory.model)

    def make_eval(m: Mesh):
        # not on the recovery path: it compiles on first use (`Executables.eval_for`)
        return jax.jit(
            make_eval_step(cfg, factory.model, layout, m, plan),
            in_shardings=(layout.shardings(m).params, batch_shardings(m, ab)),
            out_shardings=(replicated(m), replicated(m)),
        )

    return mesh, layout, layout.shardings(mesh), ab, batch_shardings(mesh, ab), make_eval


def evaluates(cfg: Config) -> bool:
    """Does a run of `cfg` evaluate (`train.eval_every`)? Then a plan built ahead carries the
    evaluation's executable (`compile_plan(evaluate=True)`)."""
    return cfg.train.eval_every > 0


def compile_plan(
    cfg: Config,
    factory: StateFactory,
    plan: Plan,
    devices: dict[int, jax.Device],
    *,
    donate: bool = True,
    store=None,
    evaluate: bool = False,
    init: bool = False,
    beside: bool | None = None,
) -> Executables:
    """AOT-compile the train and checksum functions of `plan`; time it. `donate=False` keeps
    the input state valid after a step (multi-process runs, where a step can fail midway).
    `store` (a `store.ProgramStore`): where the program was compiled before, in this run or an
    earlier one, it is loaded from there instead (origin "stored"); a compile is written there.
    `evaluate` (where the run evaluates, `evaluates`): the evaluation is compiled too, so that
    a plan built ahead (the standby's) compiles nothing at its first evaluation; a recovery's
    own compile leaves it to the first evaluation (the MTTR is the first step's). `init` (a
    fresh start's plan): the fresh state's program too (`Executables.compile_init`).

    With `beside` the train program compiles on this thread and the others on a thread of their
    own (an XLA compile releases the GIL; their compiles count as this thread's,
    `CompileCounter`): the 3.3M ladder size's start compiled its train step in 6.4 s, the
    checksums in 2.1 s and the fresh state in 2.2 s one after the other, 8.5 s side by side.
    None (the default): beside where a core is idle (`_core_idle`); the compile worker passes
    False (a second core would come from the steps). On busy cores two compiles at once only
    contend: the suite, two tests at a time on 2 cores, took 1542 s with them always side by
    side against 1411 s one after the other (experiments/RESULTS.md, "The start's compiles
    side by side")."""
    t0 = time.perf_counter()
    mesh, layout, st_sh, ab, b_sh, make_eval = _frame(cfg, factory, plan, devices)
    eval_fn = make_eval(mesh)
    eval_low = eval_fn.lower(layout.abstract.params, ab) if evaluate and evaluates(cfg) else None
    abs_state = layout.abstract
    rep = replicated(mesh)
    train_fn = make_train_step(cfg, layout, factory.model, mesh, st_sh, plan)
    metric_sh = {"loss": rep, "grad_norm": rep, "checksums": rep}
    train_low = jax.jit(
        train_fn,
        in_shardings=(st_sh, b_sh),
        out_shardings=(st_sh, metric_sh),
        donate_argnums=0 if donate else (),
    ).lower(abs_state, ab)
    sums_low = jax.jit(
        functools.partial(layout.stacked_checksums, mesh=mesh), in_shardings=(st_sh,),
        out_shardings=rep,
    ).lower(abs_state)
    key = None
    if store is not None and can_load():
        texts = [train_low.as_text(), sums_low.as_text()]
        if eval_low is not None:  # an entry with the evaluation is an entry of its own
            texts.append(eval_low.as_text())
        key = store.key(texts, mesh.devices.flat[0])
        src = store.get(key)
        if src is not None and len(src.device_ids) == mesh.devices.size:
            (train, sums), ev = _load_programs(src, list(mesh.devices.flat))
            return Executables(
                plan, mesh, layout, st_sh, b_sh, train, sums, eval_fn,
                time.perf_counter() - t0, ab, make_eval=make_eval, origin="stored",
                _portable=src, _eval_exe=ev,
            )
    init_low = (jax.jit(layout.init_fn, out_shardings=st_sh).lower() if init else None)
    caller = threading.get_ident()

    def side():
        with on_behalf_of(caller):
            return (sums_low.compile(), eval_low.compile() if eval_low is not None else None,
                    init_low.compile() if init_low is not None else None)

    with CompileCounter(event=CompileCounter.CACHE_HIT) as cached:
        if beside if beside is not None else _core_idle():
            train, (sums, ev, init_exe) = _beside(train_low.compile, side)
        else:
            train, (sums, ev, init_exe) = train_low.compile(), side()
    exe = Executables(
        plan, mesh, layout, st_sh, b_sh, train, sums, eval_fn,
        time.perf_counter() - t0, ab, make_eval=make_eval,
        origin="cached" if cached.count else "compiled", _eval_exe=ev, _init=init_exe,
    )
    if key is not None and exe.portable_ok:
        store.put(key, exe.portable())
    return exe


def from_portable(
    cfg: Config, factory: StateFactory, plan: Plan, devices: dict[int, jax.Device],
    src: "Portable", compile_s: float,
) -> Executables:
    """`plan`'s executables from their serialized form (compiled elsewhere: a compile worker,
    `compile_worker`), loaded onto `plan`'s devices; `compile_s` is the compile's seconds."""
    mesh, layout, st_sh, ab, b_sh, make_eval = _frame(cfg, factory, plan, devices)
    (train, sums), ev = _load_programs(src, list(mesh.devices.flat))
    return Executables(
        plan, mesh, layout, st_sh, b_sh, train, sums, make_eval(mesh), compile_s, ab,
        make_eval=make_eval, _portable=src, _eval_exe=ev,
    )


def on_devices(exe: Executables, devices: dict[int, jax.Device]) -> Executables | None:
    """`exe` itself when it runs on `devices`' client, else `rehome`d onto them; None where it
    cannot be (`Executables.portable_ok`: then compile it, which JAX's persistent cache serves)."""
    if exe.client is devices[exe.plan.device_ids[0]].client:
        return exe
    return rehome(exe, devices) if exe.portable_ok and can_load() else None


def rehome(exe: Executables, devices: dict[int, jax.Device]) -> Executables:
    """`exe` on the devices of the same ids of another client (a renewed CPU client,
    `collectives`): `rebind` to its own plan."""
    return rebind(exe, exe.plan, devices)


# Backends whose loaded executables take a new device assignment (`rebind`); elsewhere a
# plan on other devices is compiled
REBINDABLE = ("cpu", "gpu", "cuda", "rocm")


def can_rebind(exe: Executables, plan: Plan) -> bool:
    """Can `rebind` put `exe`'s program on `plan`'s devices: the same program (`shape_key`)
    on a backend whose executables take a new device assignment?"""
    return (exe.plan.shape_key == plan.shape_key and exe.client.platform in REBINDABLE
            and exe.portable_ok and can_load())


def rebind(exe: Executables, plan: Plan, devices: dict[int, jax.Device]) -> Executables:
    """`exe`'s compiled train and checksum programs loaded onto `plan`'s devices, without
    compiling: `plan` differs from `exe.plan` at most in which devices it uses (the same
    `Plan.shape_key`), or `devices` are another client's devices of the same ids (a renewed CPU
    client, `collectives`).

    The program does not depend on device ids: XLA partitions it over mesh positions, and the
    device assignment is a compile option. The executables are serialized once (kept on `exe`)
    and loaded with the new plan's devices as their assignment, position for position. A load
    costs a small fraction of a compile (experiments/RESULTS.md, "`--standby` on the demo"), and a
    step on the rebound executable gives the same bits as one compiled for those devices
    (tests/test_standby_baselines.py). The snapshot checksums compiled for `exe`'s mesh are
    loaded onto the new one too (`checksum.rebind_checksums`). The eval function is re-made (it
    compiles on first use)."""
    if plan.shape_key != exe.plan.shape_key:
        raise ValueError(f"cannot rebind {exe.plan.name} to {plan.name}: a different program")
    mesh = make_mesh(plan.mesh_shape, [devices[i] for i in plan.device_ids])
    flat = list(mesh.devices.flat)
    if plan.device_ids != exe.plan.device_ids and flat[0].client.platform not in REBINDABLE:
        raise ValueError(
            f"the {flat[0].client.platform} backend's executables keep their devices; "
            f"compile {plan.name} instead (rebinding works on {', '.join(REBINDABLE)})"
        )
    t0 = time.perf_counter()
    src = exe.portable()
    # the snapshot pool's checksums compiled for exe's mesh go along (a renewed client's first
    # snapshot then compiles nothing), loaded beside the train and checksum programs
    ((train, sums), ev), _ = _beside(
        lambda: _load_programs(src, flat),
        lambda: rebind_checksums(exe.mesh, mesh, lambda ser, ids: _load(ser, ids, flat)))
    return dataclasses.replace(
        exe,
        plan=plan,
        mesh=mesh,
        state_shardings=exe.layout.shardings(mesh),
        batch_shardings=batch_shardings(mesh, exe.batch_abstract),
        train=train,
        checksum=sums,
        eval=exe.make_eval(mesh),
        compile_s=time.perf_counter() - t0,
        warm_s=0.0,
        origin="rebound" if plan.device_ids != exe.plan.device_ids else "reloaded",
        _portable=src,
        # never `exe`'s own: it runs on `exe`'s devices (or a client that is gone)
        _eval_exe=ev,
        _eval_other=None,
    )


@dataclasses.dataclass(frozen=True)
class Portable:
    """An executable pair in serialized form (`jax.experimental.serialize_executable`), with
    the device ids, in mesh order, that its device references name."""

    device_ids: tuple[int, ...]
    train: tuple  # (payload, in_tree, out_tree)
    checksum: tuple
    # the fresh state's program (`Executables.compile_init`) where it was compiled before the
    # pair was serialized for the job's other processes (`source.ExecutableSource.start`)
    init: tuple | None = None
    # the evaluation's executable where it was compiled with the plan (`compile_plan(evaluate=
    # True)`) or before the pair was serialized; loaded with the pair (`_load_programs`)
    eval: tuple | None = None


def _core_idle() -> bool:
    """Is a core this process may use idle: the 1-minute load average at least one under their
    count? (Where the platform does not say: no.)"""
    try:
        return len(os.sched_getaffinity(0)) - os.getloadavg()[0] >= 1.0
    except (AttributeError, OSError):
        return False


def _beside(main, side) -> tuple[Any, Any]:
    """(main(), side()), `side` run on a thread of its own meanwhile; an error of either is
    raised here."""
    with concurrent.futures.ThreadPoolExecutor(1, "elasjax-load") as pool:
        other = pool.submit(side)
        return main(), other.result()


def _load_programs(src: "Portable", flat: list) -> tuple[tuple[Any, Any], Any]:
    """((train, checksum), evaluation): `src`'s executables loaded onto `flat`, the evaluation
    None where `src` has none (a store entry written before the field reads the class's
    default). The checksum and the evaluation load on a thread beside the train: a load
    releases the GIL, and train and checksum together took 0.45-0.49 s against 0.63-0.80 s one
    after the other for the demo's plan (experiments/RESULTS.md, "Compiling once per job, and a
    program store")."""
    def side():
        sums = _load(src.checksum, src.device_ids, flat)
        return sums, None if src.eval is None else _load(src.eval, src.device_ids, flat)

    train, (sums, ev) = _beside(lambda: _load(src.train, src.device_ids, flat), side)
    return (train, sums), ev


def _load(serialized: tuple, old_ids: tuple[int, ...], flat: list) -> Any:
    """Load a serialized executable onto `flat` (mesh order), position i of `old_ids` -> flat[i]."""
    load = jaxcompat.executable_loader()
    if load is None:  # callers ask `can_load` first
        raise RuntimeError(f"jax {jax.__version__} cannot load executables onto other devices "
                           "(elasjax.core.jaxcompat.executable_loader); compile instead")
    return load(serialized, old_ids, flat)


def can_load() -> bool:
    """Can this JAX load a serialized executable onto given devices (`jaxcompat`)? Where not,
    a plan on other devices, or on a renewed client, is compiled."""
    if jax.process_count() > 1:  # `jaxcompat.loads_in_a_multiprocess_job` says why
        return jaxcompat.loads_in_a_multiprocess_job()
    return jaxcompat.executable_loader() is not None


def warm_up(exe: Executables, wait: bool = True) -> float:
    """Run `exe`'s checksum and train executables once on placeholder zeros, so that the first
    real step after a recovery does not pay the executable's first-run cost (a first run is
    slower than the later ones: experiments/RESULTS.md, "`--standby` on the demo"). Needs one
    more copy of the state on the devices while it runs. Returns its seconds; without `wait`,
    the runs are only dispatched (they run on the devices in order after what was dispatched
    before) and the seconds are those of placing the zeros and dispatching."""
    t0 = time.perf_counter()

    def zeros(a: jax.ShapeDtypeStruct, sh) -> jax.Array:
        return jax.make_array_from_callback(
            a.shape, sh,
            lambda idx: np.zeros([hi - lo for lo, hi in index_to_box(idx, a.shape)], a.dtype),
        )

    state = jax.tree.map(zeros, exe.layout.abstract, exe.state_shardings)
    sums = exe.checksum(state)
    batch = {k: zeros(a, exe.batch_shardings[k]) for k, a in exe.batch_abstract.items()}
    out = exe.train(state, batch)
    if wait:
        jax.block_until_ready((sums, out))
    return time.perf_counter() - t0


class ExecutableCache:
    """Compiled plans, keyed by what the executables depend on (model and train config, and the
    plan); bounded, least recently used out first. A plan whose program was compiled for other
    devices (the same `Plan.shape_key`) can be `rebind`-ed from it instead of compiled
    (`reuse_programs`): the cache remembers the latest executable of each program while it is
    held anywhere (`program`). A trainer owns one; pass a
    shared one to reuse executables across runs in one process (tests, experiment sweeps).

    `map_budget`: past this fraction of the process's memory-mapping limit (`vm.max_map_count`;
    a loaded CPU executable holds hundreds of mappings), the oldest entries are dropped too, so
    that a long-lived process never runs out of mappings: XLA's JIT then fails mid-compile
    (`LLVM ERROR: Unable to allocate section memory`; the counts are in experiments/RESULTS.md,
    "`--standby` on the demo"). None: no bound."""

    def __init__(self, max_entries: int = 16, max_programs: int = 8, map_budget: float | None = 0.5):
        self.max_entries, self.max_programs = max_entries, max_programs
        self.map_budget = map_budget
        self.evicted_for_maps = 0  # entries dropped by `map_budget`
        self._d: dict = {}
        # program key -> an executable of that program, while something else holds it: the index
        # never keeps an evicted executable (and its memory mappings) alive
        self._programs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.Lock()  # the standby thread compiles through the same cache

    @staticmethod
    def key(cfg: Config, plan: Plan, donate: bool = True, tx_key=None):
        # a registered model is its spec object, never its name alone
        spec = models.get(cfg.model) if cfg.model.type != "gpt" else None
        return (cfg.model, spec, cfg.train, tx_key, plan.compile_key, donate)

    @classmethod
    def program_key(cls, cfg: Config, plan: Plan, donate: bool = True, tx_key=None):
        return cls.key(cfg, plan.shape_key, donate, tx_key)

    def program(self, cfg: Config, plan: Plan, donate: bool = True, tx_key=None):
        """An executable of `plan`'s program that `rebind` can put on `plan`'s devices, or None
        (building `plan` would compile)."""
        with self._lock:
            src = self._programs.get(self.program_key(cfg, plan, donate, tx_key))
        return src if src is not None and can_rebind(src, plan) else None

    def get(
        self, cfg: Config, factory: StateFactory, plan: Plan, devices, *, donate: bool = True,
        reuse_programs: bool = False, build=None, store=None, evaluate: bool = False,
        init: bool = False,
    ) -> tuple[Executables, bool]:
        """(executables, found here). An entry made for another client's devices of the same
        ids (a renewed CPU client) is reloaded onto `devices` (compiled again where it cannot be,
        `Executables.portable_ok`); with `reuse_programs`
        (`standby.rebind`), a plan whose program is here for other devices is rebound to its
        own (`rebind`); otherwise it is compiled (`compile_plan`, which loads it from `store`
        where it is there), by `build(compile)` where given (which calls `compile()` or gets the
        executables elsewhere: `shared.SharedBuilds`)."""
        k = self.key(cfg, plan, donate, factory.tx_key)
        with self._lock:
            exe = self._d.pop(k, None)
            if exe is not None:
                self._d[k] = exe
        if exe is not None:
            current = on_devices(exe, devices)
            if current is exe:
                return exe, True
            if current is not None:
                self._put(k, current)
                return current, True
        src = self.program(cfg, plan, donate, factory.tx_key) if reuse_programs else None
        if src is not None:
            exe = rebind(src, plan, devices)
        else:  # outside the lock
            def compile():
                return compile_plan(cfg, factory, plan, devices, donate=donate, store=store,
                                    evaluate=evaluate, init=init)
            exe = compile() if build is None else build(compile)
        self._put(k, exe, self.program_key(cfg, plan, donate, factory.tx_key))
        return exe, False

    def has(self, cfg: Config, plan: Plan, donate: bool = True, tx_key=None) -> bool:
        with self._lock:
            return self.key(cfg, plan, donate, tx_key) in self._d

    def put(self, cfg: Config, plan: Plan, exe: Executables, donate: bool = True, tx_key=None) -> None:
        """Keep `exe`, built elsewhere (a compile worker), as `plan`'s entry and its program's."""
        self._put(self.key(cfg, plan, donate, tx_key), exe, self.program_key(cfg, plan, donate, tx_key))

    def _put(self, k, exe: Executables, program_key=None) -> None:
        with self._lock:
            self._d[k] = exe
            while len(self._d) > self.max_entries:
                self._d.pop(next(iter(self._d)))
            if self.map_budget is not None:
                self._shed(self.map_budget)
            if program_key is not None:
                self._programs.pop(program_key, None)
                self._programs[program_key] = exe
                while len(self._programs) > self.max_programs:
                    self._programs.pop(next(iter(self._programs)))

    def shed(self, budget: float) -> bool:
        """Drop the oldest entries (never the newest) until the process is within `budget` of
        its mapping limit; is it now? A standby over budget asks this before it gives up: plans
        kept for reuse are worth less than the plan of the next failure
        (tests/test_standby_baselines.py::test_a_full_executable_cache_gives_way_to_the_standby)."""
        with self._lock:
            return self._shed(budget)

    def _shed(self, budget: float) -> bool:
        if within_map_budget(budget):  # (collects garbage once where over)
            return True
        while len(self._d) > 1:
            self._d.pop(next(iter(self._d)))  # the oldest; its mappings go with it
            self.evicted_for_maps += 1  # (unless something else still holds it)
            if within_map_budget(budget, collect=False):
                return True
        return within_map_budget(budget)  # what only a collection frees

    def __contains__(self, item) -> bool:
        return item in self._d


# ---------------------------------------------------------------------------------------------
# Any compiled function (a user's jitted step, the pieces' checksums), moved like a plan's.


@dataclasses.dataclass(frozen=True)
class PortableFunction:
    """A `jax.stages.Compiled` in serialized form, with the ids of the devices it was compiled
    for in mesh order (`rebind_function` loads it onto another mesh of the same shape)."""

    device_ids: tuple[int, ...]
    platform: str
    serialized: tuple  # (payload, in_tree, out_tree)


def function_rebind_blocker(mesh: Mesh) -> str | None:
    """Why a compiled function cannot be rebound onto `mesh`'s devices (then compile it), or
    None when it can: this JAX must load executables onto given devices (`jaxcompat`) and the
    backend's executables must take a new device assignment (`REBINDABLE`)."""
    if not can_load():
        return (f"jax {jax.__version__} cannot load an executable onto other devices "
                "(elasjax.core.jaxcompat.executable_loader)")
    platform = mesh.devices.flat[0].client.platform
    if platform not in REBINDABLE:
        return (f"the {platform} backend's executables keep their devices (rebinding works on "
                f"{', '.join(REBINDABLE)})")
    return None


def portable_function(compiled: Any, mesh: Mesh) -> PortableFunction:
    """`compiled` (compiled for `mesh`, by `jit(...).lower(...).compile()`, not itself loaded
    from a serialized form: XLA:CPU cannot serialize that again) serialized for
    `rebind_function`."""
    return PortableFunction(
        tuple(d.id for d in mesh.devices.flat), mesh.devices.flat[0].client.platform,
        jaxcompat.serialize(compiled),
    )


def rebind_function(src: PortableFunction, mesh: Mesh) -> Any:
    """The function of `src` loaded onto `mesh`'s devices without compiling: position i of the
    mesh it was compiled for runs on position i of `mesh`. The program depends on mesh
    positions, not device ids, so `mesh` must have the shape it was compiled for (the caller
    checks that the program lowered for `mesh` is the same, e.g. `ElasticState.standby`); a
    call on the result takes and returns arrays on `mesh` and gives the bits of the function
    compiled for it (tests/test_pieces_standby.py)."""
    flat = list(mesh.devices.flat)
    if len(flat) != len(src.device_ids):
        raise ValueError(
            f"rebind_function: compiled for {len(src.device_ids)} devices, the mesh has "
            f"{len(flat)}; only a mesh of the same shape can take it"
        )
    why = function_rebind_blocker(mesh)
    if why is not None:
        raise ValueError(f"rebind_function: {why}; compile for this mesh instead")
    return _load(src.serialized, src.device_ids, flat)
