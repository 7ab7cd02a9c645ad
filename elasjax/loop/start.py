"""The start of a run: a verified first position on whoever is alive.

Three guards, in the order that keeps every process's first collective together
(docs/launch-internals.md, "The start"): `start/compile` (the plan's executables and, for a fresh
start, the initial state's program), `start/state` (the initial state, or a checkpoint's read:
Orbax's I/O and point-to-point copies, no collective) and `start/verify` (the checksums, the
job's first collective, right after that guard's entry barrier). A failure in any of them starts
again on the survivors, on a new CPU client where it interrupted a block: XLA keeps a
communicator whose creation failed for the client's life (`runtime.collectives`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..compilation.executables import Executables
from ..compilation.source import ExecutableSource
from ..config import Config
from ..layout.state import StateFactory
from ..plan.planner import Plan, Topology, replan
from ..runtime.base import Runtime
from ..runtime.inprocess import DeviceFailure
from ..transfer import checksum
from ..transfer.checkpoint import Checkpointer, form_of, restore_onto
from ..transfer.snapshot import SnapshotPool
from .recovery import Position, host_checksums


@dataclasses.dataclass(frozen=True)
class Started:
    """What the start produced: the first position, its snapshot pool (the start state's
    snapshot taken), the failures during the start (each one started it again on the
    survivors) and the newer checkpoints a resume deleted (the caller says so)."""

    pos: Position
    pool: SnapshotPool
    failures: tuple[DeviceFailure, ...]
    dropped: tuple[int, ...]


def start(cfg: Config, rt: Runtime, topo: Topology, initial: Plan, source: ExecutableSource,
          factory: StateFactory, ckpt: Checkpointer | None,
          new_pool: Callable[[], SnapshotPool]) -> Started:
    """The initial position (a fresh start, or a checkpoint resume, `checkpoint.resume_step`)
    of `initial`, re-planned onto the survivors where devices are gone, and its pool."""
    failures = []
    pool = new_pool()
    while True:
        live = set(rt.live)
        try:
            with rt.guard("start/compile"):
                plan = initial
                if live != set(topo.device_ids):
                    survivors = [d for d in topo.device_ids if d in live]
                    plan = replan(survivors, topo, cfg, initial, initial)
                fresh = cfg.checkpoint.resume_step is None
                exe = source.start(plan, init=fresh)
                if fresh:
                    exe.compile_init()
            with rt.guard("start/state"):
                step, state, saved, dropped = _load_state(cfg, rt, factory, ckpt, exe)
                rt.commit(state)
            with rt.guard("start/verify"):
                good = _verify(rt, ckpt, exe, step, state, saved, pool)
            break
        except DeviceFailure as f:
            failures.append(f)
            if ckpt is not None:
                ckpt.reopen(rt.processes())
            rt.renew_collectives(f)
    pos = Position(step, plan, exe, state, good, frozenset(live))
    return Started(pos, pool, tuple(failures), tuple(dropped))


def _load_state(cfg: Config, rt: Runtime, factory: StateFactory, ckpt: Checkpointer | None,
                exe: Executables):
    """(step, state, the checksums it was saved with or None, the newer checkpoints deleted)
    of a fresh start or a checkpoint resume. The checkpoint's read moves pieces point to point,
    never by a collective; a fresh state's program was compiled before (`compile_init`)."""
    rs = cfg.checkpoint.resume_step
    if rs is None:
        return 0, exe.init(), None, []
    assert ckpt is not None
    step = ckpt.resolve(rs)
    state, meta, _ = restore_onto(ckpt, step, factory, exe, devices=rt.devices, transport=rt,
                                  threads=rt.threads)
    return step, state, meta["checksums"], ckpt.drop_after(step)


def _verify(rt: Runtime, ckpt: Checkpointer | None, exe: Executables, step: int, state, saved,
            pool: SnapshotPool) -> dict[str, str]:
    """The start state's checksums (the start's first collective), checked against a
    checkpoint's; the first checkpoint and snapshot (into `pool`) of a fresh start."""
    good = host_checksums(rt, exe.checksum(state), exe)
    if saved is not None:
        bad = checksum.diff(saved, good)
        if bad:  # array data that decoded to other numbers: bad input, naming the files
            raise ckpt.checksums_differ(step, bad)  # (tests/test_bad_checkpoint.py)
        checksum.verify(saved, good, f"checkpoint {step} fails its checksums",
                        "the ones it was saved with")
    elif ckpt is not None:
        ckpt.save(0, state, good, form_of(exe.plan))
    all_live = set(exe.plan.device_ids) | set(exe.plan.spare_ids)
    pool.configure(state, exe.state_shardings, exe.mesh, all_live)
    pool.take(state, step)  # the initial state is protected too
    rt.commit(pool.in_flight())
    return good
