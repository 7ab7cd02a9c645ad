"""`Step`: one step of your loop as the block a process death interrupts (`ElasticState.steps`)."""

from __future__ import annotations

from typing import Any

from ..runtime.inprocess import DeviceFailure


class Step:
    """One step of your loop (`ElasticState.steps`): its number `n` (also `int(step)`), and,
    as `with step:`, the block a process death interrupts. Under `elasjax launch` the block runs
    in a guard of the job's runtime: an entry barrier, your code, an exit barrier where every
    live process learns what happened; a death inside it makes every survivor leave the block
    together, recover (`ElasticState.recovery`) and get the same step again from
    `ElasticState.steps`. In one process the block is your code alone."""

    def __init__(self, es: Any, n: int):  # es: the `state.ElasticState` whose step it is
        self.es, self.n = es, n
        self.staged = None  # (state, step, checksums) committed in the block, not yet applied
        self.committed = False
        self.failed = False  # a failure ended the block; the state was recovered
        self._guard = None

    def __int__(self) -> int:
        return self.n

    __index__ = __int__

    def __repr__(self) -> str:
        return f"Step({self.n})"

    def __enter__(self) -> Step:
        es = self.es
        if es._open is not None:
            raise RuntimeError(f"step {self.n}: the block of step {es._open.n} is still open")
        try:
            es._admit_joiners()  # restarted processes the last step's verdict named
        except DeviceFailure as f:  # during the admission: the committed state recovered
            es._on_failure(f, None)
            if es.step + 1 != self.n:
                raise RuntimeError(
                    f"step {self.n}: the recovered state is that of step {es.step}") from f
        while True:
            guard = es.rt.guard("step")
            try:
                guard.__enter__()  # the entry barrier: a death may be found here already
            except DeviceFailure as f:
                es._on_failure(f, self.n)
                if es.step + 1 != self.n:
                    raise RuntimeError(
                        f"step {self.n}: the recovered state is that of step {es.step}") from f
                continue
            self._guard, es._open = guard, self
            return self

    def __exit__(self, et, e, tb) -> bool:
        es, guard = self.es, self._guard
        es._open, self._guard = None, None
        try:
            guard.__exit__(et, e, tb)  # the exit barrier: raises what every process decides
        except DeviceFailure as f:
            self._drop()
            es._on_failure(f, self.n)
            self.failed = True
            return True  # `steps` gives the interrupted step again, on the recovered state
        except BaseException:
            self._drop()
            raise
        if et is not None:
            self._drop()
            return False
        if self.staged is not None:
            es._apply(*self.staged)
            self.staged, self.committed = None, True
        return False

    def _drop(self) -> None:
        """The step's commit does not count: its snapshot generation is dropped."""
        if self.staged is not None:
            self.es.pool.abort(self.staged[1])
            self.staged = None
