"""A restarted process rejoins a running `elasjax launch` job (the multi-controller runtime on
CPU/gloo): the key-value protocol between the newcomer and the live processes.

Why a protocol: a restarted process reconnects to the coordination service (tasks are
recoverable), but a CPU client of its own would meet the gloo rendezvous keys (`cpu:gloo/...`)
of the job's clients and fail ("ALREADY_EXISTS"), and the live processes would not know it is
there. So:

1. The newcomer connects to the coordination service and creates no CPU client. It posts a
   request, `elasjax/join/<p>` = {nonce, pid, time} (`request`), and waits for its admission.
2. At a step's exit barrier the arbiter lists the requests of processes outside the job in its
   verdict (`pending_requests`); every live process reads the same verdict, so all learn of them
   at the same step.
3. At the next step boundary where no recovery or migration is open (a pending growth is
   re-planned by the join), every live process admits
   them together (`MultiControllerRuntime.admit`): the writer posts each newcomer's admission,
   `elasjax/admit/<p>/<nonce>` (the runtime's counters and the trainer's position), then every
   live process and the newcomer create a new CPU client at once
   (`collectives.renew_cpu_client`: a fresh communicator generation; the old rendezvous keys are
   deleted first, so none collides).
4. The trainer ships the newcomer the executables it needs and the job grows onto the
   newcomer's devices at a growth cut-over, its state copied from live sources
   (`Trainer._welcome`).

The nonce ties an admission to one incarnation: a process restarted again never reads an
admission meant for an earlier one. A request the job never admits (the newcomer dies first, or
the job ends) leaves the job undisturbed; the newcomer gives up after its wait with
`NotAdmittedError`. Tested end to end in
tests/test_multiprocess.py::test_a_killed_process_is_restarted_rejoins_and_the_job_grows_back.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import pickle
import time
import uuid
from typing import Any

from jax.errors import JaxRuntimeError

JOIN_DIR = "elasjax/join"
ADMIT_DIR = "elasjax/admit"


@dataclasses.dataclass(frozen=True)
class Counters:
    """The live processes' runtime counters at an admission: a newcomer's numbered exchanges
    (guards, agreements, copies, transfer servers) continue where theirs do."""

    live: tuple[int, ...]  # live devices, the newcomers' included
    processes: tuple[int, ...]  # live processes, the newcomers included
    guards: int
    epoch: int
    seq: int
    steps: int
    retries: int
    generation: int  # of the CPU client made with the newcomers
    xfer_started: int
    rejoined: tuple[int, ...]
    # every process of this admission: newcomers admitted together each learn of the others
    # (their devices join the live set on every process alike)
    admitted: tuple[int, ...]
    admitted_devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Admission:
    """What the writer posts to one newcomer (pickled): the live processes' counters and the
    loop's package (`elasjax.loop.loopstate.LoopPackage`)."""

    counters: Counters
    loop: Any


@dataclasses.dataclass(frozen=True)
class Admitted:
    """An admission as each of its processes sees it (`MultiControllerRuntime.admit`)."""

    processes: tuple[int, ...]
    devices: tuple[int, ...]
    generation: int
    admit_s: float | None  # the live processes' time in `admit` (None on a newcomer)


class AdmissionInterruptedError(RuntimeError):
    """A failure interrupted this restarted process's admission (the loop's or a user's): it
    holds nothing of the state yet, so it cannot recover; it leaves the job, the survivors
    recover without it, and a restart may ask again."""

    def __init__(self, step: int, cause: str):
        super().__init__(f"a failure interrupted this process's admission at step {step} "
                         f"({cause}); it leaves the job (a restart may ask again)")


class NotAdmittedError(RuntimeError):
    """A restarted process asked to rejoin and was not admitted within its wait."""


class JobEndedError(NotAdmittedError):
    """A restarted process asked to rejoin a job that finished meanwhile: nothing to join (the
    process exits 0)."""


# posted by a process that finished the run normally (`post_ended`): a newcomer still waiting
# for its admission then stops waiting (`await_admission`)
ENDED = "elasjax/ended"
ENDED_POLL_S = 1.0


def post_ended(client) -> None:
    """The run finished here: a newcomer waiting to rejoin will never be admitted."""
    with contextlib.suppress(JaxRuntimeError):
        client.key_value_set(ENDED, repr(time.time()), allow_overwrite=True)


@dataclasses.dataclass(frozen=True)
class JoinRequest:
    """A restarted process's request to rejoin (`elasjax/join/<p>`)."""

    nonce: str  # ties the admission to this incarnation
    pid: int
    t: float  # when it was posted (time.time())


def request(client, me: int) -> str:
    """Post this process's request to rejoin; returns its nonce."""
    req = JoinRequest(uuid.uuid4().hex, os.getpid(), time.time())
    client.key_value_set(f"{JOIN_DIR}/{me}", json.dumps(dataclasses.asdict(req)),
                         allow_overwrite=True)
    return req.nonce


def pending_requests(client, outside: set[int], max_age_s: float) -> dict[int, str]:
    """{process: nonce} of the requests posted by processes in `outside` (not in the job) in
    the last `max_age_s` seconds (a newcomer waits that long, then withdraws its request; one
    killed while it waited leaves a request that expires so)."""
    try:
        entries = client.key_value_dir_get(JOIN_DIR)
    except JaxRuntimeError:  # no request was ever posted
        return {}
    out = {}
    for key, value in entries:
        p = int(key.rsplit("/", 1)[1])
        req = JoinRequest(**json.loads(value))
        if p in outside and time.time() - req.t < max_age_s:
            out[p] = req.nonce
    return out


def post_admission(client, p: int, nonce: str, body: Admission) -> None:
    """The writer's part: process p's admission (pickled), then its request removed."""
    client.key_value_set(f"{ADMIT_DIR}/{p}/{nonce}", base64.b64encode(pickle.dumps(body)).decode())
    client.key_value_delete(f"{JOIN_DIR}/{p}")


def await_admission(client, me: int, nonce: str, wait_s: float) -> Admission:
    """The newcomer's part: its admission; `JobEndedError` as soon as the job has finished (it
    looks every `ENDED_POLL_S`), `NotAdmittedError` after `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    raw = None
    while raw is None:
        left = deadline - time.monotonic()
        try:
            raw = client.blocking_key_value_get(
                f"{ADMIT_DIR}/{me}/{nonce}", max(1, int(min(left, ENDED_POLL_S) * 1000)))
        except JaxRuntimeError as e:
            ended = None
            with contextlib.suppress(JaxRuntimeError):
                ended = client.key_value_try_get(ENDED)
            if ended is None and time.monotonic() < deadline:
                continue
            with contextlib.suppress(JaxRuntimeError):  # withdrawn: no admission can find it
                client.key_value_delete(f"{JOIN_DIR}/{me}")
            if ended is not None:
                raise JobEndedError(
                    f"process {me} asked to rejoin, and the job finished before it could be "
                    "admitted: nothing left to join") from None
            raise NotAdmittedError(
                f"process {me} asked to rejoin the running job and was not admitted within "
                f"{wait_s:g}s (the job admits a newcomer at a step boundary with no recovery or "
                "migration under way; a job that has ended admits none)"
            ) from e
    client.key_value_delete(f"{ADMIT_DIR}/{me}/{nonce}")
    return pickle.loads(base64.b64decode(raw))
