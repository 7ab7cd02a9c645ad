"""The runtime interface: what the trainer, the snapshot pool and the transitions may ask of the
object that runs a job (`inprocess.InProcessRuntime`, `multicontroller.MultiControllerRuntime`).

The trainer decides by the declared capabilities below, never by probing for a method: both
runtimes define every member, and tests/test_runtime_protocol.py checks that they do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

from ..plan.planner import Topology
from .collectives import Renewal
from .membership import Admission, Admitted


@runtime_checkable
class Runtime(Protocol):
    """Where a job runs (see `inprocess` for the two runtimes side by side)."""

    # -- declared capabilities -----------------------------------------------------------------
    kind: ClassVar[str]  # faults.IN_PROCESS or faults.MULTI_CONTROLLER
    failure_simulation: ClassVar[str]  # what a failure is here; written into recovery events
    # may executables donate their input state (not where a step can fail midway and its input
    # must stay readable)
    donate: ClassVar[bool]
    device_failures: ClassVar[bool]  # can one device fail alone (else its whole process goes)
    step_sync: ClassVar[bool]  # does every step complete inside its guard
    host_copies_off_host: ClassVar[bool]  # does a host's memory die with it
    # do failed devices come back: by a fault schedule's `join` (one process) or by a restarted
    # process rejoining (`elasjax launch --worker-restarts`)
    devices_return: ClassVar[bool]
    # do restarted processes ask to rejoin the running job (`joiners`, `admit`, `admission`)
    rejoins: ClassVar[bool]
    # can its processes share what one of them compiled, through the job's key-value store
    # (`client`, `peer_gone`; `compilation.shared.SharedBuilds`)
    shares_compiles: ClassVar[bool]

    # -- who is where --------------------------------------------------------------------------
    devices: dict[int, jax.Device]  # every device of the job, by id
    topology: Topology
    live: set[int]
    me: int
    writer: bool  # does this process write the run's outputs
    # a restarted process's admission (the runtime's counters and the trainer's position), or
    # None: this process started with the job
    admission: Admission | None
    client: Any  # the job's key-value store (the coordination service's client); None in one process

    def process_of(self, device) -> int: ...

    def processes(self) -> set[int] | None: ...

    def log(self, msg: str) -> None: ...

    def peer_gone(self, p: int) -> bool:
        """Has process p exited, or fallen silent as a barrier's arbiter would declare it dead
        (never this process; always False in one process)?"""

    # -- failures ------------------------------------------------------------------------------
    def guard(self, phase: str):
        """A block whose end every live process reaches together; a failure inside it raises
        `DeviceFailure` on every survivor, naming the same devices."""

    def inject(self, events: Sequence, point: str, trees: Sequence[Any] = ()) -> None:
        """Make scheduled failures happen at `point` ("before_step", "after_dispatch", in a
        recovery "plan", "transfer", "verify", and "admission"); each runtime acts at the points
        where its failures happen."""

    def detection_report(self, incident: int | None) -> dict:
        """Every survivor's detection time of failure `incident` (`FailureReport.incident`)."""

    def renew_collectives(self, failure) -> Renewal | None:
        """After a failure that interrupted a block: fresh collectives (a new CPU client under
        `jax.distributed`; never in one process)."""

    def current(self, x):
        """A buffer on the current client's device."""

    def capture(self, tree, dead: Iterable[int]):
        """What survives of a state after a failure (a `ShardStore`)."""

    def commit(self, tree) -> None:
        """Wait for `tree` where a guard must see its errors."""

    # -- membership ----------------------------------------------------------------------------
    def join(self, device_ids: Iterable[int]) -> None:
        """Failed devices return, empty."""

    def joiners(self) -> list[int]:
        """The restarted processes to admit at this step boundary (every live process reads
        the same list; empty where the runtime does not rejoin)."""

    def admit(self, package) -> Admitted:
        """Admit the processes `joiners` named, handing each `package` (the loop's part)."""

    # -- data between processes ----------------------------------------------------------------
    def exchange(self, sends: dict, recvs: dict) -> dict: ...

    def move(self, items: Sequence[tuple]) -> list: ...

    def agree(self, value) -> dict[int, Any]: ...

    def share(self, value, src: int): ...

    def close(self) -> None: ...
