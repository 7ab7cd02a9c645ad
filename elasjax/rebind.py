"""Reuse one compiled program on another set of devices, without compiling it again.

The program XLA compiles for a plan depends on the plan's shape (mesh axes, micro-batches,
partition, ZeRO layout), not on which devices carry it. The CPU backend still bakes the device
assignment into the executable (JAX's persistent cache keeps it in the key there; it strips it
only on GPU), so a standby executable for devices (0, 1, 2, 4, 5, 6, 7) does not serve the
failure that leaves (0, 1, 2, 3, 4, 5, 7). `rebind` serves it anyway: it serializes the compiled
executable once and loads it again with every device id mapped to its counterpart, the device
assignment included. Loading links the compiled code (about 0.5 s for the demo's 2.3 MB train
step on one core here) where a compile takes 10 s or more.

Only within one process whose devices are all addressable (`supported`): a program spanning
processes is compiled on every process, and a rebind there would have to be agreed by all.
`tests/test_standby_baselines.py` checks that a rebound step gives bitwise the result of the
step compiled for its devices.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import serialize_executable as _se


def supported() -> bool:
    """Can executables be rebound here (one process)?"""
    return jax.process_count() == 1


class Serialized:
    """A compiled function, serialized once, loadable on any same-sized device set."""

    def __init__(self, compiled: jax.stages.Compiled, device_ids: Sequence[int]):
        self.payload, self.in_tree, self.out_tree = _se.serialize(compiled)
        self.device_ids = tuple(device_ids)  # the device assignment, in mesh order

    def load(self, device_ids: Sequence[int], devices: Mapping[int, jax.Device]) -> jax.stages.Compiled:
        """The same executable on `device_ids` (position i of the assignment replaces
        `self.device_ids[i]`)."""
        if len(device_ids) != len(self.device_ids):
            raise ValueError(
                f"a program for {len(self.device_ids)} devices cannot be rebound to "
                f"{len(device_ids)} devices"
            )
        mapping = dict(zip(self.device_ids, device_ids))
        targets = [devices[i] for i in device_ids]
        assignment = np.asarray([list(device_ids)])  # one replica, one partition per device
        unpickler = _Remap(io.BytesIO(self.payload), targets[0].client, targets, mapping, assignment)
        unloaded, args_flat, no_kwargs = unpickler.load()
        return jax.stages.Compiled(
            unloaded.load(), [], self.in_tree.unflatten(args_flat), self.out_tree,
            no_kwargs=no_kwargs,
        )


class _Remap(_se._JaxPjrtUnpickler):
    """JAX's executable unpickler, with device ids mapped and the device assignment replaced."""

    def __init__(self, file, backend, devices, mapping, assignment):
        super().__init__(file, backend, devices)
        self.mapping, self.assignment = mapping, assignment

    def persistent_load(self, pid):
        if pid[0] == "device":
            return self.devices_by_id[self.mapping[pid[1]]]
        if pid[0] == "exec":
            from jax._src import compiler

            options = compiler.get_compile_options(
                1, self.assignment.shape[1], device_assignment=self.assignment, backend=self.backend
            )
            return self.backend.deserialize_executable(
                pid[1], executable_devices=self.execution_devices, compile_options=options
            )
        return super().persistent_load(pid)
