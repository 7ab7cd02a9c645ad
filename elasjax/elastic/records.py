"""What the pieces report: a recovery (`Recovery`), an admission of restarted processes (`Join`),
and a recovery attempt that succeeded (`Attempt`, internal)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from ..observe.metrics import RecoveryRecord

PyTree = Any


@dataclasses.dataclass(kw_only=True)
class Recovery(RecoveryRecord):
    """What one `recover` did (the fields every recovery reports: `RecoveryRecord`), and the
    meshes before and after, the spare devices left out of the new mesh, and why the snapshot
    rungs failed when a checkpoint was used (`unrecoverable`). `compile_s`: the wait for the
    standby's executable of the new mesh (a cold compile when it was not ready), or without
    standby the compile of the new mesh's checksums. Times in seconds."""

    from_mesh: dict[str, int]
    to_mesh: dict[str, int]
    spares: list[int]
    unrecoverable: str = ""
    # what the failure was (real process deaths under `elasjax launch`, or simulated), how long
    # its detection took (from the kill to the verdict where the kill's time is known; 0 when
    # simulated), the processes that died, the attempts (a death during a recovery starts another
    # from what is left; `retry_s` the failed ones' time), the collectives' renewal's seconds,
    # the bytes that crossed processes, and the first step after it (the redone one: its
    # dispatch to its commit; None until it ran)
    failure_simulation: str = ""
    detect_s: float = 0.0
    failed_processes: list[int] = dataclasses.field(default_factory=list)
    attempts: int = 1
    retry_s: float = 0.0
    renew_s: float = 0.0
    bytes_cross_process: int = 0
    first_step_s: float | None = None

    @property
    def total_s(self) -> float:
        """From the failure's detection to the state verified on the new mesh."""
        return self.retry_s + self.plan_s + self.compile_s + self.transfer_s + self.verify_s

    @property
    def mttr_s(self) -> float | None:
        """Detection, recovery and the first step after it (None until that step ran)."""
        if self.first_step_s is None:
            return None
        return self.detect_s + self.total_s + self.first_step_s


@dataclasses.dataclass(kw_only=True)
class Join:
    """Restarted processes admitted into a launched script's job (`--worker-restarts`): the
    step whose committed state they got, their processes and devices, the meshes before and
    after the growth, the bytes moved (across processes too), what the grown state's checksums
    were compared with (`verify`, `verified`), and the seconds of each part (`total_s`: from
    the admission's start, on each process)."""

    step: int
    processes: list[int]
    devices: list[int]
    from_mesh: dict[str, int]
    to_mesh: dict[str, int]
    bytes_moved: int
    bytes_cross_process: int
    verify: dict
    verified: bool
    compile_s: float
    transfer_s: float
    verify_s: float
    total_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attempt:
    """A recovery attempt that succeeded (`ElasticState._attempt`): the state rebuilt on `mesh`
    and verified (`done`, with the new layout's snapshot pool), what it came from, and each
    phase's seconds."""

    state: PyTree
    mesh: Mesh
    spare: list
    done: Any  # transfer.verified.Protected
    log: Any  # the transition's TransferLog (None: restored from a checkpoint)
    step: int  # the step whose state it is
    why: str  # why the live copies did not do (a checkpoint was used), else ""
    rung: str
    hit: bool | None
    exe: Any  # the standby's step for `mesh` (None without a standby)
    sums_fn: Any
    same: bool  # the state has `shardings(mesh)` (its checksums compiled for them apply)
    plan_s: float
    compile_s: float
    transfer_s: float
