"""The rule every move of the training state ends with: a recovery, a cut-over, an admission
(`elasjax.loop.recovery`, `elasjax.loop.cutover`, `elasjax.loop.admission`, each through
`recovery.protect_moved`) and the pieces' `ElasticState.recover`.

After the state has been moved to its new layout, and before anything uses it, its checksums
must equal those of the state it came from (`checksum.verify` raises `StateMismatchError`
naming the leaf otherwise: a move never continues with wrong state). Then the new layout is
protected at once: a fresh snapshot pool, configured for it, takes the moved state. The old pool
is left as it was, so a caller that fails before this point still has the old layout's copies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from . import checksum


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What a move's verification compared (`verify_and_protect`), as the events record it
    (`verify`): the leaves whose checksums were compared, the bytes those checksums cover
    (`checksum.covered_bytes`), and the digest (`checksum.digest`) of the checksums the moved
    state had to have and of those it has. A mismatch raises before a `Comparison` exists, so
    a recorded one has equal digests; `verified` is read off it, never set."""

    leaves: int
    bytes: int
    digest_before: str  # the expected checksums' digest (the state the move started from)
    digest_after: str  # the moved state's checksums' digest

    @property
    def verified(self) -> bool:
        return self.leaves > 0 and self.digest_before == self.digest_after

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Protected:
    """A moved state, verified and protected (`verify_and_protect`)."""

    actual: dict[str, str]  # the moved state's checksums (equal to the expected ones)
    pool: Any  # the fresh snapshot pool, holding a copy of the moved state
    verify_s: float
    snapshot_s: float
    compared: Comparison  # what the verification compared


def verify_and_protect(
    state, *, checksums: Callable[[Any], dict[str, str]], expected: dict[str, str], what: str,
    against: str, pool, configure: Callable[[Any], None], step: int, take=None,
    commit: Callable[[Any], None] | None = None,
) -> Protected:
    """Verify the moved `state` against `expected` (`checksums(state)`; `what` and `against`
    name both in a mismatch's message), then a fresh pool from `pool` (`SnapshotPool.fresh`),
    set up by `configure(new_pool)`, takes `take` (default: `state`) as step `step`. `commit`
    (the runtime's) waits for the pool's copies where a guard must see their errors. The
    result says what was compared (`Protected.compared`), for the move's event."""
    t0 = time.perf_counter()
    actual = checksums(state)
    leaves = checksum.verify(expected, actual, what, against)
    compared = Comparison(leaves, checksum.covered_bytes(state), checksum.digest(expected),
                          checksum.digest(actual))
    t1 = time.perf_counter()
    new_pool = pool.fresh()
    configure(new_pool)
    new_pool.take(state if take is None else take, step)
    if commit is not None:
        commit(new_pool.in_flight())  # a block reports once its programs ended
    return Protected(actual, new_pool, t1 - t0, time.perf_counter() - t1, compared)
