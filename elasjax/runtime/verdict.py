"""A barrier's verdict: what the arbiter of one guard barrier decided, the one record every live
process reads (`MultiControllerRuntime.guard`). It travels through the coordination service's
key-value store as JSON; in the runtime it is this typed value, keyed by process number."""

from __future__ import annotations

import dataclasses
import json


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
