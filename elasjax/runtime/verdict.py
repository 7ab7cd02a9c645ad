"""A guard's barriers and their verdicts (`MultiControllerRuntime.guard`).

At each barrier every live process posts whether its block raised; the arbiter, the lowest live
process (the next one when it dies first), waits for every post or for the poster's death
(`liveness.arbitrate`) and posts the `Verdict`, the one record every live process reads. It
travels through the coordination service's key-value store as JSON; in the runtime it is a typed
value keyed by process number."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable

from jax.errors import JaxRuntimeError

from . import membership
from .liveness import arbitrate, diverged, peer_state, post


@dataclasses.dataclass(frozen=True)
class Verdict:
    failed: tuple[int, ...]  # processes declared dead at this barrier
    exited: tuple[int, ...]  # of those, the ones seen exiting (pidfd, a death notice)
    exit_how: dict[int, str]  # how each exited one was seen
    starved_s: dict[int, float]  # waited for: silent this long while its CPU time advanced
    silent_s: dict[int, float]  # each dead process's heartbeat silence
    errors: dict[int, str]  # processes whose block raised: the error's first line
    timeout_s: float  # the liveness timeout the arbiter judged by
    where: str  # "entry" or "exit"
    arrived: dict[int, float]  # when each process posted, in seconds after the first
    t_verdict: float  # when the arbiter decided (time.time())
    # restarted processes asking to rejoin (a step's exit barrier only): each one's request nonce
    joining: dict[int, str] = dataclasses.field(default_factory=dict)

    _KEYED = ("exit_how", "starved_s", "silent_s", "errors", "arrived", "joining")

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        for name in self._KEYED:  # JSON object keys are strings
            d[name] = {str(p): v for p, v in d[name].items()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "Verdict":
        d = json.loads(text)
        for name in cls._KEYED:
            d[name] = {int(p): v for p, v in d.get(name, {}).items()}
        d["failed"], d["exited"] = tuple(d["failed"]), tuple(d["exited"])
        return cls(**d)

    def errors_line(self, width: int) -> str:
        """The errors this verdict reports, each process's cut to `width` characters."""
        return "; ".join(f"process {p}: {m[:width]}" for p, m in sorted(self.errors.items()))


class Barriers:
    """This process's side of every guard barrier: post, then read the arbiter's verdict or
    arbitrate. `guards` counts the barriers run (every live process runs the same sequence; a
    newcomer continues from the live processes' count)."""

    def __init__(self, client, me: int, liveness, exits, log: Callable[[str], None],
                 heartbeat_timeout_s: float, num_processes: int, init_timeout_s: float,
                 diverge_after_s: float, starved_max_s: float, guards: int = 0):
        self.client, self.me, self.liveness, self.exits, self.log = client, me, liveness, exits, log
        self.heartbeat_timeout_s, self.num_processes = heartbeat_timeout_s, num_processes
        self.init_timeout_s, self.diverge_after_s = init_timeout_s, diverge_after_s
        # a same-host peer whose heartbeat starves while its CPU time advances is waited for
        # up to this silence
        self.starved_max_s = starved_max_s
        self.guards = guards

    def barrier(self, err: BaseException | None, timeout: float, where: str,
                live: list[int], stuck_after: float | None = None) -> Verdict:
        """Post this process's status (`err` or ok) at the next barrier and return its verdict
        (`timeout`: the liveness timeout that makes an absent peer dead; `live`: the live
        processes, sorted; `stuck_after`: the silence that makes a same-host peer whose CPU
        time stands still dead, whatever `timeout` is: `liveness.peer_state`)."""
        self.guards += 1
        key = f"elasjax/g/{self.guards}"
        status = "ok" if err is None else "err:" + (str(err).splitlines() or [""])[0][:300]
        mine = post(status)
        self.liveness.at_barrier = f"#{self.guards} {self.liveness.phase} {where}"
        try:
            self.client.key_value_set(f"{key}/{self.me}", mine, allow_overwrite=True)
            return self._verdict(key, mine, err, timeout, where, live, stuck_after)
        finally:
            self.liveness.at_barrier = ""

    def _verdict(self, key: str, mine: str, err, timeout: float, where: str,
                 live: list[int], stuck_after: float | None = None) -> Verdict:
        """This barrier's verdict: the arbiter's, or this process's as the arbiter."""
        slow = max(timeout, float(self.heartbeat_timeout_s))
        # the arbiter is judged as `arbitrate` judges any peer: the fast timeout where this
        # process's own block failed (evidence of a failure), else the slow one
        verdict, gone = self._await_verdict(key, live, timeout if err is not None else slow,
                                            stuck_after)
        if verdict is not None:
            return verdict  # the arbiter's
        # this process arbitrates: it is the lowest live process, or every lower one died here
        # the fast timeout needs evidence of a failure: a block that failed on a process that
        # got here. A peer absent while every block succeeded took part in all their
        # collectives, so it is late, not dead: it gets the slow timeout (a live process's
        # heartbeat can stall for a second in a step beside a background compile:
        # experiments/RESULTS.md, "Multi-process observations").
        statuses, arrived, failed, exited, starved, used = arbitrate(
            self.client, key, {self.me: mine}, [p for p in live if p != self.me and p not in gone],
            self.liveness, self.exits, timeout, slow, self.starved_max_s, self.diverge_after_s,
            stuck_after,
        )
        for p, silence in gone.items():  # arbiters that died before posting a verdict
            failed[p] = silence
            if self.exits.exited(p):
                exited.append(p)
        how = {p: self.exits.how(p) for p in exited}
        if starved:
            self.log(f"{self.liveness.phase} {where} barrier: waited for " + ", ".join(
                f"process {p} (silent {v:.2f}s, its CPU time advancing)" for p, v in starved.items()
            ) + ": starved, not dead")
        joining = {}
        if self.liveness.phase == "step" and where == "exit":  # restarted processes asking
            outside = set(range(self.num_processes)) - set(live) - set(failed)
            joining = membership.pending_requests(self.client, outside, self.init_timeout_s)
        verdict = Verdict(
            failed=tuple(sorted(failed)),
            exited=tuple(sorted(exited)),
            exit_how=how,
            starved_s={p: round(v, 3) for p, v in starved.items()},
            silent_s={p: round(v, 3) for p, v in failed.items()},
            errors={p: v[4:] for p, v in statuses.items() if v.startswith("err:")},
            timeout_s=used,
            where=where,
            # when each process posted, in seconds after the first (the start's skew, and the
            # late process a failure in the block after an entry barrier names)
            arrived={p: round(t - min(arrived.values()), 3) for p, t in arrived.items()},
            t_verdict=time.time(),
            joining=dict(joining),
        )
        try:  # the first verdict posted is everyone's (an arbiter thought dead may post late)
            self.client.key_value_set(f"{key}/verdict", verdict.to_json())
        except JaxRuntimeError:
            verdict = Verdict.from_json(
                self.client.blocking_key_value_get(f"{key}/verdict", 10_000))
        if self.guards > 100:  # keep the store small; a fenced process still finds its verdict
            old = f"elasjax/g/{self.guards - 100}"
            with contextlib.suppress(JaxRuntimeError):
                self.client.key_value_delete(old)  # the directory: every post and the verdict
        return verdict

    def _await_verdict(self, key: str, live: list[int], limit: float,
                       stuck_after: float | None = None) -> tuple[Verdict | None, dict]:
        """Wait for the verdict of the lowest live process; when it dies first (`peer_state` with
        `limit`), the next one arbitrates, and so on.
        Returns (the verdict, {}), or (None, {p: silence} of the dead arbiters) when this process
        arbitrates ({} when it was the lowest)."""
        gone: dict[int, float] = {}
        t_wait = time.time()
        while True:
            arbiter = next(p for p in live if p not in gone)
            if arbiter == self.me:
                return None, gone
            try:  # the arbiter waits for slow processes, so may we; one seen exited is
                # succeeded at once, its verdict read first (it may have posted it and died):
                # a slice's wait for it made process 0's death take 0.24-0.27 s to detect
                # against 0.08-0.11 s for the others' (experiments/RESULTS.md, "The MTTR of a
                # user's own loop under launch")
                return Verdict.from_json(
                    self.client.key_value_try_get(f"{key}/verdict") if self.exits.exited(arbiter)
                    else self.client.blocking_key_value_get(f"{key}/verdict", 200)), {}
            except JaxRuntimeError:
                pass
            state, silent = peer_state(arbiter, self.liveness, self.exits, limit,
                                       self.starved_max_s, stuck_after)
            if state == "alive":  # but waiting elsewhere, for good: never silence
                diverged(arbiter, self.liveness, self.liveness.at_barrier, t_wait,
                         self.diverge_after_s)
            if state in ("exited", "dead", "stuck"):
                self.log(f"{self.liveness.phase}: the arbiter, process {arbiter}, is dead "
                         f"(silent {silent:.2f}s); the next live process arbitrates")
                gone[arbiter] = silent
