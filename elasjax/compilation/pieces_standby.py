"""The pieces' standby: a user's step built ahead for every likely mesh, one compile per shape.

`ElasticState.standby` needs the user's jitted step (and the state's checksum function) for the
mesh of every likely failure. Those meshes come in few shapes (8 devices, hosts of 2, data x
model: 12 likely meshes in 2 shapes), and XLA's program depends on mesh positions, not on
which devices fill them. So, as the loop does for its plans (`executables.rebind`), one mesh of
each shape is compiled and the others load that compiled program with their own devices as its
device assignment (`executables.rebind_function`): a load, not a compile.

A mesh is only rebound when the program lowered for it is the program compiled for its shape
(the lowered text, which names mesh positions, not devices, is compared): the step is the
user's, and nothing makes a user's `make_step(mesh)` depend on the mesh's shape alone. Lowering
costs little next to a compile (the trace is cached). Where a mesh cannot be rebound (this JAX
cannot load an executable onto other devices, a backend whose executables keep their devices, a
program that differs, a form that does not serialize), it is compiled and its progress line
says why.

Every build is announced (`StandbyProgress`): first what is to be built and its expected cost
(compiles x the compile time measured so far, plus the rebinds), then one line per built mesh
with the count, how it was built and the expected time left. `max_meshes` caps how many likely
meshes are built; the line names how many were left out.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from .executables import (
    PortableFunction,
    function_rebind_blocker,
    portable_function,
    rebind_function,
)
from .shared import SharedBuilds
from .standby import StandbyCompiler

LOG_KEPT = 256


def shape_key(mesh: Mesh) -> tuple:
    """What a compiled program depends on in a mesh: its axis names and sizes (and types)."""
    return tuple(mesh.shape.items()), tuple(getattr(mesh, "axis_types", ()) or ())


def _ids(mesh: Mesh) -> tuple:
    """A mesh by its shape and device ids (the same on a renewed client)."""
    return shape_key(mesh), tuple(d.id for d in mesh.devices.flat)


def describe(mesh: Mesh) -> str:
    return " x ".join(f"{a} {n}" for a, n in mesh.shape.items())


class StepExecutables(tuple):
    """(step, checksums) compiled or rebound for one mesh; `origin` says which ("compiled" or
    "rebound"), `seconds` how long it took."""

    def __new__(cls, step: Any, sums: Any, origin: str, seconds: float):
        self = super().__new__(cls, (step, sums))
        self.origin, self.seconds = origin, seconds
        return self


@dataclasses.dataclass
class StandbyProgress:
    """One announcement of the pieces' standby (`str()` is its line).

    `event`: "plan" (what will be built, once per set of likely meshes: at `standby` and after
    each recovery) or "built" (one mesh done). `built`/`total`: meshes built so far of this set
    (the current mesh counts at `standby`); `compiled`/`rebound`: how. `left_out`: likely meshes
    `max_meshes` left out. `mesh`/`devices`/`how`/`seconds`: the mesh just built ("compiled",
    "rebound", or "compiled: " and why it was not rebound). `to_compile`/`to_rebind`: builds
    still to come. `expected_s`: expected seconds for them (compiles at the mean compile time so
    far, rebinds at the mean rebind time so far, or not counted before the first: then
    `rebinds_unpriced`); `elapsed_s`: since this set was announced."""

    event: str
    built: int
    total: int
    compiled: int
    rebound: int
    left_out: int
    to_compile: int
    to_rebind: int
    expected_s: float
    elapsed_s: float
    mesh: dict[str, int] | None = None
    devices: list[int] | None = None
    how: str = ""
    seconds: float = 0.0
    shapes: int = 0
    rebinds_unpriced: bool = False
    message: str = ""

    def __str__(self) -> str:
        return self.message


class _SharedShape:
    """A shape's (step, checksums) as `shared.SharedBuilds` hands a program between the processes
    of a job: compiled here and serialized for the others (`portable`), or loaded from the
    serialized form another process published (`origin` "shared")."""

    def __init__(self, step, sums, compiled, portable, compile_s: float, error=None):
        self.step, self.sums, self.compiled, self._portable = step, sums, compiled, portable
        self.compile_s, self.error, self.origin = compile_s, error, "compiled"
        self.portable_ok = portable is not None

    @classmethod
    def compile(cls, low, mesh: Mesh) -> _SharedShape:
        t0 = time.perf_counter()
        step, sums = low[0].compile(), low[1].compile()
        took = time.perf_counter() - t0
        try:
            portable = (portable_function(step, mesh), portable_function(sums, mesh))
        except Exception as e:  # noqa: BLE001 - the others compile on their own
            return cls(step, sums, (step, sums), None, took, e)
        return cls(step, sums, (step, sums), portable, took)

    @classmethod
    def load(cls, portable, mesh: Mesh, compile_s: float) -> _SharedShape:
        return cls(rebind_function(portable[0], mesh), rebind_function(portable[1], mesh),
                   None, portable, compile_s)

    def portable(self):
        return self._portable


class PiecesStandby(StandbyCompiler):
    """A `StandbyCompiler` of meshes whose builds compile once per program and rebind the rest.

    `lower(mesh)` returns the (step, checksums) `jax.stages.Lowered` for `mesh`. `max_meshes`:
    None (every submitted mesh) or how many of each `submit` to build (the first ones).
    `rebind`: load a program compiled for another mesh of the same shape where possible.
    `progress`: True (each line on stderr), False (none) or a callable taking a
    `StandbyProgress` (called on the thread that built the mesh: the standby thread, or the
    caller's for the current mesh). Every record is kept in `log` (the last `LOG_KEPT`).
    `shared` (under `elasjax launch`): the first mesh of each shape is compiled by one process of
    the job and loaded by the others (`shared.SharedBuilds`), so a shape costs the job one
    compile, not one per process."""

    def __init__(
        self,
        lower: Callable[[Mesh], tuple[Any, Any]],
        *,
        max_meshes: int | None = None,
        rebind: bool = True,
        progress: bool | Callable[[StandbyProgress], Any] = True,
        shared: SharedBuilds | None = None,
    ):
        self.lower, self.max_meshes, self.rebind = lower, max_meshes, rebind
        self.shared = shared
        self.progress = progress
        self.log: list[StandbyProgress] = []
        self.fallbacks: dict[str, int] = {}  # why a mesh was compiled, not rebound -> how many
        self._sources: dict[tuple, dict] = {}  # shape -> the compiled mesh's program
        self._texts: dict[tuple, tuple] = {}  # (shape, device ids) -> its lowered programs
        self._lk = threading.Lock()  # sources and the round's counts
        self._round: dict | None = None
        self._first: StepExecutables | None = None
        # every build's count and seconds by origin (the current mesh's too), for the estimates
        self._n = {"compiled": 0, "rebound": 0}
        self._s = {"compiled": 0.0, "rebound": 0.0}
        super().__init__(self.build, cheap=self._cheap)

    # -- building one mesh ----------------------------------------------------------------------

    def blocker(self, mesh: Mesh) -> str | None:
        """Why `mesh` cannot be rebound whatever was compiled (None: it can)."""
        return "rebind=False" if not self.rebind else function_rebind_blocker(mesh)

    def built_before(self, mesh: Mesh) -> bool:
        """Was a mesh of `mesh`'s shape on the same device ids built? (After the job's
        collectives were renewed, a mesh of the new client's devices is a new key; what was
        built for its ids loads onto them: a rebind in `build`, not a compile.)"""
        return any(_ids(m) == _ids(mesh) for m in self.ready_keys())

    def _cheap(self, mesh: Mesh) -> bool:
        with self._lk:
            src = self._sources.get(shape_key(mesh))
        return src is not None and src.get("error") is None and self.blocker(mesh) is None

    def build(self, mesh: Mesh) -> StepExecutables:
        """`mesh`'s step and checksums: rebound from the compile for its shape where the program
        lowered for `mesh` is that one, else compiled (and kept as its shape's source)."""
        t0 = time.perf_counter()
        # a mesh on the device ids of one built before (the same mesh on a renewed client):
        # its programs are the ones lowered then, and it is rebound without lowering again
        # (0.41 s of a recovery's 0.51 s before: experiments/RESULTS.md, "The pieces' standby
        # under launch")
        with self._lk:
            texts = self._texts.get(_ids(mesh))
        low = None
        if texts is None:
            low = self.lower(mesh)
            texts = tuple(x.as_text() for x in low)
        why = self.blocker(mesh)
        with self._lk:
            src = self._sources.get(shape_key(mesh))
        if why is None and src is None:
            why = "first of its shape"
        elif why is None and src["texts"] != texts:
            why = "its program differs from the one compiled for its shape"
        if why is None:
            try:
                portable = self._portable(src)
                step = rebind_function(portable[0], mesh)
                sums = rebind_function(portable[1], mesh)
            except Exception as e:  # noqa: BLE001 - any failure to load: compile instead
                why = f"rebinding failed ({type(e).__name__}: {str(e)[:200]})"
            else:
                out = StepExecutables(step, sums, "rebound", time.perf_counter() - t0)
                self._built(mesh, out, "rebound", texts)
                return out
        if low is None:
            low = self.lower(mesh)
        if why == "first of its shape" and self.shared is not None and self.blocker(mesh) is None:
            return self._shared_build(mesh, low, texts, t0)
        step, sums = low[0].compile(), low[1].compile()
        with self._lk:
            kept = self._sources.get(shape_key(mesh))
            if kept is None or kept["texts"] != texts:  # the latest program of the shape
                self._sources[shape_key(mesh)] = {
                    "mesh": mesh, "texts": texts, "compiled": (step, sums), "portable": None,
                    "error": None,
                }
        out = StepExecutables(step, sums, "compiled", time.perf_counter() - t0)
        how = "compiled" if why == "first of its shape" else f"compiled: {why}"
        if why != "first of its shape":
            with self._lk:
                self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        self._built(mesh, out, how, texts)
        return out

    def close(self, wait_s: float = 60.0) -> None:
        if self.shared is not None:  # a wait for another process's compile ends too
            self.shared.close()
        super().close(wait_s)

    def _shared_build(self, mesh: Mesh, low, texts: tuple, t0: float) -> StepExecutables:
        """The first mesh of its shape under launch: compiled by the process of the job that
        takes its lease, loaded by the others (the key is the lowered programs, which name mesh
        positions, not devices); the shape's source for the rebinds either way."""
        def load(portable, compile_s: float) -> _SharedShape:
            try:
                return _SharedShape.load(portable, mesh, compile_s)
            except Exception:  # noqa: BLE001 - not loadable here: compile it (slower, not wrong)
                return _SharedShape.compile(low, mesh)

        got = self.shared.build(SharedBuilds.key("pieces", texts),
                                f"the step for {describe(mesh)}",
                                lambda: _SharedShape.compile(low, mesh), load)
        step, sums, compiled, portable = got.step, got.sums, got.compiled, got.portable()
        error, loaded = got.error, got.origin == "shared"
        with self._lk:
            self._sources.setdefault(shape_key(mesh), {
                "mesh": mesh, "texts": texts, "compiled": compiled, "portable": portable,
                "error": error,
            })
        origin = "rebound" if loaded else "compiled"
        out = StepExecutables(step, sums, origin, time.perf_counter() - t0)
        self._built(mesh, out, "loaded: compiled by another process of the job" if loaded
                    else "compiled", texts)
        return out

    def _portable(self, src: dict) -> tuple[PortableFunction, PortableFunction]:
        """The serialized form of a shape's compiled program (made once; an error is kept and
        raised again, so that a program that does not serialize is tried once)."""
        with self._lk:
            if src["error"] is not None:
                raise src["error"]
            if src["portable"] is None:
                try:
                    src["portable"] = tuple(
                        portable_function(c, src["mesh"]) for c in src["compiled"]
                    )
                except Exception as e:  # noqa: BLE001 - kept: every later build compiles
                    src["error"] = e
                    raise
            return src["portable"]

    # -- the set of meshes and its announcements ------------------------------------------------

    def build_current(self, mesh: Mesh) -> StepExecutables:
        """The current mesh's build, in the caller's thread (announced with the next `submit`)."""
        self._first = self.build(mesh)
        self.put(mesh, self._first)
        return self._first

    def submit(self, plans: Sequence[Any], *, front: bool = False) -> list:
        """Build `plans` (at most `max_meshes` of them), announcing them and their expected
        cost first; with `front` (a recovery's urgent mesh), no new set is announced."""
        if front:
            return super().submit(plans, front=True)
        plans = list(dict.fromkeys(plans))
        keep = plans if self.max_meshes is None else plans[: self.max_meshes]
        todo = [p for p in keep if not self.ready(p)]
        first, self._first = self._first, None
        with self._lk:
            self._round = r = {
                "t0": time.perf_counter() - (first.seconds if first is not None else 0.0),
                "todo": list(todo), "total": len(todo) + (first is not None), "built": 0,
                "compiled": 0, "rebound": 0, "left_out": len(plans) - len(keep),
                "shapes": len({shape_key(p) for p in todo}),
            }
            if first is not None:
                self._count(first.origin)
            compiles, rebinds = self._to_build()
            r = dict(r)
        expected, unpriced = self._expected(compiles, rebinds)
        if first is not None:
            head = (f"standby: {r['total']} meshes, the current one {first.origin} in "
                    f"{first.seconds:.2f} s; {len(todo)} more in {r['shapes']} shapes")
        else:
            head = f"standby: {r['total']} meshes to build in {r['shapes']} shapes"
        parts = [head, f"{compiles} to compile, {rebinds} to rebind"]
        cost = f"expected about {expected:.1f} s"
        if compiles and self._n["compiled"]:
            cost += f" ({compiles} x {self._mean('compiled'):.2f} s per compile"
            cost += ", plus the rebinds, a fraction of a compile each)" if unpriced else ")"
        parts.append(cost)
        if r["left_out"]:
            parts.append(f"max_meshes={self.max_meshes} leaves {r['left_out']} likely meshes out "
                         "(their failures compile at recovery)")
        why = self.blocker(todo[0]) if todo else None
        if why is not None and why != "rebind=False":
            parts.append(f"no rebinding: {why}")
        self._emit(StandbyProgress(
            "plan", r["built"], r["total"], r["compiled"], r["rebound"], r["left_out"], compiles,
            rebinds, expected, time.perf_counter() - r["t0"], shapes=r["shapes"],
            rebinds_unpriced=unpriced, message="; ".join(parts),
        ))
        return super().submit(keep)

    def _count(self, origin: str) -> None:
        """Count a build of this set (under the lock)."""
        self._round["built"] += 1
        self._round["compiled" if origin == "compiled" else "rebound"] += 1

    def _to_build(self) -> tuple[int, int]:
        """(compiles, rebinds) still to come in this set (under the lock): a mesh of a shape
        with no usable compile yet is a compile for the first of them, a rebind for the rest."""
        todo = self._round["todo"]
        if not todo or self.blocker(todo[0]) is not None:
            return len(todo), 0
        compiles, seen = 0, set()
        for p in todo:
            k = shape_key(p)
            src = self._sources.get(k)
            if src is not None and src["error"] is not None:
                compiles += 1
            elif src is None and k not in seen:
                compiles += 1
            seen.add(k)
        return compiles, len(todo) - compiles

    def _mean(self, origin: str) -> float:
        n = self._n[origin]
        return self._s[origin] / n if n else 0.0

    def _expected(self, compiles: int, rebinds: int) -> tuple[float, bool]:
        """Expected seconds of `compiles` and `rebinds` at the means so far; whether rebinds
        went unpriced (none timed yet)."""
        return (compiles * self._mean("compiled") + rebinds * self._mean("rebound"),
                bool(rebinds and not self._n["rebound"]))

    def _built(self, mesh: Mesh, out: StepExecutables, how: str, texts: tuple) -> None:
        with self._lk:
            self._texts[_ids(mesh)] = texts
            self._n[out.origin] += 1
            self._s[out.origin] += out.seconds
            r = self._round
            if r is None or mesh not in r["todo"]:
                return  # the current mesh (announced with the set) or one of an older set
            r["todo"].remove(mesh)
            self._count(out.origin)
            compiles, rebinds = self._to_build()
            r = dict(r)
        left, unpriced = self._expected(compiles, rebinds)
        devices = [d.id for d in np.asarray(mesh.devices).flat]
        elapsed = time.perf_counter() - r["t0"]
        msg = (f"standby: {r['built']}/{r['total']} meshes built ({r['compiled']} compiled, "
               f"{r['rebound']} rebound); {describe(mesh)} on devices {devices} {how} in "
               f"{out.seconds:.2f} s; {elapsed:.1f} s so far"
               + (f", about {left:.1f} s left" if compiles or rebinds else "")
               + (f" and {rebinds} rebinds" if unpriced else ""))
        self._emit(StandbyProgress(
            "built", r["built"], r["total"], r["compiled"], r["rebound"], r["left_out"],
            compiles, rebinds, left, elapsed, mesh=dict(mesh.shape), devices=devices, how=how,
            seconds=out.seconds, shapes=r["shapes"], rebinds_unpriced=unpriced, message=msg,
        ))

    def _emit(self, rec: StandbyProgress) -> None:
        self.log.append(rec)
        del self.log[:-LOG_KEPT]
        if self.progress is True:
            print(rec.message, file=sys.stderr, flush=True)
        elif callable(self.progress):
            self.progress(rec)
