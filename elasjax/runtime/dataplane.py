"""What the live processes of a job send each other outside XLA's programs (`DataPlane`):
arrays device to device (`move`: a transition's pieces, snapshot copies), packed host arrays
(`exchange`: a rejoin's package), and small values through the coordination service's key-value
store (`agree`: every process's value; `share`: one process's value on all).

Every live process makes the same calls in the same order, so each exchange is numbered
(`incident`, `seq`) the same way everywhere and its keys and transfer tags never collide with an
earlier one's. A failure starts a new incident (`next_incident`): what the dead left half done
under the old numbers is never read. Point-to-point copies go through
`jax.experimental.transfer` (`p2p.TransferLinks`): only the planned bytes travel, and a pull
from a dead process fails at once (a cross-process `jax.device_put` onto a different device set
is refused by the runtime).
"""

from __future__ import annotations

import base64
import json
import pickle
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..transfer.copies import pack, packed_size, unpack
from . import kvwait
from .p2p import TransferLinks


class DataPlane:
    """Numbered exchanges between the live processes (see the module docstring). The runtime
    gives it where devices are (`devices`: id -> the current client's device; `process_of`),
    who is live (`processes`), who is gone (`gone`: a read of a gone process's key ends at once,
    `kvwait`) and how to bring an array onto the current client (`current`)."""

    def __init__(self, client, me: int, links: TransferLinks, wait_s: float,
                 devices: dict[int, Any], process_of: Callable[[Any], int],
                 processes: Callable[[], set[int]], current: Callable[[Any], Any],
                 gone: Callable[[int], bool]):
        self.client, self.me, self.links, self._gone = client, me, links, gone
        self._wait_ms = int(wait_s * 1000)
        self._devices, self._process_of = devices, process_of
        self._processes, self._current = processes, current
        self.incident, self.seq = 0, 0

    def next_incident(self) -> int:
        """A failure: exchanges start again under a new incident number (returned)."""
        self.incident += 1
        self.seq = 0
        return self.incident

    def _tag(self) -> tuple[int, int]:
        self.seq += 1
        return self.incident, self.seq

    def exchange(self, sends: dict[int, list[np.ndarray]], recvs: dict[int, list[tuple]],
                 device) -> dict:
        """Send `sends[q]` (host arrays) to process q and receive `recvs[p]` ((shape, dtype)
        each) from process p, one packed buffer per pair staged on `device`."""
        tag = self._tag()
        for q, arrays in sends.items():
            self.links.send(tag, q, [jax.device_put(pack(arrays), device)])
        pulled = {}
        for p, specs in recvs.items():
            spec = jax.ShapeDtypeStruct(
                (packed_size(specs),), np.uint8, sharding=jax.sharding.SingleDeviceSharding(device)
            )
            pulled[p] = self.links.pull(tag, p, [spec])[0]
        return {p: unpack(np.asarray(x), recvs[p]) for p, x in pulled.items()}

    def move(self, items: Sequence[tuple]) -> list:
        """(src device, dst device, array or None, shape, dtype) -> the arrays on the
        destinations this process holds (None elsewhere), device to device."""
        tag = self._tag()
        out: list = [None] * len(items)
        sends: dict[int, list] = defaultdict(list)
        recvs: dict[int, list] = defaultdict(list)
        local_put = []
        for i, (src, dst, x, shape, dtype) in enumerate(items):
            sp, dp = self._process_of(src), self._process_of(dst)
            if sp == self.me and dp == self.me:
                local_put.append(i)
            elif sp == self.me:
                sends[dp].append(x)
            elif dp == self.me:
                sh = jax.sharding.SingleDeviceSharding(self._devices[dst])
                recvs[sp].append((i, jax.ShapeDtypeStruct(shape, dtype, sharding=sh)))
        if local_put:
            moved = jax.device_put(
                [self._current(items[i][2]) for i in local_put],
                [self._devices[items[i][1]] for i in local_put],
            )
            for i, x in zip(local_put, moved):
                out[i] = x
        for q, arrays in sends.items():
            self.links.send(tag, q, [self._current(x) for x in arrays])
        for p, entries in recvs.items():
            got = self.links.pull(tag, p, [s for _, s in entries])
            for (i, _), x in zip(entries, got):
                out[i] = x
        return out

    def agree(self, value) -> dict[int, Any]:
        """Every live process's `value` (JSON-able), through the key-value store."""
        incident, seq = self._tag()
        key = f"elasjax/agree/{incident}/{seq}"
        self.client.key_value_set(f"{key}/{self.me}", json.dumps(value), allow_overwrite=True)
        return {
            p: json.loads(kvwait.read(self.client, f"{key}/{p}", self._wait_ms, p, self._gone))
            for p in sorted(self._processes())
        }

    def share(self, value, src: int):
        """Process `src`'s `value` (a small tree of numpy arrays), on every live process."""
        incident, seq = self._tag()
        key = f"elasjax/share/{incident}/{seq}"
        if self.me == src:
            self.client.key_value_set(key, base64.b64encode(pickle.dumps(value)).decode())
            return value
        return pickle.loads(base64.b64decode(
            kvwait.read(self.client, key, self._wait_ms, src, self._gone)))
