"""Ending a guard's collectives at once when a peer is known dead (`CollectiveAborts`).

A survivor's collective that waits for a dead peer, or for a survivor already released by its
own error, would wait for the collective timeout: gloo reports a dead socket only when its
timed-out receive returns, and there is no way to abort a CPU collective from Python. So when
this process learns of a death inside a guard's block it shuts its collective sockets down
(`collectives.abort_collectives`: every connection but the coordination service's), once per
block, and records why; the recovery then renews the CPU client (`collectives.renewal_reason`).

Three detectors call in, each on its own thread: the kernel's exit of a same-host peer
(`on_exit`, `liveness.ProcessExits`), a death notice from the dead process's host (`on_notice`,
`deathnote`), and a heartbeat silent inside a step (`on_silent`, `liveness.Liveness`): a
same-host peer's for the liveness timeout with its CPU time standing still (stopped or hung),
another host's for `SILENCE_ABORT_FACTOR` liveness timeouts (`on_silent` says why not 1).

**Not while this process still computes.** A gloo collective posted after its process shut the
sockets down is not told so: its send waits out the collective timeout in
`UnboundBuffer::waitSend` (the stuck thread seen in gdb: experiments/RESULTS.md, "One collective
per operand under launch"). A death is known within 0.1 s, often while the survivors are still
computing the step's first part; a step whose first exchange across processes comes late (a
gradient summed over replicas once per step) then posted it after the shutdown, and a survivor
waited 8 s, 4 of 4 launches; the same abort 0.5 s later, 0 of 3 (RESULTS.md, "Aborts after the
process is quiet"). So a detector starts a waiter (`_abort_when_quiet`) that shuts the sockets
down once no other thread of this process has run for `QUIET_POLLS` polls (every device thread
is then blocked in a collective, which the shutdown ends, or done: nothing is posted after it;
`running_threads` says which threads count), or after `QUIET_WAIT_MAX_S` at most.

**Nor in a communicator's making.** A survivor whose program makes a new gloo communicator (a
plan's first collective over a device set) waits for every rank's rendezvous entry for gloo's
30 s; no socket is open yet, so the shutdown does not reach it. When a death is proven (an exit,
a death notice), a thread of this process fills in the dead devices' missing entries for the
rest of the block (`end_rendezvous_of`, `collectives.end_rendezvous`): entries gloo refuses,
which end those waits with gloo's own error, where the dead ranks come first or last; a
stand-in's where a dead rank lies between live ones (`deadranks`): the communicator is then
made with the stand-in, which closes its pairs, and every survivor whose devices it holds shuts
its collectives down once more when quiet (the first shutdown came before the communicator
existed). A kill as a recovery's verification began cost 30.7-31.0 s before either
(experiments/RESULTS.md, "The MTTR fuzz"; "A dead rank between live ones, stood in for")."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from .collectives import abort_collectives, end_rendezvous, gloo_loops, stood_in
from .liveness import Liveness, ProcessExits
from .startup import RuntimeConfig

# a peer on another host silent this many liveness timeouts inside a step has this process's
# collectives shut down (`CollectiveAborts.on_silent`, which says why not 1)
SILENCE_ABORT_FACTOR = 2.0
# the wait for this process to be quiet before its sockets are shut down (the module docstring):
# polled every QUIET_POLL_S; quiet when no other thread ran at QUIET_POLLS polls in a row; at
# most QUIET_WAIT_MAX_S (then shut down anyway: a collective posted later may wait for the
# timeout, as every one did before this wait)
QUIET_POLL_S = 0.002
QUIET_POLLS = 3
QUIET_WAIT_MAX_S = 2.0
# how often, in a block after a proven death, the rendezvous entries are read for a dead rank's
# missing ones (`CollectiveAborts.end_rendezvous_of`)
RENDEZVOUS_POLL_S = 0.05


# threads that never post a collective, by name (/proc/self/task/*/comm): LLVM's (an executable's
# load links code), gRPC's (the coordination service's channel)
_BENIGN = (b"llvm-worker", b"grpc", b"event_engine", b"lifeguard")


def _clique_ids(clique: str) -> set[int]:
    """The device ids of a gloo clique's key prefix (`cpu:gloo/<ids>`)."""
    try:
        return {int(i) for i in clique.rpartition("/")[2].split(",")}
    except ValueError:
        return set()


def running_threads() -> list[str] | None:
    """The names of this process's threads that are running or runnable (state R in
    /proc/self/task/*/stat) and might post a collective: not a Python thread but the main one
    (the main thread dispatches programs; the others are elasjax's and JAX's helpers, a loader
    among them), not a gloo event loop (`collectives.gloo_loops`), not one of `_BENIGN`. None
    where /proc cannot be read."""
    helpers = {t.native_id for t in threading.enumerate() if t is not threading.main_thread()}
    helpers |= gloo_loops()  # they move posted collectives' bytes, never post one
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = []
    for tid in tids:
        if int(tid) in helpers:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        start, end = stat.find(b"("), stat.rfind(b")")  # the name may hold spaces
        name = stat[start + 1:end]
        if stat[end + 2:end + 3] == b"R" and not name.startswith(_BENIGN):
            out.append(name.decode(errors="replace"))
    return out


class CollectiveAborts:
    """This process's collectives, shut down once per guard's block, and once more after a
    stand-in made a communicator with dead ranks (see the module docstring). `enabled`: on CPU where a renewed client can replace them (`renew_collectives`
    is not `never`); otherwise nothing is ever shut down. `reason` says why they were, until a
    new client clears it (`clear`)."""

    def __init__(self, rc: RuntimeConfig, exits: ProcessExits, liveness: Liveness,
                 processes: Callable[[], set[int]], log: Callable[[str], None], *,
                 client=None, devices_of: Callable[[int], set[int]] | None = None,
                 running: Callable[[], list[str] | None] = running_threads,
                 clock: Callable[[], float] = time.monotonic):
        """`client` (the coordination service's) and `devices_of` (a process's device ids):
        where a dead process's rendezvous entries are written (`end_rendezvous_of`; without
        them, none are). `running` and `clock`: what the waiter polls (`running_threads`) and
        times its cap with; a test passes its own, so that it checks the order of polls and
        shutdown rather than how fast a thread ran (tests/test_multiprocess.py,
        `test_an_abort_waits_until_this_process_no_longer_computes`)."""
        self.enabled = rc.platform == "cpu" and rc.renew_collectives != "never"
        self._running, self._clock = running, clock
        self._port = int(rc.coordinator.rpartition(":")[2])
        self._exits, self._liveness = exits, liveness
        self._processes, self._log = processes, log
        self._lock = threading.Lock()
        self._in_body = False
        self._block = 0  # blocks entered: a waiter started in one never aborts another
        self._waiter = False  # a waiter (`abort_when_quiet`) is under way in this block
        self._client, self._devices_of = client, devices_of
        self._dead: set[int] = set()  # processes proven dead (`end_rendezvous_of`)
        self._ending = 0  # the block whose rendezvous thread runs (0: none yet)
        self.reason: str | None = None  # why this process shut its collectives down

    def start(self) -> None:
        """Listen to the kernel's exits and the heartbeats (the death notices call `on_notice`
        from the notes' listener)."""
        if self.enabled:
            self._exits.start_watcher(self.on_exit)
            self._liveness.on_silent = self.on_silent
            self._liveness.on_silent_after = self.silent_after

    def silent_after(self, p: int) -> float:
        """How long process p's heartbeat is silent before `on_silent` is asked: the liveness
        timeout for a same-host peer (whose CPU time tells stopped from starved), else
        `SILENCE_ABORT_FACTOR` of it."""
        return self._liveness.timeout * (1.0 if self._exits.watching(p) else SILENCE_ABORT_FACTOR)

    def enter_block(self, phase: str) -> None:
        """A guard's block begins: from now on a death shuts the collectives down. A peer whose
        exit was reported after the entry barrier's verdict, before this block (the report
        found no block to abort), does so at once: its collectives would wait for the timeout."""
        with self._lock:
            self._in_body = True
            self._block += 1
            self._waiter = False
        gone = [p for p in self._processes() if p != self._exits.me and self._exits.exited(p)]
        for p in gone:
            self.end_rendezvous_of(p)
        if gone and self.enabled:
            self.abort_when_quiet(
                f"when process {gone[0]} was found exited as the {phase} began",
                lambda n, how: f"process {gone[0]} found exited as the {phase} began: shut down "
                               f"{n} collective sockets of this process ({how})")

    def leave_block(self) -> None:
        with self._lock:
            self._in_body = False

    def clear(self) -> None:
        """A new CPU client: its collectives are whole."""
        with self._lock:
            self.reason = None
            self._dead.clear()

    def end_rendezvous_of(self, p: int) -> None:
        """Process p is proven dead: for the rest of this block, a thread ends every wait of
        this process's programs in a communicator's making for p's ranks (`_end_rendezvous`)."""
        with self._lock:
            if not self.enabled or self._client is None or not self._in_body:
                return
            self._dead.add(p)
            if self._ending == self._block:
                return  # this block's thread is at it; it reads `_dead` at every turn
            self._ending = block = self._block
        threading.Thread(target=self._end_rendezvous, args=(block,), daemon=True,
                         name="elasjax-rendezvous").start()

    def _end_rendezvous(self, block: int) -> None:
        """Until the block ends, every `RENDEZVOUS_POLL_S`: the dead processes' missing
        rendezvous entries written (`collectives.end_rendezvous`). A communicator made later in
        the block (a program that reaches its first collective late) is caught at its making.
        Where a stand-in made a communicator with dead ranks (`deadranks`) that holds this
        process's devices, this process's collectives are shut down again once quiet, after
        the stand-in closed: the communicator was made after any earlier shutdown, and a
        collective over it that waits on a live peer, failed on the stand-in's close, would
        wait for the collective timeout."""
        mine = self._devices_of(self._exits.me)
        seen: set[str] = set()
        while True:
            with self._lock:
                if not self._in_body or self._block != block:
                    return
                dead = set().union(*(self._devices_of(p) for p in self._dead))
            try:
                keys = end_rendezvous(self._client, dead.__contains__)
                closed = stood_in(self._client) - seen
            except Exception as e:  # noqa: BLE001 (an unreadable store: gloo's wait ends as before)
                self._log(f"could not read the gloo rendezvous entries ({type(e).__name__}: {e})")
                return
            if keys:
                self._log(f"ended the gloo rendezvous of dead ranks: {', '.join(keys)}")
            seen |= closed
            ours = sorted(c for c in closed if mine & _clique_ids(c))
            if ours:
                names = ", ".join(ours)
                self.abort_when_quiet(
                    f"when the stand-in for dead ranks of {names} closed",
                    lambda n, how, names=names: f"the stand-in for dead ranks of {names} closed: "
                    f"shut down {n} collective sockets of this process ({how})", again=True)
            time.sleep(RENDEZVOUS_POLL_S)

    def _abort_when_quiet(self, when: str, log: Callable[[int, str], str], block: int,
                          again: bool = False) -> None:
        """Shut the collectives down (`abort`) once this process is quiet, or after
        `QUIET_WAIT_MAX_S` (the module docstring says why); nothing if the block ends first.
        Runs on a thread of its own, so that no detector is held. `again`: even after an
        earlier shutdown in the block (a stand-in's communicator, `_end_rendezvous`)."""
        t0 = self._clock()
        quiet = 0
        while True:
            with self._lock:
                if not self._in_body or self._block != block or (
                        self.reason is not None and not again):
                    return
            running = self._running()
            quiet = quiet + 1 if running == [] else 0
            waited = self._clock() - t0
            if quiet >= QUIET_POLLS or running is None or waited >= QUIET_WAIT_MAX_S:
                break
            time.sleep(QUIET_POLL_S)
        state = ("once its threads were quiet" if quiet >= QUIET_POLLS else
                 f"still running: {', '.join(sorted(set(running)))}" if running is not None
                 else "no /proc")
        n = self.abort(f"{when}, {waited:.2f}s later ({state})", again=again)
        if n is not None:
            self._log(log(n, f"{waited:.2f}s later, {state}"))

    def abort_when_quiet(self, when: str, log: Callable[[int, str], str],
                         again: bool = False) -> None:
        """Start `_abort_when_quiet` on a thread of its own, unless one is under way in this
        block (the first detector to call names the reason, as an immediate abort did).
        `again`: a second shutdown in the block, after the first (`_end_rendezvous`)."""
        with self._lock:
            if not self.enabled or not self._in_body:
                return
            if not again:
                if self._waiter or self.reason is not None:
                    return
                self._waiter = True
            block = self._block
        threading.Thread(target=self._abort_when_quiet, args=(when, log, block, again),
                         daemon=True, name="elasjax-abort").start()

    def abort(self, when: str, again: bool = False) -> int | None:
        """Inside a guard's block, shut this process's collectives down, once (`again`: once
        more), and record why; returns the sockets shut, or None outside a block or after an
        abort."""
        with self._lock:
            if not self._in_body or (self.reason is not None and not again):
                return None
            n = abort_collectives([self._port])
            why = f"it shut down its collectives ({n} sockets) {when}"
            self.reason = (f"{why}, to end their waits at once" if self.reason is None
                           else f"{self.reason}; {why}")
        return n

    def on_exit(self, p: int) -> None:
        """A watched peer exited (the exit watcher's thread): shut the collectives down, so
        that a collective waiting for the dead peer fails now rather than at the collective
        timeout. Recovery then renews the client."""
        if p not in self._processes():  # a newcomer not admitted yet: no collective waits for it
            return
        self.end_rendezvous_of(p)
        self.abort_when_quiet(
            f"when process {p} exited (pidfd)",
            lambda n, how: f"process {p} exited (pidfd): shut down {n} collective sockets of "
                           f"this process ({how})")

    def on_notice(self, p: int, pid: int) -> None:
        """A death notice from process p's host (the notes' listener thread): proof of its
        death, as the kernel's exit is for a same-host peer (`on_exit`)."""
        if not self._exits.notice(p, pid) or not self.enabled or p not in self._processes():
            return
        self.end_rendezvous_of(p)
        self.abort_when_quiet(
            f"when a death notice from process {p}'s host arrived",
            lambda n, how: f"process {p} died (death notice from its host): shut down {n} "
                           f"collective sockets of this process ({how})")

    def on_silent(self, p: int, silent: float) -> None:
        """Process p's heartbeat has been silent past `silent_after(p)` (the liveness watcher's
        thread). Inside a step's block, shut the collectives down as `on_exit` does, for a peer
        whose exit the kernel cannot report (another host's, or any with `--no-watch-exits`),
        and for a same-host peer whose CPU time stood still all that silence (`Liveness.working`):
        stopped (SIGSTOP) or hung, it would hold every survivor in the step's collectives until
        the collective timeout (8.16 s to fence a worker stopped for 20 s, issue 83), whereas a
        live process whose heartbeat thread is starved burns CPU. The exit barrier then decides
        as for any silence: a peer that still never posts is declared dead and fenced off, one
        that posts costs a retry on fresh collectives. A compile starves heartbeats, so other
        guards are left alone.

        The abort is evidence of a failure at the exit barrier, where a peer silent past the
        liveness timeout is then declared dead: a live peer whose heartbeat thread starved that
        long is fenced off. Hence the factor: a live process's heartbeat was seen silent 1.12 s
        in a step beside a background compile on a loaded 2-core machine (experiments/
        RESULTS.md, "bench_detection with the exit watch off, collective timeout 8 s"), which
        at 1 x the liveness timeout cost a live process."""
        if self._liveness.phase != "step":
            return
        still = ""
        if self._exits.watching(p):
            # its CPU time still over the silence's second half: the last read of it may come
            # a moment after the last beat seen, and this is asked once per silence
            if self._liveness.working(p, silent / 2):
                return  # starved, not stuck: the barrier waits for it
            still = " and its CPU time stood still"
        self.abort_when_quiet(
            f"when process {p}'s heartbeat was silent {silent:.2f}s{still}",
            lambda n, how: f"process {p} silent {silent:.2f}s{still} (heartbeat): shut down {n} "
                           f"collective sockets of this process ({how})")
