"""A restarted process joins the running loop (`elasjax launch`), and the job grows back onto it.

The runtime's part (the request, the admission at a step's verdict, the new CPU client made
with the newcomer: a fresh gloo communicator generation) is `runtime.membership` and
`MultiControllerRuntime.admit`. This is the loop's part, which every live process and the
newcomer run at the same point, the step boundary of the admission:

1. `LoopState.package`: what the newcomer needs of the loop (the step, the plan, the state's
   checksums, the live devices, the fault events still to fire, the plans the run stood on,
   what the loop has seen), posted with the admission by the writer; the newcomer's loop state
   is made from it (`LoopState.arrived`).
2. `ship` (guard `admit/ship`): the writer sends the newcomer the compiled executables of the
   current plan and of every plan the run stood on that the grown job can run (loaded there, no
   compile: `executables.from_portable`); the newcomer sees the current state as global arrays
   with no shard of its own (it holds none of the current plan's devices).
3. `settle` (guard `admit/state`): the live processes move their state onto the new client's
   devices (a local copy per shard, the same transition a recovery after a renewal runs) and
   verify it against its checksums; the snapshot pool starts afresh; then the newcomer's devices
   join the live set as returned devices do in one process (`Cutovers.join`): the planner's best
   plan over the bigger set becomes the pending growth cut-over, at once through a plan the run
   stood on where one fits and is predicted faster (compiled everywhere, the newcomer included,
   by step 2), else once compiled.
   The cut-over copies the newcomer's shards from live sources and verifies them.

A failure during 2-3 is a failure like any other (the guards are atomic across processes); the
newcomer itself cannot recover one before it holds the loop's state, so it stops and may be
restarted again.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from ..compilation.executables import Executables, from_portable
from ..compilation.source import ExecutableSource
from ..config import Config
from ..layout.state import StateFactory
from ..observe.events import JoinEvent
from ..plan.planner import Plan
from ..runtime.faults import FaultEvent
from ..runtime.membership import Admitted
from ..transfer.reshard import transition
from ..transfer.shards import ShardStore, held_elsewhere
from .cutover import Cutovers
from .recovery import PendingCutover, Position, TransitionPlanner, protect_moved


@dataclasses.dataclass
class Welcomed:
    """The loop after an admission: the position with the newcomers' devices live, the new
    snapshot pool, the `join` event, the cut-over pending now (a growth, or as before)."""

    pos: Position
    pool: Any
    event: JoinEvent
    pending: PendingCutover | None


def state_held_elsewhere(exe: Executables):
    """`exe`'s plan's state as a process holding none of its devices sees it: global arrays with
    no shard here (what a hot spare holds)."""
    return jax.tree.map(held_elsewhere, exe.layout.abstract, exe.state_shardings)


class Admissions:
    """The loop's side of admitting restarted processes (see the module docstring)."""

    def __init__(self, cfg: Config, rt, factory: StateFactory, source: ExecutableSource,
                 transitions: TransitionPlanner, cutovers: Cutovers):
        self.cfg, self.rt, self.factory, self.source = cfg, rt, factory, source
        self.transitions, self.cutovers = transitions, cutovers

    def ship(self, pos: Position, newcomers: list[int], live_after: set[int],
             stood_on: Iterable[Plan]) -> Position:
        """The writer sends the newcomers the executables of the current plan, of the plans the
        run stood on (`stood_on`) that `live_after` can run and that it holds compiled, and of
        the standby's plans over exactly `live_after` (every process calls it; on a live process
        the current plan's are reloaded onto the new client).
        Returns `pos` with this process's executables and, on a newcomer, its view of the
        state (`state_held_elsewhere`)."""
        rt = self.rt
        writer = rt.writer_process
        blob = None
        if rt.me == writer:
            plans = [pos.plan] + [
                p for p in stood_on
                if p.compile_key != pos.plan.compile_key and self.source.compiled(p)
                and set(p.device_ids) | set(p.spare_ids) <= live_after
            ]
            # and the standby's plans over exactly the grown set: the growth's likely target,
            # compiled ahead (`Contingencies.rejoin_plans`), which the newcomer then need not
            # compile before the job can grow
            sb = self.source.standby
            for exe in sb.ready_values() if sb is not None else ():
                p = exe.plan
                if (set(p.device_ids) | set(p.spare_ids) == live_after
                        and all(p.compile_key != q.compile_key for q in plans)):
                    plans.append(p)
            shipped = []
            for p in plans:
                exe = self.source.compiled(p) if p is not pos.plan else pos.exe
                if exe is not None and exe.portable_ok:
                    shipped.append((p, exe.portable(), exe.compile_s))
            blob = np.frombuffer(pickle.dumps(shipped), np.uint8)
        n = rt.share(None if blob is None else blob.size, writer)
        got = rt.exchange({q: [blob] for q in newcomers} if rt.me == writer else {},
                          {writer: [((n,), np.uint8)]} if rt.me in newcomers else {})
        if rt.me not in newcomers:
            return dataclasses.replace(pos, exe=self.source.current(pos.exe, pos.plan.compile_key))
        exe = None
        for plan, portable, compile_s in pickle.loads(got[writer][0].tobytes()):
            built = from_portable(self.cfg, self.factory, plan, rt.devices, portable, compile_s)
            built.origin = "shipped"
            self.source.adopt(built)
            if plan.compile_key == pos.plan.compile_key:
                exe = built
        if exe is None:  # the writer's could not be serialized: compiled here
            exe = self.source.get(pos.plan).exe
        return dataclasses.replace(pos, exe=exe, state=state_held_elsewhere(exe))

    def settle(self, pos: Position, pool, admitted: Admitted, paces: dict[str, float],
               pending: PendingCutover | None, stood_on: dict) -> Welcomed:
        """The state on the new client's devices (verified), a fresh snapshot pool, and the
        newcomers' devices live, a growth pending (every process calls it; `paces`, `pending`
        and `stood_on`: as `Cutovers.join` takes them)."""
        rt, exe = self.rt, pos.exe
        # the likely failures change with the newcomers: their transitions are planned again
        # once the job has grown (`Preparations.protect`)
        self.transitions.cache.clear()
        new_state, _ = transition(
            ShardStore.capture(pos.state).map_data(rt.current), exe.state_shardings,
            devices=rt.devices, old_layout=exe.layout, new_layout=exe.layout,
            plans=self.transitions.cache, transport=rt, threads=rt.threads,
        )
        rt.commit(new_state)
        done = protect_moved(rt, exe, new_state, pos.good, "admission", "the state before it",
                             pool, pos.step, pos.live)
        actual, new_pool = done.actual, done.pool
        procs = list(admitted.processes)
        event = FaultEvent(pos.step, tuple(admitted.devices), "join",
                           f"process{'es' if len(procs) > 1 else ''} {procs} rejoined",
                           hosts=tuple(procs))
        new_pos, jev, pending = self.cutovers.join(
            dataclasses.replace(pos, state=new_state, good=actual), [event], paces, pending,
            stood_on)
        jev.verify = done.compared.as_dict()
        return Welcomed(new_pos, new_pool, jev, pending)
