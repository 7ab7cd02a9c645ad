"""Death notices: a process's death announced from its own host, so that peers on other hosts
learn of it in milliseconds instead of from a heartbeat silence (`Liveness`).

Why: a peer on another host cannot watch a process's exit (the kernel's pidfd works on one
host only: `liveness.ProcessExits`), and a heartbeat silence can only be trusted after a timeout
longer than the silences of live processes, whose heartbeat threads starve for a second or more
beside compiles on loaded cores (experiments/RESULTS.md, "bench_detection"). But a process that
dies has a host that lives on: a tiny sidecar process there (no JAX, stdlib only), started by the
worker, waits on its parent's pidfd and, the moment the parent exits, sends a UDP datagram
`dead <process> <pid>` to every peer's listener. A peer's listener thread treats it as proof of
death (as the kernel's word is for a same-host peer): the collectives of a step are shut down at
once (`aborts.CollectiveAborts.on_exit`) and the arbiter declares the process dead without a
timeout. A whole host's loss (power, network) sends no notice: the heartbeat still decides that.

A normal exit says `bye` to the sidecar first, which then ends silently. The notice names the
dead process's pid, checked against the pid that incarnation posted (`elasjax/proc/<p>`), so a
late datagram never kills a restarted incarnation. Datagrams can be lost: the notice is sent
three times, and the heartbeat stays the backstop. Tested in
tests/test_multiprocess.py::test_a_death_notice_from_the_dead_process_host_ends_the_wait.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from jax.errors import JaxRuntimeError

NOTE_KEY = "elasjax/note"  # <NOTE_KEY>/<p>: where process p listens for notices ("host:port")

# The sidecar: waits for its parent's exit (pidfd) and for peer lists on stdin (one JSON list of
# [host, port] per line; "bye" ends it silently); on the parent's exit it notifies every peer.
_SIDECAR = r"""
import json, os, select, socket, sys
parent, me = int(sys.argv[1]), sys.argv[2]
try:
    fd = os.pidfd_open(parent)
except ProcessLookupError:  # it died before this started: no peer is known to tell
    sys.exit(0)
peers, buf, stdin = [], b"", sys.stdin.fileno()
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
watch = [fd, stdin]
while True:
    ready = select.select(watch, [], [])[0]
    if stdin in ready:
        data = os.read(stdin, 1 << 16)
        if not data:
            watch = [fd]
        buf += data
        *lines, buf = buf.split(b"\n")
        for ln in lines:
            if ln.strip() == b"bye":
                sys.exit(0)
            if ln.strip():
                peers = [tuple(a) for a in json.loads(ln)]
    if fd in ready:
        note = f"dead {me} {parent}".encode()
        for _ in range(3):
            for host, port in peers:
                try:
                    sock.sendto(note, (host, int(port)))
                except OSError:
                    pass
        sys.exit(0)
"""


def advertised_host(coordinator_host: str) -> str:
    """The address peers reach this host's listener at: loopback for a local job (its
    coordinator is on loopback), else this host's name resolved."""
    if coordinator_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return coordinator_host


class DeathNotes:
    """This process's listener for peers' death notices, and its sidecar announcing its own.

    `on_notice(p, pid)` is called from the listener thread for each notice received (every copy:
    the receiver ignores repeats)."""

    def __init__(self, client, me: int, coordinator_host: str,
                 on_notice: Callable[[int, int], None], enabled: bool = True):
        self.client, self.me, self.on_notice = client, me, on_notice
        self.enabled = enabled and hasattr(os, "pidfd_open")
        self._peers: dict[int, str] = {}
        self._sent: list | None = None
        self._stop = threading.Event()
        self.sidecar: subprocess.Popen | None = None
        if not self.enabled:
            return
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.settimeout(0.5)
        host = advertised_host(coordinator_host)
        client.key_value_set(f"{NOTE_KEY}/{me}", f"{host}:{self.sock.getsockname()[1]}",
                             allow_overwrite=True)
        self.sidecar = subprocess.Popen(
            [sys.executable, "-c", _SIDECAR, str(os.getpid()), str(me)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self._thread = threading.Thread(target=self._listen, name="elasjax-notes", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                data, _ = self.sock.recvfrom(256)
            except OSError:  # the timeout, or the socket closed
                continue
            parts = data.decode(errors="replace").split()
            if len(parts) == 3 and parts[0] == "dead" and parts[1].isdigit() and parts[2].isdigit():
                self.on_notice(int(parts[1]), int(parts[2]))

    def refresh(self, peers) -> None:
        """Tell the sidecar where `peers` listen (read from the key-value store once per peer
        incarnation; one that has not posted yet is added at a later refresh). Call at every
        barrier."""
        if not self.enabled:
            return
        for p in peers:
            if p == self.me or p in self._peers:
                continue
            try:
                self._peers[p] = self.client.key_value_try_get(f"{NOTE_KEY}/{p}")
            except JaxRuntimeError:  # not posted (yet)
                continue
        live = set(peers)
        addrs = sorted([a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])]
                       for p, a in self._peers.items() if p in live)
        if addrs != self._sent:
            self._send(json.dumps(addrs))
            self._sent = addrs

    def forget(self, procs) -> None:
        """Processes restarted since (admitted again): read their new listeners' addresses."""
        for p in procs:
            self._peers.pop(p, None)

    def _send(self, line: str) -> None:
        if self.sidecar is None or self.sidecar.poll() is not None:
            return
        with contextlib.suppress(OSError):
            self.sidecar.stdin.write((line + "\n").encode())
            self.sidecar.stdin.flush()

    def close(self, announce: bool = False) -> None:
        """Stop listening. A normal exit (`announce` False) ends the sidecar without a notice;
        otherwise the sidecar stays to announce this process's exit."""
        self._stop.set()
        if self.sidecar is not None and not announce:
            self._send("bye")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.sidecar.wait(timeout=2)
            if self.sidecar.poll() is None:
                self.sidecar.kill()
        if self.enabled:
            self.sock.close()
