"""JSON-lines writers for `metrics.jsonl` and `events.jsonl`, and readers for them.

One line per step in `metrics.jsonl`: `{"step", "loss", "global_batch", "tokens", "n_devices",
"plan", "step_time_s"}` plus optional fields (`eval_loss`, `batch_digest`, `redo`). One line per
event in `events.jsonl`; recovery events carry the MTTR breakdown (`RecoveryEvent`, whose phases,
`MTTR_PHASES`, sum to its `mttr_s`). Plots and `elasjax compare` read these files only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


# The phases whose sum is a recovery's `mttr_s`, under every runtime.
MTTR_PHASES = (
    "detect_s",
    "retry_s",
    "plan_s",
    "compile_s",
    "transfer_s",
    "verify_s",
    "snapshot_s",
    "first_step_s",
)


@dataclasses.dataclass
class RecoveryEvent:
    step: int
    failed_devices: list[int]
    fault: str
    from_plan: str
    to_plan: str
    rung: str
    bytes_moved: int
    transfers: int
    max_transfers_per_device: int
    bytes_lost: int
    steps_lost: int
    detect_s: float
    plan_s: float
    compile_s: float
    standby_hit: bool  # the executable was compiled and ready when recovery asked for it
    exe_cache_hit: bool
    transfer_s: float
    verify_s: float
    runtime: str
    failure_simulation: str
    first_step_s: float = 0.0
    snapshot_s: float = 0.0
    retry_s: float = 0.0
    standby_wait_s: float = 0.0  # waited for a background compile already under way
    attempts: int = 1
    verified: bool = False
    resumed_at_step: int = 0
    bytes_kept_in_place: int = 0
    bytes_cross_process: int = 0
    bytes_sent: dict = dataclasses.field(default_factory=dict)  # this process, by peer
    bytes_received: dict = dataclasses.field(default_factory=dict)
    failed_processes: list[int] = dataclasses.field(default_factory=list)
    failed_phases: list[str] = dataclasses.field(default_factory=list)
    rungs: list[str] = dataclasses.field(default_factory=list)
    refused_snapshots: list[str] = dataclasses.field(default_factory=list)
    migration: str = "blocking"  # "blocking" | "async" (resumed on a fast path first)
    optimal_plan: str = ""
    strategy: str = "elastic"
    compiles: int = -1  # XLA compilations on the training thread from detection to first step
    transfer_plan_hit: bool = False  # the transition was planned before the failure
    transfer_plan_s: float = 0.0  # time spent planning it after the failure (0 on a hit)
    # hot spares (`parallel.spares`): the hosts (under launch: processes) whose spare devices
    # the new plan took into the lost ones' mesh positions, and the mesh size before and after
    spare_took_over: list[int] = dataclasses.field(default_factory=list)
    from_n_devices: int = 0
    to_n_devices: int = 0
    # a new CPU client with fresh gloo communicators was started (`elasjax.collectives`): its
    # time is in plan_s; executables of the old client are reloaded onto it when used
    collectives_renewed: bool = False
    renew_s: float = 0.0
    renew_reasons: str = ""  # which process asked, and why
    # asked for, but the client was kept: the aborted communicators are ones the new plan
    # cannot reach (`MultiControllerRuntime.renew_collectives`); why
    client_kept: str = ""
    detail: dict = dataclasses.field(default_factory=dict)  # what the runtime knows of the cause

    @property
    def mttr_s(self) -> float:
        return sum(getattr(self, k) for k in MTTR_PHASES)

    # summed when a recovery continues one whose first step failed
    _ADDED = ("plan_s", "compile_s", "transfer_s", "verify_s", "snapshot_s", "standby_wait_s",
              "renew_s", "transfer_plan_s", "bytes_moved", "transfers", "bytes_lost",
              "bytes_kept_in_place", "bytes_cross_process", "attempts")

    def continued_by(self, later: RecoveryEvent, failed_step_s: float) -> RecoveryEvent:
        """One recovery of this event and `later`, the recovery of a failure in this one's first
        step (`failed_step_s` long): a recovery ends at its first good step, so its MTTR runs
        from this failure to the step after `later`. The failed step and `later`'s detection
        count as `retry_s`; the other phases add up; the failures are both listed."""
        merged = dataclasses.replace(
            later,
            step=self.step,
            failed_devices=sorted(set(self.failed_devices) | set(later.failed_devices)),
            failed_processes=sorted(set(self.failed_processes) | set(later.failed_processes)),
            fault=f"{self.fault}; then, in its first step: {later.fault}",
            from_plan=self.from_plan,
            from_n_devices=self.from_n_devices,
            detect_s=self.detect_s,
            retry_s=self.retry_s + failed_step_s + later.detect_s + later.retry_s,
            standby_hit=self.standby_hit and later.standby_hit,
            exe_cache_hit=self.exe_cache_hit and later.exe_cache_hit,
            verified=self.verified and later.verified,
            steps_lost=self.steps_lost + later.steps_lost,
            failed_phases=self.failed_phases + later.failed_phases,
            rungs=self.rungs + later.rungs,
            refused_snapshots=self.refused_snapshots + later.refused_snapshots,
            collectives_renewed=self.collectives_renewed or later.collectives_renewed,
            renew_reasons="; ".join(r for r in (self.renew_reasons, later.renew_reasons) if r),
            client_kept="; ".join(r for r in (self.client_kept, later.client_kept) if r),
            compiles=self.compiles,  # the count at this recovery's start
            detail={**later.detail, **self.detail, "first_step_failure": later.fault},
        )
        for k in self._ADDED:
            setattr(merged, k, getattr(self, k) + getattr(later, k))
        return merged

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        detail = d.pop("detail")
        return {"type": "recovery", **d, **detail, "mttr_s": self.mttr_s}


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crashed run keeps what it logged."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        self._f = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self.path.open("w")

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, default=_default) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _default(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def losses_by_step(run_dir: str | Path, key: str = "loss") -> dict[int, float]:
    """The last logged value of `key` per step (a redone step's final value wins)."""
    out: dict[int, float] = {}
    for r in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        if key in r and r[key] is not None:
            out[int(r["step"])] = float(r[key])
    return out


def deviation(a: dict[int, float], ref: dict[int, float], steps=None) -> dict[str, float]:
    """Relative deviation of run `a` from reference `ref` over common (or given) steps:
    max and mean of |a - ref| / |ref|."""
    common = sorted(set(a) & set(ref) if steps is None else set(steps) & set(a) & set(ref))
    if not common:
        return {"steps": 0, "max_rel": math.nan, "mean_rel": math.nan}
    rel = [abs(a[s] - ref[s]) / max(abs(ref[s]), 1e-30) for s in common]
    return {"steps": len(common), "max_rel": max(rel), "mean_rel": sum(rel) / len(rel)}
