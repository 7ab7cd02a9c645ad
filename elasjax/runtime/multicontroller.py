"""The multi-controller runtime: one process per host on `jax.distributed`, surviving the death
of any process. The trainer (`elasjax.loop.trainer`) runs on it unchanged.

One Python process per host (here: per group of `devices_per_process` CPU devices) runs the same
program; `jax.distributed` connects them through a coordination service that runs in a process
of its own, holding no device (`runtime.coordinator`), and their collectives run over gloo (CPU)
or NCCL (GPU). A failure is a process that dies. The engine's own primitives do the fault
tolerance; this module wires them up:

- `initialize` turns on `jax_enable_recoverability` (a dead peer no longer takes everyone down),
  a short coordination heartbeat and `--xla_cpu_collective_timeout_seconds` (without it the
  survivors of a kill wait in a gloo collective for minutes; it is also what releases a survivor
  blocked in a collective with a dead peer: gloo reports the dead socket only when the timed-out
  receive returns, and there is no way to abort a CPU collective from Python).
- The fast detector (`liveness.Liveness`): every process writes a heartbeat key to the coordination
  service's key-value store every `liveness_interval_s` and watches the others'.
- `guard(phase)` runs an entry barrier, the block, then an exit barrier through the key-value
  store: the lowest live process (the arbiter) waits for every live process's "done" and declares
  dead exactly those that never posted it *and* whose heartbeat has been silent for
  `liveness_timeout_s` (a step's exit) or `heartbeat_timeout_s`; every process reads its
  verdict, so all survivors raise `DeviceFailure` with the same devices and plan the same next
  layout (the planner is pure). An arbiter that dies is succeeded by the next live process,
  which declares it dead with the others; the first verdict posted is the one every process
  reads. A slow process keeps beating and is waited for. (This replaces `multihost_utils.live_devices`, whose
  membership check waits for the coordination service's own, slower heartbeat:
  experiments/RESULTS.md, "Detecting a death".)
- A peer known dead inside a guard's block (its exit, a death notice, a long heartbeat silence)
  has this process's collectives shut down once it no longer computes (`aborts.CollectiveAborts`:
  a collective posted after the shutdown would wait for the timeout), and the recovery
  renews the CPU client (`renew_collectives`).
- Cross-process copies and small values (a transition's pieces, snapshot copies, snapshot
  refusals, cut-over readiness) go through `dataplane.DataPlane`: point to point for arrays, the
  key-value store for values, numbered alike on every process.
- Kills are real: a scheduled `kill_process` event makes that process write the time to the
  key-value store and send itself SIGKILL right after dispatching its step (its collectives in
  flight), or during a recovery's transfer; survivors report kill -> error.

- A restarted process rejoins (`membership`): it asks, the live processes admit it at a step
  boundary and create a new CPU client together with it (a fresh gloo communicator generation:
  `admit`), and the trainer grows onto its devices.

Limits (see docs/limits.md): the coordination process's death ends the job (every training
process needs the service); rejoining is implemented on CPU/gloo only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.errors import JaxRuntimeError

from ..core import jaxcompat
from ..plan.planner import Topology
from ..transfer.copies import CopyThreads
from ..transfer.shards import ShardStore
from . import failures, kvwait, membership
from .aborts import CollectiveAborts
from .collectives import (
    Renewal, drain, quiet_gloo_loops, reachable_cliques, rendezvous_note, renew_cpu_client,
    renewal_reason,
)
from .dataplane import DataPlane
from .deathnote import DeathNotes
from .faults import MULTI_CONTROLLER, FaultEvent
from .inprocess import DeviceFailure
from .liveness import Liveness, ProcessExits, SlowSteps, peer_state
from .p2p import TransferLinks
from .startup import STARTED, STARVED_MAX_S, RuntimeConfig, kv_client, kv_float
from .verdict import Barriers, Verdict


class RejoinUnsupportedError(RuntimeError):
    """Growing the membership (a process rejoining) is not possible on this platform (GPU)."""


# A live process seen waiting at another barrier than this process's for this long means the
# processes ran different guards and wait for each other forever: the job stops with
# `DivergedError` instead of hanging silently
DIVERGE_AFTER_S = 120.0


# ---------------------------------------------------------------------------------------------
# The runtime.

def _footprint() -> str:
    """This process's resident memory and mappings, as its kill is logged: what the kernel
    tears down before its pidfd turns readable to its peers (`liveness.ProcessExits`)."""
    try:
        with open("/proc/self/status") as f:
            rss = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        with open("/proc/self/maps", "rb") as f:
            maps = sum(1 for _ in f)
    except (OSError, StopIteration, ValueError):
        return "footprint unknown"
    return f"{rss / 2**20:.2f} GB resident, {maps} mappings"


class MultiControllerRuntime:
    """This process's part of a `jax.distributed` job (see the module docstring). A host is a
    process: `topology` groups each process's devices."""

    kind = MULTI_CONTROLLER
    step_sync = True  # every step completes inside its guard, so its metrics are read at once
    failure_simulation = "real: a process of a jax.distributed job died"
    donate = False  # a step a death interrupts must leave its input state readable
    device_failures = False  # a device cannot fail alone: its process goes with it
    host_copies_off_host = True  # a process's host memory dies with it
    devices_return = True  # a restarted process rejoins (`admit`)
    rejoins = True
    # one process compiles a program, the others load it, where this JAX's loaded programs
    # work in a multi-process job (on jax 0.12 they did not: each process compiles)
    shares_compiles = jaxcompat.loads_in_a_multiprocess_job()

    def __init__(self, rc: RuntimeConfig):
        self.rc = rc
        self.me = rc.process_id
        self.client = kv_client()
        # a restarted process rejoins the running job (`membership`): what its admission said
        # (the counters below, the trainer's position), else None
        self.admission: membership.Admission | None = None
        self.rejoined: set[int] = set()  # processes admitted into the running job
        self._joining: dict[int, str] = {}  # requests named by the last step's verdict
        # every process posts its pid first: live peers watch a newcomer's exit from admission on
        self.exits = ProcessExits(self.client, self.me, range(rc.num_processes), rc.watch_exits)
        if kv_float(self.client, STARTED) is not None:
            if rc.platform != "cpu":
                raise RejoinUnsupportedError(
                    f"process {self.me} was restarted into a running job: rejoining is "
                    "implemented on CPU/gloo only (see docs/multiprocess.md, 'Restarted workers rejoin')")
            self._await_admission()
        devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.devices = {d.id: d for d in devs}
        per = {p: sum(1 for d in devs if d.process_index == p) for p in range(jax.process_count())}
        if len(set(per.values())) != 1:
            raise RuntimeError(f"processes hold different device counts: {per}")
        self.topology = Topology(tuple(d.id for d in devs), per[self.me])
        self.live: set[int] = set(self.devices)
        self.local = jax.local_devices()
        self.threads = CopyThreads()
        self._started = False
        self.fenced = False  # declared dead by the others (`failures.fenced`)
        self.generation = 0  # CPU clients replaced so far (`renew_collectives`, `admit`)
        self._steps = 0  # step guards entered (for `rc.slow`)
        self._retries = 0  # collective failures among live processes since the last good step
        self.links = TransferLinks(self.client, self.me, rc.host, max(30, rc.collective_timeout_s),
                                   self.peer_gone)
        self.plane = DataPlane(self.client, self.me, self.links, rc.collective_timeout_s + 5,
                               self.devices, self.process_of, self.processes, self.current,
                               self.peer_gone)
        if self.admission is not None:
            self._adopt_counters(self.admission.counters)
        self.links.start(self.local[0])
        self._quiet_loops()
        self._drained: tuple[float, int, int] | None = None  # the last `_drain`: (s, arrays, failed)
        # a live peer waiting at another barrier this long is a divergence (`DivergedError`):
        # far above any skew between processes at one barrier (a start's compile included:
        # 0.00-0.01 s at the start's entry barriers in 20 supervised launches, experiments/
        # RESULTS.md "Supervised resumes after the lone-survivor fix")
        self.diverge_after_s = max(DIVERGE_AFTER_S, 4.0 * rc.heartbeat_timeout_s)
        # each live process's arrival at the last entry barrier (s after the first), for the
        # messages of a failure in the block after it (`_arrival_note`)
        self._arrivals: dict[int, float] = {}
        self.liveness = Liveness(
            self.client, self.me, sorted(self.processes()), rc.liveness_interval_s,
            rc.liveness_timeout_s, cpu_of=self.exits.cpu_s,
        )
        # the guards' barriers and their verdicts (`verdict.Barriers`)
        self.barriers = Barriers(self.client, self.me, self.liveness, self.exits, self.log,
                                 rc.heartbeat_timeout_s, rc.num_processes, rc.init_timeout_s,
                                 self.diverge_after_s, STARVED_MAX_S,
                                 self.admission.counters.guards if self.admission else 0)
        # a peer known dead inside a block shuts this process's collectives down once it is quiet
        # (they would wait for the collective timeout), when a renewed client can replace them
        self.aborts = CollectiveAborts(rc, self.exits, self.liveness, self.processes, self.log,
                                       client=self.client, devices_of=self.devices_of)
        self.notes = DeathNotes(self.client, self.me, rc.host, self.aborts.on_notice,
                                rc.death_notices)
        self.aborts.start()
        self.slowed = SlowSteps(rc.slow, self.me, self.log)  # `rc.slow`: for benchmarks

    # -- who is where ---------------------------------------------------------------------------

    def process_of(self, device) -> int:
        if isinstance(device, str):  # "host:<h>": a host is a process
            return int(device.split(":")[1])
        return self.devices[device].process_index

    def devices_of(self, p: int) -> set[int]:
        """Process p's device ids (its devices of every client: the ids outlive a renewal)."""
        return {i for i, d in self.devices.items() if d.process_index == p}

    def processes(self) -> set[int]:
        return {self.devices[d].process_index for d in self.live}

    def peer_gone(self, p: int) -> bool:
        """Process p has left the job, exited (pidfd, a death notice), or been silent past the
        heartbeat timeout without its CPU time advancing: what the arbiter of a barrier outside
        a step declares dead (`liveness.peer_state`)."""
        if p == self.me:
            return False
        if p not in self.processes():
            return True
        limit = self.liveness_timeout("compile", at_exit=False)
        return peer_state(p, self.liveness, self.exits, limit, STARVED_MAX_S)[0] in (
            "exited", "dead")

    @property
    def writer_process(self) -> int:
        """The process that writes the run's files: the lowest live one that has run since the
        start (a rejoined process has not seen the steps before its admission), the lowest live
        one when only rejoined processes are left."""
        live = self.processes()
        return min(live - self.rejoined or live)

    @property
    def writer(self) -> bool:
        """This process writes the run's files now (never once it was declared dead: the
        others went on without it, and the next one writes them)."""
        return not self.fenced and self.me == self.writer_process

    def log(self, msg: str) -> None:
        print(f"[elasjax p{self.me}] {msg}", flush=True)

    # -- failures -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self, phase: str):
        """Run the block on every live process between an entry barrier (nobody starts the
        block's collectives while a peer is still busy, e.g. compiling) and an exit barrier
        where all agree on what happened.

        The barrier goes through the key-value store: each process posts whether its block
        raised; the arbiter (the lowest live process; when it dies, the next one takes over:
        `verdict.Barriers`) waits for every live process's post and declares dead exactly the
        processes that are silent (`Liveness`) and never posted, then posts the verdict every
        process reads. So every survivor raises
        `DeviceFailure` with the same processes. A block that raised while nobody died raises
        on every process (`PeerError` where the block itself succeeded): the guard stays atomic.
        A survivor blocked in a collective with a dead peer is released by the collective
        timeout (gloo reports the dead socket only then); the verdict follows within ~0.1 s.
        """
        t_block = time.time()
        self.liveness.phase = phase
        if phase == "step":
            self._steps += 1
            self.slowed.at(self._steps - 1)
        # entry barrier: nobody enters a collective while a peer is still busy with local work
        # (a compile): with a short collective timeout that wait would fail the collective
        verdict = self._exit_barrier(None, self.liveness_timeout(phase, at_exit=False), "entry")
        self._arrivals = verdict.arrived
        if phase.startswith("start") and len(self._arrivals) > 1:
            self.log(f"{phase} entry barrier: {self._arrival_note()}")
        fence = failures.fenced(verdict, self.me, phase)
        if fence is not None:
            self.fenced = True
            raise fence from None
        if verdict.failed:
            raise self._failure(verdict, phase, t_block, None, None)
        err: BaseException | None = None
        t_err = None
        t_body = time.time()  # collectives can only wait from here on
        self.aborts.enter_block(phase)
        try:
            try:
                yield
            except Exception as e:  # decided at the barrier, with every other live process
                err, t_err = e, time.time()
                note = rendezvous_note(self.client, e)
                if note is not None:
                    self.log(f"{phase}: {note} ({t_err - t_body:.1f}s into the block)")
            # the block's programs may still run in the drain: an abort waiting for this
            # process to be quiet (`CollectiveAborts.abort_when_quiet`) may still end them
            self._drain(phase, err)
        finally:
            self.aborts.leave_block()
        verdict = self._exit_barrier(err, self.liveness_timeout(phase, at_exit=True))
        fence = failures.fenced(verdict, self.me, phase)
        if fence is not None:
            self.fenced = True
            raise fence from err
        if verdict.failed:
            raise self._failure(verdict, phase, t_block, t_err, err, t_body) from err
        if verdict.errors:
            # this process's own error (every process raises; none is dead); a read that gave
            # up on a writer the verdict finds alive is the runtime's, as its timeout was
            if err is not None and not isinstance(err, (JaxRuntimeError, kvwait.WriterGone)):
                raise err
            if failures.retryable(verdict, self.rc.platform, self.rc.renew_collectives,
                                  self._retries):
                self._retries += 1
                retry = failures.collective_retry(
                    verdict, phase, self._retries,
                    failures.Clocks(t_block, time.time(), t_err, t_body),
                    drain_s=self._drained[0] if self._drained else None,
                    collective_timeout_s=self.rc.collective_timeout_s)
                self.log(f"{phase}: {retry.cause}: renewing the collectives and redoing the "
                         f"{phase} ({verdict.errors_line(160)}; {self._arrival_note()})")
                raise retry from err
            raise failures.peer_error(verdict, phase, self._arrival_note(),
                                      self.rc.collective_timeout_s) from err
        if phase == "step":
            self._retries = 0  # a good step: collective retries start again
            self._joining = dict(verdict.joining)
        if not self._started:  # a process restarted from now on is a rejoin (see __init__)
            self._started = True
            if self.writer:
                self.client.key_value_set(STARTED, repr(time.time()), allow_overwrite=True)

    def _arrival_note(self) -> str:
        return failures.arrival_note(self._arrivals)

    def _drain(self, phase: str, err: BaseException | None) -> None:
        """Before a block that raised (or whose collectives this process shut down) is reported,
        wait until every program this process dispatched has ended (`collectives.drain`): one
        still waiting in a collective would post to a communicator that its peers have left,
        and the next collective on it would receive that stale message. A block that completed
        committed what it dispatched (`commit`). The wait is in the failure's detail
        (`drain_s`)."""
        self._drained = None
        if err is None and self.aborts.reason is None:
            return
        t0 = time.perf_counter()
        n, failed = drain(jax.live_arrays())
        took = time.perf_counter() - t0
        self._drained = (took, n, failed)
        if took > 0.05:
            self.log(f"{phase}: waited {took:.2f}s for {n} arrays ({failed} failed) of the "
                     "interrupted block's programs before reporting it")

    def liveness_timeout(self, phase: str, at_exit: bool = True) -> float:
        """The silence that makes a process absent from a barrier dead: the fast
        `liveness_timeout_s` at a step's exit (a death inside the step); at every entry barrier
        and the other phases' exits (start-up, recovery, cut-over, checkpoint: XLA compiles run
        in them or beside them and starve the heartbeat thread for over a second in live
        processes: experiments/RESULTS.md, "Multi-process observations") the slower
        `heartbeat_timeout_s`."""
        if phase == "step" and at_exit:
            return self.rc.liveness_timeout_s
        return max(self.rc.liveness_timeout_s, float(self.rc.heartbeat_timeout_s))

    def _exit_barrier(self, err: BaseException | None, timeout: float,
                      where: str = "exit") -> Verdict:
        self.exits.watch()  # every process: its exit watcher aborts collectives (`aborts`)
        self.notes.refresh(self.processes())  # where to send this process's death notice
        # a same-host peer silent past the fast timeout with its CPU time standing still is
        # stopped or hung at any barrier (a compile would burn CPU): `liveness.peer_state`
        return self.barriers.barrier(err, timeout, where, sorted(self.processes()),
                                     stuck_after=self.rc.liveness_timeout_s)

    def _failure(
        self, verdict: Verdict, phase: str, t_block: float, t_err, err,
        t_body: float | None = None
    ) -> DeviceFailure:
        """The failure `verdict` declared: the dead processes' devices leave the live set, the
        detectors forget them, and the survivors' report is made (`failures.describe`)."""
        t_known = time.time()
        procs = list(verdict.failed)
        failed = {d for d in self.live if self.devices[d].process_index in procs}
        kills = [kv_float(self.client, f"elasjax/kill/{p}") for p in procs]
        kills = [t for t in kills if t is not None]
        seen = [self.liveness.first_silent[p] for p in procs if p in self.liveness.first_silent]
        exits = [self.exits.seen[p] for p in procs if p in self.exits.seen]
        clocks = failures.Clocks(t_block, t_known, t_err, t_body, min(kills) if kills else None,
                                 min(seen) if seen else None, min(exits) if exits else None)
        self.live -= failed
        self.liveness.forget(procs)
        self.exits.forget(procs)
        incident = self.plane.next_incident()
        self.links.forget(procs)
        report = failures.describe(
            verdict, procs, phase, err, clocks, aborted=self.aborts.reason,
            drain_s=self._drained[0] if self._drained else None, incident=incident,
            collective_timeout_s=self.rc.collective_timeout_s,
            heartbeat_timeout_s=self.rc.heartbeat_timeout_s)
        k2d = report.kill_to_detect_s
        # this survivor's kill -> detected time, for the writer's `detection_report`
        self.client.key_value_set(f"elasjax/detect/{incident}/{self.me}", json.dumps(k2d),
                                  allow_overwrite=True)
        self.log(failures.log_line(report, phase, sorted(failed), bool(kills)))
        return DeviceFailure(
            failed, phase, detect_s=k2d if k2d is not None else t_known - t_block,
            cause=failures.victims(procs, bool(kills)), report=report,
        )

    def detection_report(self, incident: int | None) -> dict:
        """Every survivor's kill -> detected time of failure `incident` (`FailureReport`)."""
        if incident is None:
            return {}
        per = {}
        for p in sorted(self.processes()):
            try:
                per[str(p)] = json.loads(self.client.blocking_key_value_get(
                    f"elasjax/detect/{incident}/{p}", 5000))
            except JaxRuntimeError:  # that process never reported
                continue
        return {"detect_per_process_s": per}

    def renew_collectives(self, failure: DeviceFailure) -> Renewal | None:
        """After `failure`, replace every live process's CPU client by one with no gloo
        communicator when any of them votes so (`collectives.renewal_reason`: under `auto`, any
        process whose block was interrupted or whose collectives were shut down) and, under
        `auto`, some communicator of the client could still be reached: one among live devices
        only, in any process's reading (`collectives.reachable_cliques`; the module docstring
        of `collectives` says why that is the rule). Where none can, the client is kept and
        every live process starts a new transfer server (an abort cut the old one's
        connections). Every live process calls it at the same point (a recovery's plan phase,
        a start's retry) and reaches the same decision from the same votes. Returns what
        happened (for the event), or None when nobody asked. After a renewal, executables are
        reloaded on use (`executables.on_devices`), shard buffers copied over by `current`."""
        mine = renewal_reason(self.rc.renew_collectives, self.rc.platform, failure,
                              self.aborts.reason)
        reach = (reachable_cliques(self.client, self.live)
                 if self.rc.platform == "cpu" and self.rc.renew_collectives == "auto" else None)
        votes = self.agree({"why": mine, "reach": reach})  # each process's reason and reading
        why = "; ".join(f"process {p}: {v['why']}" for p, v in sorted(votes.items()) if v["why"])
        if not why:
            return None
        t0 = time.perf_counter()
        if self.rc.renew_collectives == "auto" and not any(v["reach"] for v in votes.values()):
            self.links.start(self.local[0])
            self.aborts.clear()  # no communicator it shut down is used again
            took = time.perf_counter() - t0
            self.log(f"kept the CPU client (generation {self.generation}): every gloo "
                     f"communicator it made includes a dead device; new transfer server in "
                     f"{took:.3f}s ({why})")
            return Renewal(self.generation, took, why, kept=True)
        self._new_client(self.generation + 1)
        took = time.perf_counter() - t0
        reached = sorted({c for v in votes.values() for c in v["reach"] or ()})
        among = f"; communicators among survivors: {reached}" if reached else ""
        self.log(f"new CPU client (generation {self.generation}, fresh gloo communicators) in "
                 f"{took:.3f}s ({why}{among})")
        return Renewal(self.generation, took, why)

    def _new_client(self, generation: int) -> None:
        """Replace the CPU client by a new one, every live process at once (`renew_cpu_client`)."""
        self.generation = generation
        writer = self.writer_process
        devs = renew_cpu_client(
            self.client, self.processes(), generation, self.me == writer,
            (self.rc.collective_timeout_s + 30) * 1000,
            read=lambda key, ms: kvwait.read(self.client, key, ms, writer, self.peer_gone),
        )
        self.devices.update({d.id: d for d in devs})
        self.local = jax.local_devices()
        self.links.start(self.local[0])
        self.aborts.clear()  # the new client's collectives are whole
        self._quiet_loops()

    def _quiet_loops(self) -> None:
        """The current CPU client's gloo event loop found (the quiet wait leaves it out,
        `aborts.running_threads`) and, under `launch.gloo_loop: idle`, set to SCHED_IDLE
        (`collectives.quiet_gloo_loops`)."""
        if self.rc.platform != "cpu":
            return
        tids = quiet_gloo_loops(self.rc.gloo_loop)
        if not tids:
            self.log("no gloo event loop thread found (its priority left as it is)")
        elif self.rc.gloo_loop == "idle":
            self.log(f"gloo event loop thread(s) {tids} set to SCHED_IDLE (launch.gloo_loop)")

    # -- membership growth (`membership`) -------------------------------------------------------

    def _await_admission(self) -> None:
        """A restarted process: ask to rejoin, wait for the admission (`rc.init_timeout_s`),
        then create the CPU client together with the live processes (`admit`)."""
        nonce = membership.request(self.client, self.me)
        self.log(f"restarted into a running job: asked to rejoin (pid {os.getpid()})")
        self.admission = membership.await_admission(
            self.client, self.me, nonce, self.rc.init_timeout_s)
        counters = self.admission.counters
        renew_cpu_client(self.client, sorted(counters.processes), counters.generation,
                         False, (self.rc.collective_timeout_s + 30) * 1000)

    def _adopt_counters(self, c: membership.Counters) -> None:
        """The live processes' counters at the admission: every numbered exchange (guards,
        agreements, copies, transfer servers) continues where theirs do."""
        self.live = set(c.live)
        self.plane.incident, self.plane.seq = c.epoch, c.seq  # (guards: `Barriers`, below)
        self._steps, self._retries, self.generation = c.steps, c.retries, c.generation
        self.links.started = c.xfer_started
        self.rejoined = set(c.rejoined)
        self._started = True

    def joiners(self) -> list[int]:
        """The restarted processes the last step's verdict named (every live process reads the
        same list)."""
        return sorted(self._joining)

    def admit(self, package) -> membership.Admitted:
        """Admit the processes `joiners` names into the job (every live process calls it at the
        same step boundary): the writer posts each one's admission (the runtime's counters and
        `package`, the trainer's position), then every live process and the newcomers create a
        new CPU client together (a fresh gloo communicator generation; the old rendezvous keys
        are deleted first). The newcomers' devices are live from now on, holding nothing.
        Returns what happened, for the join's event."""
        t0 = time.perf_counter()
        joining, self._joining = self._joining, {}
        procs = sorted(joining)
        added = {d for d, dev in self.devices.items() if dev.process_index in joining}
        live = self.live | added
        gen = self.generation + 1
        if self.writer:
            counters = membership.Counters(
                live=tuple(sorted(live)), processes=tuple(sorted(self.processes() | set(procs))),
                guards=self.barriers.guards, epoch=self.plane.incident, seq=self.plane.seq,
                steps=self._steps,
                retries=self._retries, generation=gen, xfer_started=self.links.started,
                rejoined=tuple(sorted(self.rejoined | set(procs))), admitted=tuple(procs),
                admitted_devices=tuple(sorted(added)),
            )
            for p in procs:
                # the kill its last incarnation posted is not this one's: a later death of the
                # newcomer would be reported with that kill's time (`_failure`)
                self.client.key_value_delete(f"elasjax/kill/{p}")
                membership.post_admission(self.client, p, joining[p],
                                          membership.Admission(counters, package))
        self.live = live
        self.rejoined |= set(procs)
        self.liveness.rejoin(procs)
        self.exits.rejoin(procs)
        self.notes.forget(procs)
        self.links.forget(procs)
        self._new_client(gen)
        took = time.perf_counter() - t0
        self.log(f"admitted process(es) {procs} (devices {sorted(added)}): a new CPU client "
                 f"(generation {gen}) with them in {took:.3f}s")
        return membership.Admitted(tuple(procs), tuple(sorted(added)), gen, took)

    def join(self, device_ids) -> None:
        """Devices return: under this runtime only a newcomer's, admitted already (`admit`)."""
        missing = set(device_ids) - self.live
        if missing:
            raise ValueError(f"devices {sorted(missing)} are not live: a process returns by "
                             "rejoining (`admit`), never by a fault schedule's join")

    def current(self, x):
        """`x` (a single-device array) on the current client's device of the same id: a copy
        when the CPU client was renewed after `x` was made, `x` itself otherwise."""
        if self.generation == 0 or not isinstance(x, jax.Array):
            return x
        (d,) = x.devices()
        cur = self.devices[d.id]
        return x if d.client is cur.client else jax.device_put(x, cur)

    def inject(self, events: Sequence[FaultEvent], point: str, trees: Sequence[Any] = ()) -> None:
        for e in events:
            if e.kind == "stall" and e.stall_process == self.me and point == "before_step":
                self.log(f"stalling {e.stall_s:g}s before dispatching step {e.at_step} ({e.spec})")
                time.sleep(e.stall_s)
        if point not in ("after_dispatch", "plan", "transfer", "verify", "admission"):
            return
        for e in events:
            if e.kind != "stall" and self.me in e.hosts:
                self.client.key_value_set(f"elasjax/kill/{self.me}", repr(time.time()), True)
                self.log(f"sending SIGKILL to myself ({e.spec}, at step {e.at_step}, {point}; "
                         f"{_footprint()})")
                os.kill(os.getpid(), signal.SIGKILL)

    def capture(self, tree, dead) -> ShardStore:
        return ShardStore.capture(tree, dead)

    def commit(self, tree) -> None:
        """Wait for `tree`; where one of its programs failed, wait for the others too before
        raising (`collectives.drain`): a block reports only once nothing it dispatched runs."""
        leaves = [x for x in jax.tree.leaves(tree) if x is not None]
        try:
            jax.block_until_ready(leaves)
        except Exception:
            drain(leaves)
            raise

    # -- between processes (`dataplane`) --------------------------------------------------------

    def exchange(self, sends: dict[int, list[np.ndarray]], recvs: dict[int, list[tuple]]) -> dict:
        return self.plane.exchange(sends, recvs, self.local[0])

    def move(self, items: Sequence[tuple]) -> list:
        return self.plane.move(items)

    def agree(self, value) -> dict[int, Any]:
        return self.plane.agree(value)

    def share(self, value, src: int):
        return self.plane.share(value, src)

    def close(self, finished: bool = True) -> None:
        """End this process's part; `finished`: it is leaving after a normal end (its death
        notice is withdrawn), else its exit is announced to the peers (`deathnote`)."""
        self.slowed.stop()
        self.liveness.close()
        self.exits.close()
        self.notes.close(announce=not finished)
        if finished:  # a newcomer still waiting to rejoin stops waiting (`membership`)
            membership.post_ended(self.client)
        gaps = {p: round(g, 3) for p, g in self.liveness.max_gap.items()}
        self.log(f"longest heartbeat silence seen, by peer: {gaps}")
        if self.liveness.long_gaps:
            self.log("heartbeat silences over half the liveness timeout (peer, s, my phase): "
                     + "; ".join(f"{p} {g:.2f} {ph}" for _, p, g, ph in self.liveness.long_gaps))
        self.threads.close()
