"""A compile worker: standby compiles in a child process that a recovery can stop.

XLA compiles on its own thread pool, so a background compile in the training process shares
every core with a recovery's own compile and cannot be cancelled: a recovery that needs a plan
nobody compiled yet can take up to twice a compile (experiments/RESULTS.md, "`--standby` on the
demo"; `experiments/bench_standby.py` compares the thread with the child process). A lower thread
priority does not help: the pool's threads keep their own. A `CompileWorker` runs the standby's
compiles in a child process started at a lower CPU priority (its XLA threads inherit it, so
training steps come first), and `kill` ends it the moment a recovery needs the cores for another
program. The next background compile starts a new child.

The child builds exactly what `executables.compile_plan` builds (the same config, optimizer, plan and
device ids: fake CPU devices exist in any process) and sends the pair back serialized
(`Executables.portable`); the training process loads it onto its devices (`executables.from_portable`).
Loaded executables never donate (`Trainer.donate`): a loaded train step that donates deadlocked
XLA:CPU's collective rendezvous.

Where it applies (`unavailable` says why not): the CPU backend, the built-in GPT, the trainer's
own optimizer (the child rebuilds model and optimizer from the config; a user's model or optax
object exists only in the training process), in one process or under `elasjax launch` where the
job shares its compiles (`compilation.shared`): there the process that takes a program's lease
has its worker compile it, for as many fake devices as the job has, and every process loads
the result onto its plan's devices by position. On a thread of a training process under launch,
a compile all but stopped the job's steps for its length; beside a worker they go on
(experiments/RESULTS.md, "A compile on a training process's thread stalls the job's steps").
Elsewhere the standby compiles on a thread (`standby.compiler: thread`).

Protocol: pickles over the child's stdin/stdout (its own output goes to stderr). The first
message is the setup (the parent's pid, the job's device ids, JAX settings, config), answered
`("ready",)` once the child has imported and set up; each later one a request `(plan, donate)`,
answered `("ok", Portable, seconds, t0)` (t0: when its clock started, `perf_counter`) or
`("error", message)`.

How far a compile has got (`progress`) is the child's CPU time since the request (Linux
`/proc`), against the CPU time of its finished compiles: a recovery that needs what the child
compiles waits for it only when it is far enough along (`ExecutableSource.WORKER_WAIT_PROGRESS`).
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import jax

from ..layout.state import StateFactory, make_optimizer
from ..runtime.liveness import cpu_s, die_with_parent
from .executables import can_load, compile_plan
from .store import ProgramStore

# JAX settings that change what a compile produces: the child takes the training process's
CARRIED_CONFIG = (
    "jax_enable_x64",
    "jax_threefry_partitionable",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_disable_most_optimizations",
    "jax_optimization_level",
    "jax_exec_time_optimization_effort",
)


def local_processes() -> int:
    """How many of the job's processes share this host: `ELASJAX_LOCAL_PROCESSES` (set by
    `elasjax launch` for a local job), else Open MPI's or SLURM's count of tasks on this node,
    else 1."""
    for name in ("ELASJAX_LOCAL_PROCESSES", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        m = re.match(r"\d+", os.environ.get(name, ""))
        if m and int(m.group()) > 0:
            return int(m.group())
    return 1


class CompileCancelled(Exception):
    """The worker was killed (a recovery took the cores) before it answered."""


def unavailable(cfg, custom_optimizer: bool, multi_process: bool,
                shared: bool = False) -> str | None:
    """None if a compile worker can build this run's executables, else why it cannot. Under
    `elasjax launch` only where the job shares its compiles (`shared`): the child compiles a
    plan for as many fake devices as the job has, and what it sends back is loaded onto the
    job's devices position for position, as `executables.rebind` loads any program."""
    if multi_process and not shared:
        return ("it needs the one-process runtime or the job's shared compiles "
                "(standby.share_compiles)")
    if jax.default_backend() != "cpu":
        return f"it needs the CPU backend (a second process cannot share {jax.default_backend()} devices)"
    if cfg.model.type != "gpt":
        return f"model.type '{cfg.model.type}' is registered in this process only"
    if custom_optimizer:
        return "the optimizer passed to `run` exists in this process only"
    if not can_load():
        return (f"jax {jax.__version__} cannot load a serialized executable onto this "
                "process's devices (elasjax.core.jaxcompat.executable_loader)")
    return None


class CompileWorker:
    """The child process and its pipes. `compile` blocks the calling (standby) thread; `kill`,
    from another thread, makes it raise `CompileCancelled`."""

    # Where training keeps every core busy (fake CPU devices), a compile costs the run the same
    # CPU time at any priority: a lower one only makes it later. The demo's 1,500 fault-free
    # steps on 2 cores took 63-67 s at nice 0, 5 and 10 (53 s without the standby), and its
    # standby was ready at step 397, 680-725 and 932-1082 (experiments/RESULTS.md, "The
    # standby's plans spread over the processes"). Again for 2,000 demo steps with failures at
    # 800 and 1600: ready at steps 628 and 1129 at nice 5, at 326 and 991 at nice 0, fault-free
    # 1.15x either way; and a ZeRO-0 step that waited less in its collectives (tried, taken back)
    # left a niced child almost nothing (experiments/RESULTS.md, "The compile worker at normal
    # priority"). So the child runs at normal priority, in one process as under launch.
    nice = 0  # the child's priority, as the start line states it

    # Pacing (`standby.worker_share`): how often the governor looks at the child's CPU time
    # (`_govern` says why this often), and the most CPU seconds of unused budget it carries over
    # (as seconds at the budget's rate), so that a child idle for a while does not then run
    # unpaced for as long.
    PACE_PERIOD_S = 0.2
    PACE_BURST_S = 0.2

    def __init__(self, cfg, needed: Callable[[], bool] | None = None):
        """`needed()`: does the run wait for the compile under way (`StandbyCompiler.needed`)?
        Such a compile is never paced."""
        self.cfg = cfg
        self.share = cfg.standby.worker_share
        self._needed = needed
        # CPU seconds per second the child may use while paced: its share of the cores this
        # process has, the host's divided among the job's processes on it (`local_processes`)
        self.pace_rate = (None if self.share is None
                          else self.share * len(os.sched_getaffinity(0)) / local_processes())
        self._paced: subprocess.Popen | None = None  # the child the governor holds stopped
        self._paced_at = 0.0
        self.paced = 0  # times the governor stopped the child
        self.paced_s = 0.0  # seconds the governor held it stopped, all requests
        self._closed = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.started = 0  # children started
        self.killed = 0  # children killed by `kill` while compiling
        self._killed: set[int] = set()
        self._seen_ready: set[int] = set()  # children whose ready message was read
        # the child's CPU seconds at the request under way ("starting": the child is still
        # importing and setting up; None: no request, or no CPU time to read)
        self._cpu_at_request: float | str | None = None
        self.compiled = 0  # compiles answered, and their CPU seconds in the child
        self.compile_cpu_s = 0.0
        self._stopped: subprocess.Popen | None = None  # the child `pause` stopped
        self.paused = 0  # times `pause` stopped a compile
        self.stopped_s = 0.0  # seconds the child spent stopped, all requests
        self._stopped_at = 0.0  # when `pause` stopped it (perf_counter)
        self._stops: list[tuple[float, float]] = []  # this request's stops (perf_counter)
        if self.pace_rate is not None:
            threading.Thread(target=self._govern, name="elasjax-compile-pace",
                             daemon=True).start()

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        env["JAX_PLATFORMS"] = "cpu"
        root = str(Path(__file__).resolve().parents[1])  # this elasjax, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(  # no preexec_fn: a fork of a threaded process runs no Python
            [sys.executable, "-c", "import sys; from elasjax.compilation.worker import main; "
             "sys.exit(main())"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        setup = {
            "parent": os.getpid(),
            # the job's device ids: the child compiles for its fake devices under these ids
            "ids": [d.id for d in jax.devices()],
            "cfg": self.cfg,
            "jax_config": {n: jax.config.values[n] for n in CARRIED_CONFIG if n in jax.config.values},
        }
        pickle.dump(setup, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()
        self.started += 1
        return proc

    def compile(self, plan, donate: bool):
        """(Portable, seconds): `plan`'s executables compiled in the child, and the seconds the
        compile ran, less any time `pause` held the child stopped meanwhile (the child's own clock
        counts it). Raises `CompileCancelled` if `kill` ended the child first."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
        try:
            with self._lock:
                self._cpu_at_request = "starting"
            if self._fresh(proc) and pickle.load(proc.stdout)[0] != "ready":
                raise pickle.UnpicklingError("the child did not say it was ready")
            start = cpu_s(proc.pid)
            with self._lock:
                self._cpu_at_request = start
                self._stops = []
            pickle.dump((plan, donate), proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            proc.stdin.flush()
            reply = pickle.load(proc.stdout)
            end = cpu_s(proc.pid)
            with self._lock:
                self._cpu_at_request = None
                stops = list(self._stops)
                if reply[0] == "ok" and start is not None and end is not None:
                    self.compiled += 1
                    self.compile_cpu_s += end - start
        except (EOFError, BrokenPipeError, OSError, pickle.UnpicklingError) as e:
            with self._lock:
                self._cpu_at_request = None
                if self._proc is proc:
                    self._proc = None
            try:
                rc = proc.wait(timeout=10)  # the pipe can close before the exit is reported
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            if proc.pid in self._killed:
                raise CompileCancelled(f"compile worker killed (exit {rc})") from e
            raise RuntimeError(f"compile worker failed (exit {rc}): {e}") from e
        if reply[0] != "ok":
            raise RuntimeError(f"compile worker: {reply[1]}")
        # the child's clock ran from t0 (perf_counter is the system's monotonic clock, the
        # same in both processes); a stop before it (the request not yet read) is not in it
        seconds, t0 = reply[2], reply[3]
        held = sum(max(0.0, min(b, t0 + seconds) - max(a, t0)) for a, b in stops)
        return reply[1], max(0.0, seconds - held)

    def _fresh(self, proc: subprocess.Popen) -> bool:
        """Is this the first request to `proc` (its ready message still to be read)?"""
        with self._lock:
            fresh = proc.pid not in self._seen_ready
            self._seen_ready.add(proc.pid)
            return fresh

    def progress(self) -> tuple[float, float] | None:
        """(CPU seconds the child has spent on the compile under way, 0 while it is still
        starting; mean CPU seconds of its finished compiles, 0.0 before the first); None when
        nothing compiles or the CPU time cannot be read."""
        with self._lock:
            proc, start = self._proc, self._cpu_at_request
            mean = self.compile_cpu_s / self.compiled if self.compiled else 0.0
        if proc is None or start is None:
            return None
        if start == "starting":
            return 0.0, mean
        now = cpu_s(proc.pid)
        return None if now is None else (now - start, mean)

    # -- pacing: the child's share of the cores while training steps run beside it -----------

    def _govern(self) -> None:
        """The governor thread: while the child compiles a plan nobody waits for, it may use
        `pace_rate` CPU seconds per second, on average (a token bucket over its CPU time, Linux
        `/proc`): past its budget it is stopped (SIGSTOP) until the budget has grown back. Why:
        where the devices are this host's cores (fake CPU devices), a compile at any priority
        takes its CPU time from the steps; paced, it takes about its share at a time, and the
        standby is ready later (experiments/RESULTS.md, "The paced compile worker"). A period
        of 0.2 s rather than 0.05 or 0.01: stopping and continuing the child more often cost
        the steps more than its CPU share (the same file). A compile the run needs now (a
        recovery's, a cut-over's, one training waits for) runs unpaced."""
        credit, last, pid = 0.0, None, None
        while not self._closed.wait(self.PACE_PERIOD_S):
            with self._lock:
                proc, busy = self._proc, self._cpu_at_request is not None  # its start-up too
                paused = self._stopped is not None
            if (proc is None or not busy or paused or proc.poll() is not None
                    or (self._needed is not None and self._needed())):
                self._unpace()
                credit, last, pid = 0.0, None, None
                continue
            now, cpu = time.perf_counter(), cpu_s(proc.pid)
            if cpu is None:
                continue
            if pid != proc.pid or last is None:
                credit, last, pid = 0.0, (now, cpu), proc.pid
                continue
            credit = min(credit + (now - last[0]) * self.pace_rate - (cpu - last[1]),
                         self.PACE_BURST_S * self.pace_rate)
            last = (now, cpu)
            if credit < 0:
                self._pace_stop(proc)
            else:
                self._unpace()

    def _pace_stop(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if self._paced is not None or self._proc is not proc or self._stopped is not None:
                return
            try:
                os.kill(proc.pid, signal.SIGSTOP)
            except OSError:  # it just ended
                return
            self._paced, self._paced_at = proc, time.perf_counter()
            self.paced += 1

    def _unpace(self) -> None:
        """End the governor's stop, if any, and continue the child unless `pause` holds it too.
        Call with the lock free (`_end_pace` under it)."""
        with self._lock:
            proc = self._end_pace()
            cont = proc is not None and self._stopped is None
        if cont and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except OSError:  # it ended meanwhile
                pass

    def _end_pace(self) -> subprocess.Popen | None:
        """Under the lock: close the governor's stop (counted in `paced_s` and left out of the
        compile's seconds, as `pause`'s are); returns the child it held."""
        proc, self._paced = self._paced, None
        if proc is not None:
            now = time.perf_counter()
            self.paced_s += now - self._paced_at
            self._stops.append((self._paced_at, now))
        return proc

    def pause(self) -> bool:
        """Stop the child (SIGSTOP) while it has a compile under way; True if it was stopped.
        For a recovery under launch that builds its plan elsewhere (on its own thread, or in
        another process of the job): the compile under way here is of a plan it does not need
        and cannot be ended (another process may be waiting for its program), but at normal
        priority it took half of 2 cores from the needed one (experiments/RESULTS.md, "A kill
        before the standby is ready, with the compile worker paused"). `resume` continues it;
        a stopped child still dies with its parent (SIGKILL, `die_with_parent`). The time stopped
        is left out of the compile's seconds (`compile`) and counted in `stopped_s`."""
        with self._lock:
            proc, busy = self._proc, self._cpu_at_request is not None
            if proc is None or not busy or proc.poll() is not None or self._stopped is not None:
                return False
            if self._paced is None:
                try:
                    os.kill(proc.pid, signal.SIGSTOP)
                except OSError:  # it just ended
                    return False
            self._end_pace()  # stopped already by the governor: the stop is pause's from now
            self._stopped, self._stopped_at = proc, time.perf_counter()
            self.paused += 1
            return True

    def resume(self) -> None:
        """Continue the child `pause` stopped, if any."""
        with self._lock:
            proc, self._stopped = self._stopped, None
            if proc is not None:
                now = time.perf_counter()
                self.stopped_s += now - self._stopped_at
                self._stops.append((self._stopped_at, now))
        if proc is not None and proc.poll() is None:  # not one already reaped (its pid reused)
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except OSError:  # it ended meanwhile
                pass

    def kill(self) -> bool:
        """End the child now; True if one was running."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return False
        self._killed.add(proc.pid)
        proc.kill()
        self.killed += 1
        return True

    def close(self) -> None:
        self._closed.set()
        self.resume()  # a stopped child would not read the EOF
        self._unpace()
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()  # the child ends at EOF
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


def main() -> int:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the child prints goes to stderr, never into the pipe
    inp = sys.stdin.buffer
    setup = pickle.load(inp)
    die_with_parent(setup["parent"])  # a killed training process strands no compile
    jax.config.update("jax_num_cpu_devices", len(setup["ids"]))
    for name, value in setup["jax_config"].items():
        jax.config.update(name, value)

    cfg = setup["cfg"]
    factory = StateFactory(cfg, make_optimizer(cfg))
    # a plan names the job's device ids (a multi-process job's are not 0..n-1): each is one of
    # this process's fake devices here; the executables go back with the fake ids, in mesh
    # order, and are loaded by position (`executables.from_portable`)
    devices = dict(zip(setup["ids"], jax.devices()))
    # plans compiled before (here or by the training process) are loaded, not compiled
    store = ProgramStore.from_setting(cfg.standby.programs_dir, cfg.standby.programs_max_mb)
    pickle.dump(("ready",), out, protocol=pickle.HIGHEST_PROTOCOL)
    out.flush()
    while True:
        try:
            plan, donate = pickle.load(inp)
        except EOFError:
            return 0
        t0 = time.perf_counter()
        try:
            # the standby's plans: their evaluation too (`executables.compile_plan`)
            exe = compile_plan(cfg, factory, plan, devices, donate=donate, store=store,
                               evaluate=True, beside=False)  # one core: the steps have the rest
            reply = ("ok", exe.portable(), time.perf_counter() - t0, t0)
            del exe
        except Exception as e:  # noqa: BLE001 - answered; the training process raises it
            reply = ("error", f"{type(e).__name__}: {e}")
        pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
