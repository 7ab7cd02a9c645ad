"""Test-only: change one element of the state a move of the loop built, after the move and before
its verification, so that tests/test_verification.py sees the verification refuse it.

`install(move, setattr, seen)` wraps the narrowest point of one move, the function that returns
the moved state: `Recoverer._rebuild` (a recovery), `transition` as `loop.cutover` calls it (a
cut-over: migration or growth) or as `loop.admission` calls it (an admission under `launch`).
The wrapper flips the lowest bit of the first element of `LEAF` in every shard that holds that
element, and appends (the step of the move, `LEAF`) to `seen`. The loop then carries on with that
state as if the move had produced it: only its verification (`recovery.protect_moved`) stands
between it and the next step.

In one process the tests call `install` with pytest's `monkeypatch.setattr`. Under `elasjax
launch` every worker imports this module (`--import user_corrupt_move`) with
`ELASJAX_TEST_CORRUPT_MOVE` set to the move (`recovery`, `cutover` or `admission`); it then
installs itself and prints one line per corruption (`CORRUPTED ...`) to the worker's log.
Without that variable importing it changes nothing. elasjax itself has no test hook for this.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import numpy as np

from elasjax.core.sharding import path_str

# a plain (not ZeRO-partitioned, not pipeline-slotted) leaf of the built-in GPT in every layout
# the tests use: its checksum key is its path, which the error must name
LEAF = "params/embed/embedding"
MOVES = ("recovery", "cutover", "admission")


def flip_one(state, leaf: str = LEAF):
    """`state` with the lowest bit of element [0, ..., 0] of `leaf` flipped, in every shard of
    this process that holds that element (so every replica of it agrees: the checksum sees one
    changed element whichever device hashes it). No collective: each process changes its own
    shards (under `launch` every process runs this at the same point of the same move)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [path_str(p) for p, _ in flat]
    if leaf not in names:
        raise KeyError(f"user_corrupt_move: no leaf {leaf!r} in the moved state: {names}")
    leaves = [x for _, x in flat]
    i = names.index(leaf)
    x = leaves[i]
    if not x.addressable_shards:  # a process holding none of it (a newcomer being admitted)
        return state
    shards = []
    for s in x.addressable_shards:
        a = np.array(s.data)  # a copy on the host
        if all((sl.start or 0) == 0 for sl in s.index):  # this shard holds element [0, ..., 0]
            a.reshape(-1).view(np.dtype(f"u{a.dtype.itemsize}"))[0] ^= 1
        shards.append(jax.device_put(a, s.device))
    leaves[i] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
    return jax.tree.unflatten(treedef, leaves)


def install(move: str, setattr=setattr, seen: list | None = None) -> list:
    """Corrupt every `move` of the loop from now on (see the module's docstring); returns
    `seen`, the list of (step, leaf) it appends to at each corruption."""
    from elasjax.loop import admission, cutover, recovery

    seen = [] if seen is None else seen
    if move == "recovery":
        rebuild = recovery.Recoverer._rebuild

        def corrupted_rebuild(self, pos, *args, **kwargs):
            built = rebuild(self, pos, *args, **kwargs)
            seen.append((pos.step, LEAF))
            return dataclasses.replace(built, state=flip_one(built.state))

        setattr(recovery.Recoverer, "_rebuild", corrupted_rebuild)
        return seen
    if move not in MOVES:
        raise ValueError(f"user_corrupt_move: unknown move {move!r}; allowed: {MOVES}")
    # a cut-over or an admission: the move's own method records its step, the transition it
    # calls returns the corrupted state
    module, cls, method = ((cutover, cutover.Cutovers, "cutover") if move == "cutover"
                           else (admission, admission.Admissions, "settle"))
    orig_method, orig_transition = getattr(cls, method), module.transition
    steps: list[int] = []

    def recorded(self, pos, *args, **kwargs):
        steps.append(pos.step)
        return orig_method(self, pos, *args, **kwargs)

    def corrupted_transition(*args, **kwargs):
        state, log = orig_transition(*args, **kwargs)
        seen.append((steps[-1], LEAF))
        return flip_one(state), log

    setattr(cls, method, recorded)
    setattr(module, "transition", corrupted_transition)
    return seen


_MOVE = os.environ.get("ELASJAX_TEST_CORRUPT_MOVE")
if _MOVE:
    class _Printed(list):
        def append(self, item) -> None:
            super().append(item)
            print(f"CORRUPTED {_MOVE} at step {item[0]}: one element of {item[1]}", flush=True,
                  file=sys.stderr)

    install(_MOVE, seen=_Printed())
