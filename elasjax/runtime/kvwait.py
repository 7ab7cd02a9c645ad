"""Key-value reads that end as soon as the key's writer is known dead (`read`).

A survivor that waits in the coordination service's `blocking_key_value_get` for a key only a
dead process would have written waits the read's whole timeout: the service cannot know that
the key will never come. A recovery is full of such reads (every process's vote, a plan shared
by one process, a transfer server's address, the renewed client's go-ahead), and a second death
during a recovery left its survivors in one for 13 s (experiments/RESULTS.md, "The ZeRO demo's
kill soak at seed 81": `retry_s` 19.7 s; issue 83). So each read here waits in short slices and,
between them, asks the runtime whether the writer is gone (`MultiControllerRuntime.peer_gone`:
left the job, exited, or silent past the heartbeat timeout): then it raises `WriterGone` at once.
Inside a guard's block that is an error like any other; the exit barrier's verdict names the
dead process (tests/test_multiprocess.py, `test_a_read_whose_writer_died_ends_at_once`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from jax.errors import JaxRuntimeError

# one slice of a read: how late a death known meanwhile is noticed, and one RPC each
SLICE_MS = 100


class WriterGone(RuntimeError):
    """The key's writer died (or left the job) before writing it."""

    def __init__(self, key: str, writer: int, waited_s: float):
        super().__init__(f"process {writer} is gone: its key-value entry '{key}' will not "
                         f"come (waited {waited_s:.2f}s)")
        self.key, self.writer = key, writer


def read(client, key: str, timeout_ms: int, writer: int, gone: Callable[[int], bool],
         *, slice_ms: int = SLICE_MS, clock: Callable[[], float] = time.monotonic) -> str:
    """`client.blocking_key_value_get(key, timeout_ms)`, except that it raises `WriterGone` as
    soon as `gone(writer)` (checked before each slice of `slice_ms`) says that the only process
    that writes `key` is dead. The read's own timeout raises as before (JaxRuntimeError).
    `clock`: what the timeout is measured on (a test's store advances its own)."""
    t0 = clock()
    deadline = t0 + timeout_ms / 1000
    while True:
        left_ms = round((deadline - clock()) * 1000)
        if gone(writer):
            raise WriterGone(key, writer, clock() - t0)
        if left_ms <= slice_ms:  # the last slice: its timeout is the read's
            return client.blocking_key_value_get(key, max(left_ms, 1))
        try:
            return client.blocking_key_value_get(key, slice_ms)
        except JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
