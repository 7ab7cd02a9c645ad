"""Point-to-point copies between the processes of a `jax.distributed` job.

Every process runs a transfer server of `jax.experimental.transfer` on its devices' client and
posts its address to the coordination service's key-value store. A sender schedules arrays under
an id that both sides derive from the same (tag, source, destination) (`send`: `await_pull`);
the receiver pulls exactly those into its own device (`pull`). Only the planned bytes travel,
and a pull from a dead process fails at once (its socket closes). A new server (`start`: at
start-up, on a renewed CPU client, after this process shut its connections down) is posted under
a new key; every live process starts one at the same points, so the keys agree.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from ..core import jaxcompat
from . import kvwait


class TransferLinks:
    """This process's transfer server and its connections to the other processes' servers.
    `gone(p)`: process p is known dead (the wait for its server's address ends, `kvwait`)."""

    def __init__(self, client, me: int, host: str, wait_s: float, gone: Callable[[int], bool]):
        self.client, self.me, self.host, self.wait_s = client, me, host, wait_s
        self._gone = gone
        self.started = 0  # servers started so far (the key of their addresses)
        self.server: Any = None
        self._addr: dict[int, str] = {}
        self._conns: dict[int, Any] = {}

    def start(self, device: jax.Device) -> None:
        """A new server on `device`'s client; connections to the old servers are dropped."""
        addr = f"{self.host}:0"
        self.server = jaxcompat.transfer_module().start_transfer_server(device.client, addr, [addr])
        self.started += 1
        self.client.key_value_set(f"elasjax/xfer/{self.started}/{self.me}", self.server.address())
        self._addr.clear()
        self._conns.clear()

    def forget(self, procs: Iterable[int]) -> None:
        for p in procs:
            self._conns.pop(p, None)

    @staticmethod
    def _uuid(tag, src: int, dst: int) -> int:
        return hash((tag, src, dst)) & ((1 << 62) - 1)

    def send(self, tag, dst: int, arrays: Sequence[jax.Array]) -> None:
        """Offer `arrays` (on this process's devices) to process `dst`'s `pull` of `tag`."""
        self.server.await_pull(self._uuid(tag, self.me, dst), list(arrays))

    def pull(self, tag, src: int, specs: Sequence[jax.ShapeDtypeStruct]) -> list:
        """The arrays process `src` offered this process under `tag`, onto the devices of
        `specs`' shardings; at most `wait_s` (then an error)."""
        if src not in self._conns:
            if src not in self._addr:
                self._addr[src] = kvwait.read(
                    self.client, f"elasjax/xfer/{self.started}/{src}", 30_000, src, self._gone)
            self._conns[src] = self.server.connect(self._addr[src])
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.wait_s)
        return self._conns[src].pull(self._uuid(tag, src, self.me), list(specs), deadline)
