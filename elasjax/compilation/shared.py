"""Compile once per job: under `elasjax launch` every process needs the same program at the same
moment (the start plan; a recovery's new plan, which every survivor builds in the same guard), and
each used to compile it for itself: four processes on one host, four compiles of one program on
the same cores. Here the first process to ask for a program takes its lease in the coordination
service's key-value store, compiles it and publishes it serialized (`executables.Portable`); the
others wait for it and load it, a fraction of a compile (tests/test_multiprocess.py,
`test_sigkill_one_of_four_processes_matches_the_single_process_run`).

Nothing here can make a run wrong, only slower: a process that cannot get the program from its
lease holder compiles it itself, as every process did before. That is the case when the holder
dies (the guard's barrier then declares it dead and the recovery starts again), when its build
raised, or when its executable cannot be serialized (one that JAX's persistent cache loaded,
`Executables.portable_ok`). A holder that died leaves its lease behind; the next process to ask
takes the lease's next generation. JAX's own `jax_share_binary_between_hosts` does the same for
the persistent cache's misses, but waits for one fixed process with no regard for its death.

The key is a digest of everything the executables depend on (the config and the executable
cache's key, whose plan names the device ids), so processes that would compile the same program
share it, and a program published once serves every later recovery that needs it (the payload
names device ids, not a client: it loads onto a renewed client too).
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from jax.errors import JaxRuntimeError

from .executables import Executables, Portable

PREFIX = "elasjax/build"


class SharedBuilds:
    """Programs compiled by one process of a job and loaded by the others. `client`: the
    coordination service's key-value client; `gone(p)`: has process p exited or fallen silent
    (what a barrier would declare dead)? `log`: the runtime's log."""

    POLL_S = 0.2  # between looks at the lease holder while waiting for its program

    def __init__(self, client, me: int, gone: Callable[[int], bool], log: Callable[[str], None],
                 clock: Callable[[], float] = time.perf_counter):
        """`clock` times the waits (`waited_s`) and loads: a test passes its own, so that it
        checks the seconds counted rather than how fast a thread ran (tests/
        test_shared_builds.py, `test_a_waiter_loads_the_program_once_its_holder_publishes_it`)."""
        self.client, self.me, self.gone, self.log = client, me, gone, log
        self._clock = clock
        self.published = 0  # programs this process compiled and published
        self.loaded = 0  # programs this process loaded from another's compile
        self.compiled_alone = 0  # programs it compiled because it could not get them shared
        self.waited_s = 0.0  # seconds spent waiting for other processes' compiles
        self._closed = threading.Event()

    @staticmethod
    def key(*parts: Any) -> str:
        """The digest naming a program: the same on every process that would compile it."""
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]

    def build(self, key: str, name: str, compile: Callable[[], Executables],
              load: Callable[[Portable, float], Executables]) -> Executables:
        """The executables named `key` (`name` for the log): loaded where another process
        published them, else compiled here (published for the others when this process holds
        the lease)."""
        base = f"{PREFIX}/{key}"
        gen = 0
        while True:
            got = self._published(base)
            if got is None:
                owner = self._lease(base, gen)
                if owner == self.me:
                    return self._compile_and_publish(base, name, compile)
                t0 = self._clock()
                got = self._await(base, owner)
                self.waited_s += self._clock() - t0
                if got is None:  # its holder died before publishing: the next generation's
                    gen += 1
                    continue
            portable, compile_s = got
            if portable is None:  # published as not shareable (`compile_s` says why)
                self.compiled_alone += 1
                return compile()
            t0 = self._clock()
            exe = load(portable, compile_s)
            exe.origin = "shared"
            self.loaded += 1
            self.log(f"loaded {name} compiled by another process in {compile_s:.2f}s "
                     f"({self._clock() - t0:.2f}s)")
            return exe

    def state(self, key: str) -> str:
        """Where program `key` stands in the job, without waiting: "published" (loadable now),
        "claimed" (a live process other than this one holds its lease and compiles it) or
        "free" (nobody builds it, or only a dead process or this one did)."""
        base = f"{PREFIX}/{key}"
        if self._published(base) is not None:
            return "published"
        holder, gen = None, 0
        while True:  # the latest generation's holder
            try:
                holder = int(self.client.key_value_try_get(f"{base}/lease/{gen}"))
            except (JaxRuntimeError, ValueError):
                break
            gen += 1
        if holder is None or holder == self.me or self.gone(holder):
            return "free"
        return "claimed"

    def close(self) -> None:
        """Stop waiting (the run ends): a waiter compiles on its own."""
        self._closed.set()

    # -- the lease and the payload ---------------------------------------------------------------

    def _lease(self, base: str, gen: int) -> int:
        """The holder of the lease's generation `gen` (this process where it took it now)."""
        try:
            self.client.key_value_set(f"{base}/lease/{gen}", str(self.me))
            return self.me
        except JaxRuntimeError:  # ALREADY_EXISTS: another process holds it
            try:
                return int(self.client.key_value_try_get(f"{base}/lease/{gen}"))
            except (JaxRuntimeError, ValueError):
                return self.me  # unreadable: compile here

    def _published(self, base: str):
        try:
            return pickle.loads(self.client.key_value_try_get_bytes(f"{base}/exe"))
        except JaxRuntimeError:  # NOT_FOUND
            return None

    def _await(self, base: str, owner: int):
        """The holder's payload, or None once the holder is gone (`gone`)."""
        while True:
            if self._closed.is_set():
                raise RuntimeError("the run is ending: no longer waiting for a shared compile")
            try:
                raw = self.client.blocking_key_value_get_bytes(
                    f"{base}/exe", int(self.POLL_S * 1000))
            except JaxRuntimeError:  # DEADLINE_EXCEEDED: not yet
                if self.gone(owner):
                    return None
                continue
            return pickle.loads(raw)

    def _compile_and_publish(self, base: str, name: str, compile) -> Executables:
        try:
            exe = compile()
        except BaseException:
            self._put(base, (None, f"its compile on process {self.me} raised"))
            raise
        if not exe.portable_ok:
            self._put(base, (None, "loaded from the persistent cache (cannot be serialized)"))
            return exe
        blob = self._put(base, (exe.portable(), exe.compile_s))
        self.published += 1
        how = "loaded from the program store" if exe.origin == "stored" else "compiled"
        self.log(f"{how} {name} in {exe.compile_s:.2f}s and published it for the other "
                 f"processes ({blob / 1e6:.1f} MB)")
        return exe

    def _put(self, base: str, payload) -> int:
        blob = pickle.dumps(payload)
        try:
            self.client.key_value_set_bytes(f"{base}/exe", blob)
        except JaxRuntimeError as e:
            self.log(f"could not publish a compiled program ({type(e).__name__}: {e})")
            if payload[0] is not None:  # the waiters compile on their own
                return self._put(base, (None, f"publishing failed: {type(e).__name__}"))
        return len(blob)
