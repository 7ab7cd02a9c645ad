"""JSON-lines writers for `metrics.jsonl` and `events.jsonl`, and readers for them.

One line per step in `metrics.jsonl`: `{"step", "loss", "global_batch", "tokens", "n_devices",
"plan", "step_time_s"}` plus optional fields (`eval_loss`, `batch_digest`, `redo`). One line per
event in `events.jsonl`; recovery events carry the MTTR breakdown (see `trainer.RecoveryEvent`).
Plots and `elasjax compare` read these files only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


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
