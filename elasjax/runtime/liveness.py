"""Who is alive: the fast failure detector of the multi-controller runtime, and a throttle
that makes a process slow on purpose (benchmarks of false positives)."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from jax.errors import JaxRuntimeError


class Liveness:
    """Heartbeats through the coordination service's key-value store.

    A thread writes `elasjax/hb/<me>` (a counter) every `interval` seconds; another polls every
    peer's key every `interval / 2` and records when each value last changed. A process whose key
    has not changed for `timeout` seconds is *silent*; the arbiter of every guard's
    barrier (the lowest live process, see `MultiControllerRuntime.guard`) declares a process dead only when it is
    silent *and* has not reached the barrier. A slow process keeps beating (its heartbeat thread
    does not wait for its computation), so it is waited for, never declared dead. A same-host
    peer whose heartbeat is silent while its CPU time advances (`cpu_of`, `working`) is starved,
    not dead: the arbiter waits for it too (up to `startup.STARVED_MAX_S`).

    Why a heartbeat of its own: gloo surfaces a death only at the collective timeout (its socket
    errors 'Connection closed/reset by peer' are reported when the timed-out receive returns),
    and `live_devices`' membership check waits for the coordination service's slower heartbeat,
    while every survivor sees a killed process silent about `timeout` after the kill (the
    candidates side by side: experiments/RESULTS.md, "Detecting a death").
    """

    def __init__(self, client, me: int, peers, interval: float, timeout: float, cpu_of=None):
        self.client, self.me, self.interval, self.timeout = client, me, interval, timeout
        now = time.time()
        self._last: dict[int, tuple[str | None, float]] = {p: (None, now) for p in peers if p != me}
        # the barrier this process waits at ("<guard number> <phase> <entry|exit>", "" in a
        # block), sent with every beat: a peer waiting elsewhere for long is a divergence
        # (`diverged`), never a silent wait
        self.at_barrier = ""
        # a same-host peer's CPU time (`cpu_of(p)`: seconds, or None where unknown) and when it
        # last advanced (`working`)
        self.cpu_of = cpu_of
        self._cpu: dict[int, tuple[float, float]] = {}
        self.first_silent: dict[int, float] = {}  # when each peer's current silence passed timeout
        self.max_gap: dict[int, float] = {p: 0.0 for p in self._last}  # longest seen silence
        self.long_gaps: list[tuple[float, int, float, str]] = []  # (when, peer, gap, our phase)
        self.phase = "start"  # the guard this process is in (set by the runtime), for reports
        # called as on_silent(p, seconds) from the thread that first sees p silent past
        # `on_silent_after(p)` seconds (once per silence)
        self.on_silent = None
        self.on_silent_after: Callable[[int], float] = lambda p: timeout
        self._reported: set[int] = set()  # peers whose current silence was reported
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat, name="elasjax-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="elasjax-liveness", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _beat(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                self.client.key_value_set(f"elasjax/hb/{self.me}", f"{n} {self.at_barrier}",
                                          allow_overwrite=True)
            except JaxRuntimeError:  # the service is going away (shutdown)
                return
            self._stop.wait(self.interval)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval / 2):
            with self._lock:
                peers = list(self._last)
            for p in peers:
                self.observe(p)

    def observe(self, p: int) -> float:
        """Read process p's heartbeat key now; returns its silence in seconds. The arbiter calls
        it directly, so a watcher thread that did not run for a while cannot make a live
        process look silent."""
        try:
            v = self.client.key_value_try_get(f"elasjax/hb/{p}")
        except JaxRuntimeError:  # not written yet, or the service is going away
            v = None
        cpu = self.cpu_of(p) if self.cpu_of is not None else None
        now = time.time()
        with self._lock:
            if cpu is not None:  # first seen: not yet known to advance
                old_cpu, t = self._cpu.get(p, (cpu, float("-inf")))
                self._cpu[p] = (cpu, now if cpu > old_cpu else t)
            if p not in self._last:
                return float("inf")
            old, t = self._last[p]
            if v is not None and v != old:
                if old is not None:
                    self.max_gap[p] = max(self.max_gap[p], now - t)
                    if now - t > self.timeout / 2 and len(self.long_gaps) < 100:
                        self.long_gaps.append((now, p, now - t, self.phase))
                self._last[p] = (v, now)
                self.first_silent.pop(p, None)  # it beats again: an earlier silence was not death
                self._reported.discard(p)
                return 0.0
            silent = now - t
            if silent > self.timeout and p not in self.first_silent:
                self.first_silent[p] = now
            report = (self.on_silent is not None and silent > self.on_silent_after(p)
                      and p not in self._reported)
            if report:
                self._reported.add(p)
        if report:
            self.on_silent(p, silent)
        return silent

    def barrier_of(self, p: int) -> str:
        """The barrier process p waited at when its heartbeat was last read ("" in a block or
        unknown)."""
        with self._lock:
            v = self._last.get(p, (None, 0.0))[0]
        return v.partition(" ")[2] if v else ""

    def working(self, p: int, window: float) -> bool:
        """Has process p's CPU time advanced in the last `window` seconds (as last observed)? Known
        for same-host peers only (`cpu_of`); False elsewhere. A process whose heartbeat is silent
        while its CPU time advances is starved (its heartbeat thread cannot run, or cannot reach
        the coordination service), not dead."""
        with self._lock:
            _, t = self._cpu.get(p, (None, float("-inf")))
        return time.time() - t <= window

    def silent_s(self, p: int) -> float:
        """Seconds since process p's heartbeat last changed, as this process saw it."""
        with self._lock:
            return time.time() - self._last[p][1] if p in self._last else float("inf")

    def forget(self, procs) -> None:
        with self._lock:
            for p in procs:
                self._last.pop(p, None)
                self._cpu.pop(p, None)

    def rejoin(self, procs) -> None:
        """Watch restarted processes again (admitted into the job: `membership`), their silence
        counted from now."""
        now = time.time()
        with self._lock:
            for p in procs:
                if p != self.me:
                    self._last[p] = (None, now)
                    self.max_gap.setdefault(p, 0.0)
                    self.first_silent.pop(p, None)
                    self._reported.discard(p)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self.interval + 1)


def peer_state(p: int, liveness: Liveness, exits: "ProcessExits", limit: float,
               starved_max: float, stuck_after: float | None = None) -> tuple[str, float]:
    """Process p's state as a barrier sees it, with its heartbeat silence: `exited` (the kernel
    said so), `stuck` (a same-host peer silent past `stuck_after` whose CPU time stood still
    over the second half of that silence: stopped or hung, as `aborts.CollectiveAborts.on_silent`
    judges one inside a step), `alive` (silent at most `limit`), `starved` (silent longer, but
    under `starved_max` with its CPU time advancing: `Liveness.working`) or `dead`. Why
    `stuck`: a worker stopped (SIGSTOP) between two steps is absent from the next step's entry
    barrier, where no block failed, and was fenced only at the slow limit (5.04 s in 1 of 5
    stop probes: experiments/RESULTS.md, "A stopped worker at a barrier")."""
    if exits.exited(p):
        return "exited", liveness.observe(p)
    silent = liveness.observe(p)
    if (stuck_after is not None and stuck_after < silent <= limit and exits.watching(p)
            and not liveness.working(p, silent / 2)):
        return "stuck", silent
    if silent <= limit:
        return "alive", silent
    if silent < starved_max and liveness.working(p, limit):
        return "starved", silent
    return "dead", silent


class DivergedError(RuntimeError):
    """The live processes wait at different barriers, each for the others: the job cannot go
    on (a bug of the loop: its guards are not the same sequence on every process)."""


def diverged(p: int, liveness: Liveness, mine: str, since: float, after_s: float) -> None:
    """Raise `DivergedError` when process p, alive, has waited at another barrier than this
    process's (`mine`) for the last `after_s` seconds of this process's wait (begun at
    `since`): it will never post at this one."""
    theirs = liveness.barrier_of(p)
    if theirs and theirs != mine and time.time() - since > after_s:
        raise DivergedError(
            f"the processes diverged: process {p} waits at barrier '{theirs}' while this process "
            f"(process {liveness.me}) has waited {time.time() - since:.0f}s at '{mine}', each for "
            "the other; the job stops (a bug: the processes ran different guards; report it "
            "with every worker's log)")


def post(status: str) -> str:
    """A barrier post: this process's arrival time (wall clock) and its status ("ok" or
    "err:<message>"); `read_post` splits it."""
    return f"{time.time():.3f} {status}"


def read_post(raw: str) -> tuple[float, str]:
    t, _, status = raw.partition(" ")
    return float(t), status


def arbitrate(client, key: str, statuses: dict, pending: list, liveness: Liveness,
              exits: "ProcessExits", fast: float, slow: float, starved_max: float,
              diverge_after_s: float = float("inf"), stuck_after: float | None = None):
    """The arbiter's wait at a barrier: read each pending process's post (`<key>/<p>`) until
    every one has posted or is dead. A peer is dead when it exited (`exits`), or when its
    heartbeat has been silent past the limit (`fast` once some post reports an error, the
    evidence of a failure; else `slow`) and it is not a same-host peer whose CPU time advanced
    within that limit (`Liveness.working`: starved, waited for up to `starved_max` of silence;
    a start-up compile on loaded cores can silence a live process for seconds:
    experiments/RESULTS.md, "bench_detection"), or a same-host peer stuck (`peer_state`:
    silent past `stuck_after`, its CPU time standing still).
    `statuses` and the posts read are `post`s. Returns (statuses {p: status}, arrivals {p: wall
    clock}, failed {p: silence}, exited, starved {p: silence}, the limit applied)."""
    t_wait = time.time()
    arrived = {p: read_post(v)[0] for p, v in statuses.items()}
    statuses = {p: read_post(v)[1] for p, v in statuses.items()}
    failed: dict[int, float] = {}
    starved: dict[int, float] = {}
    exited: list[int] = []  # dead by the kernel's word, not by a timeout
    used = fast
    pending = list(pending)
    while pending:
        for p in list(pending):
            try:
                arrived[p], statuses[p] = read_post(client.blocking_key_value_get(f"{key}/{p}", 20))
                pending.remove(p)
                continue
            except JaxRuntimeError:  # not there yet: dead or slow?
                pass
            limit = fast if any(v.startswith("err:") for v in statuses.values()) else slow
            state, silent = peer_state(p, liveness, exits, limit, starved_max, stuck_after)
            if state == "exited":
                failed[p] = silent
                exited.append(p)
                pending.remove(p)
                continue
            if state == "alive":
                diverged(p, liveness, liveness.at_barrier, t_wait, diverge_after_s)
                continue
            if state == "starved":
                starved[p] = silent
                continue
            used = stuck_after if state == "stuck" else limit
            failed[p] = silent
            starved.pop(p, None)  # its CPU time stopped too: dead after all, not waited for
            pending.remove(p)
    return statuses, arrived, failed, exited, starved, used


_THROTTLE = """
import os, signal, sys, time
pid, run, stop = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
try:
    while True:
        time.sleep(run)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stop)
        os.kill(pid, signal.SIGCONT)
except ProcessLookupError:
    pass
"""


class Throttle:
    """Make this process `factor` times slower: a helper process stops it (SIGSTOP) for
    (factor - 1) x 50 ms after every 50 ms it runs, as a loaded host would. For benchmarks of
    false positives (`RuntimeConfig.slow`)."""

    RUN_S = 0.05

    def __init__(self, factor: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _THROTTLE, str(os.getpid()), str(self.RUN_S),
             str((factor - 1) * self.RUN_S)]
        )

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.kill(os.getpid(), signal.SIGCONT)  # never leave this process stopped


class SlowSteps:
    """A process slowed on purpose (`RuntimeConfig.slow` = (process, factor, first step guard,
    steps)): that process runs `factor` times slower (`Throttle`) for `steps` step guards from
    the given one on; every other process is left alone."""

    def __init__(self, slow: tuple | None, me: int, log: Callable[[str], None]):
        self.slow = slow if slow is not None and slow[0] == me else None
        self.log = log
        self.throttle: Throttle | None = None

    def at(self, step: int) -> None:
        """Step guard number `step` (0-based) begins."""
        if self.slow is None:
            return
        _, factor, start, steps = self.slow
        if step == start and self.throttle is None:
            self.log(f"slowing myself {factor:g}x (SIGSTOP/SIGCONT) for {steps} steps")
            self.throttle = Throttle(factor)
        elif step == start + steps and self.throttle is not None:
            self.stop()
            self.log(f"back to full speed after {steps} slowed steps")

    def stop(self) -> None:
        if self.throttle is not None:
            self.throttle.stop()
            self.throttle = None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when its parent (pid `parent`) dies, so that a killed
    parent strands no child (a launcher's workers, a training process's compile worker)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user and system, every thread) process `pid` has used; None where `/proc`
    cannot say (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), which
    tells a process from a later one that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclasses.dataclass(frozen=True)
class Incarnation:
    """What each process posts at start (`elasjax/proc/<p>`): its host's boot id, its pid and
    the pid's start time, which tell a same-host peer (`ProcessExits.watch`) and a death notice
    (`ProcessExits.notice`) which incarnation of process p is meant."""

    boot: str
    pid: int
    start: str | None  # the pid's start time in clock ticks (None where unreadable)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Incarnation":
        return cls(**json.loads(text))


class ProcessExits:
    """Peers' exits from the kernel, for peers on this host (Linux `pidfd_open`): a pidfd turns
    readable the moment its process exits (a SIGKILL included), before its parent reaps it.

    Every process posts `elasjax/proc/<p>` = {boot id, pid, start time} at start; a peer with
    the same boot id (the same kernel) gets a pidfd, opened once while it is alive, after its
    start time is checked (a reused pid is never mistaken for it). An exit is proof of death, so
    the arbiter needs no timeout for such a peer; peers on other hosts are left to the heartbeat
    (`Liveness`). Nothing here can declare a live process dead: a stopped or slow process has
    not exited."""

    def __init__(self, client, me: int, peers, enabled: bool = True):
        self.client, self.me = client, me
        self.enabled = enabled and hasattr(os, "pidfd_open")
        self._peers = [p for p in peers if p != me]
        self._fds: dict[int, int] = {}
        self._pids: dict[int, int] = {}  # watched peers' pids (checked against their start time)
        self._lock = threading.Lock()
        self._closing: list[int] = []  # forgotten pidfds, closed by the watcher thread if any
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.seen: dict[int, float] = {}  # peer -> when the watcher saw its exit
        # peer -> when a death notice from its host named its current incarnation (`deathnote`)
        self._noticed: dict[int, float] = {}
        self._remote: set[int] = set()  # peers on another host (or whose pidfd cannot be had)
        self.boot = _boot_id()
        # posted whether or not this process watches exits: a death notice names the pid
        # (`notice`), and a restarted incarnation is told from an earlier one by it
        info = Incarnation(self.boot, os.getpid(), _start_ticks(os.getpid()))
        client.key_value_set(f"elasjax/proc/{me}", info.to_json(), allow_overwrite=True)

    def watch(self) -> None:
        """Open a pidfd for every same-host peer that has posted (call while all are alive)."""
        if not self.enabled:
            return
        for p in self._peers:
            if p in self._fds or p in self._remote:
                continue
            try:
                raw = self.client.key_value_try_get(f"elasjax/proc/{p}")
            except JaxRuntimeError:  # not posted yet: try again at the next barrier
                continue
            info = Incarnation.from_json(raw)
            if info.boot != self.boot or not self.boot:
                self._remote.add(p)
                continue
            try:
                fd = os.pidfd_open(info.pid)
            except OSError:  # gone already, or not ours to watch: the heartbeat decides
                self._remote.add(p)
                continue
            if _start_ticks(info.pid) != info.start:  # the pid was reused
                os.close(fd)
                self._remote.add(p)
                continue
            with self._lock:
                self._fds[p] = fd
                self._pids[p] = info.pid

    def cpu_s(self, p: int) -> float | None:
        """CPU seconds a watched same-host peer has used (`cpu_s`); None for other peers and
        once it exited."""
        pid = self._pids.get(p)
        if pid is None or self.exited(p):
            return None
        return cpu_s(pid)

    def watching(self, p: int) -> bool:
        """Whether the kernel will report process p's exit (a same-host peer with a pidfd)."""
        return p in self._fds

    def notice(self, p: int, pid: int) -> bool:
        """A death notice from process p's host (`deathnote`): p has exited if `pid` is the pid
        its current incarnation posted (a late notice of an earlier one is ignored). Returns
        whether it counts."""
        try:
            info = Incarnation.from_json(self.client.key_value_try_get(f"elasjax/proc/{p}"))
        except JaxRuntimeError:
            return False
        if info.pid != pid:
            return False
        with self._lock:
            self._noticed.setdefault(p, time.time())
        return True

    def how(self, p: int) -> str:
        """How this process knows p exited: its own pidfd, or a notice from p's host."""
        fd = self._fds.get(p)
        if fd is not None and select.select([fd], [], [], 0)[0]:
            return "pidfd on this host"
        return "a death notice from its host"

    def exited(self, p: int) -> bool:
        if p in self._noticed:
            return True
        fd = self._fds.get(p)
        if fd is None:
            return False
        return bool(select.select([fd], [], [], 0)[0])

    def start_watcher(self, on_exit) -> None:
        """Call `on_exit(p)` from a thread, once, the moment a watched peer p exits (`watch`
        opens the pidfds; peers watched later are picked up within 50 ms)."""
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._watch_loop, args=(on_exit,), name="elasjax-exits", daemon=True
        )
        self._thread.start()

    def _watch_loop(self, on_exit) -> None:
        while not self._stop.is_set():
            with self._lock:
                for fd in self._closing:
                    os.close(fd)
                self._closing.clear()
                fds = {fd: p for p, fd in self._fds.items() if p not in self.seen}
            if not fds:
                self._stop.wait(0.05)
                continue
            try:
                ready = select.select(list(fds), [], [], 0.05)[0]
            except OSError:  # a descriptor went away meanwhile: look again
                continue
            for fd in ready:
                p = fds[fd]
                self.seen[p] = time.time()
                on_exit(p)

    def rejoin(self, procs) -> None:
        """Restarted processes (admitted into the job): watch their new incarnation, whose pid
        each posted before asking to rejoin (the next `watch` opens its pidfd). A pidfd opened
        meanwhile may be the old incarnation's (a dead process not yet reaped): dropped."""
        self.forget(procs)
        with self._lock:
            for p in procs:
                self._remote.discard(p)
                self.seen.pop(p, None)

    def forget(self, procs) -> None:
        with self._lock:
            for p in procs:
                self._noticed.pop(p, None)
                self._pids.pop(p, None)
                fd = self._fds.pop(p, None)
                if fd is None:
                    continue
                if self._thread is not None:
                    self._closing.append(fd)  # it may be in the watcher's select right now
                else:
                    os.close(fd)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
            self._thread = None
        self.forget(list(self._fds))
        with self._lock:
            for fd in self._closing:
                os.close(fd)
            self._closing.clear()
