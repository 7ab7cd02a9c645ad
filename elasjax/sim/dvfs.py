"""DVFS: per-stage clocks that speed up bottleneck stages and slow stages with slack.

Model (digest section 2.4; ElasWave's own policy is not public, this is our reading):

    t(f) = t_c * f0 / f + t_m          stage time; only the compute share scales with the clock
    P(f) = P_static + k * (f / f0)^3   busy power, k = P_nominal - P_static
    idle power = P_static

Policy ("boost the critical path, fill the bubbles"): for a target step T*, pipeline p runs
every stage at the clock that makes its per-micro-batch time exactly
`tau_p = T* / (m_p + S_p - 1)` (bottleneck stages boosted, stages with slack slowed into the
time they would otherwise idle), clipped to [f_min, f_max]. Feasible when no stage needs more
than f_max and the busy power of all working devices stays under the cap
`cap_factor * devices * P_nominal` (the budget the same devices draw at f0). A bisection finds
the smallest feasible T*; the policy is kept only when its exact 1F1B step beats the nominal
clocks, so DVFS never makes a plan slower. Because power is convex in f, equal clocks
maximise total speed under a cap: the gain comes from moving power from idle slack to the
critical path, not from extra power.

The alternative "energy first" policy (slow only the slack stages, keep T*) is what the nominal
fallback plus slack slowing reduces to when no boost is possible; it is not offered separately.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .cluster import PipeGroup


@dataclasses.dataclass(frozen=True)
class PowerModel:
    """P(f) = P_static + (P_nominal - P_static) f^3, clocks relative to f0 in [f_min, f_max]."""

    p_nominal_w: float
    static_fraction: float
    f_min: float
    f_max: float
    cap_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.f_min <= 1.0 <= self.f_max:
            raise ValueError(f"need 0 < f_min <= 1 <= f_max, got {self.f_min}, {self.f_max}")
        if not 0 <= self.static_fraction < 1:
            raise ValueError(f"static_fraction must be in [0, 1), got {self.static_fraction}")

    @property
    def p_static_w(self) -> float:
        return self.p_nominal_w * self.static_fraction

    def power(self, f: np.ndarray | float) -> np.ndarray | float:
        k = self.p_nominal_w - self.p_static_w
        return self.p_static_w + k * np.asarray(f, dtype=np.float64) ** 3


def stage_time(tc: np.ndarray | float, tm: np.ndarray | float, f: np.ndarray | float):
    """t(f) = t_c / f + t_m (f relative to f0)."""
    return np.asarray(tc) / np.asarray(f) + np.asarray(tm)


def step_energy_j(
    groups: Sequence[PipeGroup], tensor: int, step_s: float, power: PowerModel, idle_devices: int
) -> float:
    """Energy of one step: busy stages at P(f), idle time and idle devices at P_static."""
    e = 0.0
    for g in groups:
        f = np.ones(g.n_stages) if g.freq is None else np.asarray(g.freq)
        busy = g.micro * g.stage_times()
        e += g.count * tensor * float(
            np.sum(power.power(f) * busy + power.p_static_w * (step_s - busy))
        )
    return e + idle_devices * power.p_static_w * step_s


def balance(
    groups: Sequence[PipeGroup], tensor: int, power: PowerModel
) -> tuple[tuple[PipeGroup, ...], bool]:
    """Clocks for every stage of the working groups (see module docstring).

    Returns the groups with `freq` set and whether the policy beat the nominal clocks (when it
    does not, the groups come back unchanged with `freq=None`).
    """
    work = [i for i, g in enumerate(groups) if g.micro > 0 and g.count > 0]
    if not work:
        return tuple(groups), False
    tc = [np.asarray(groups[i].tc) for i in work]
    tm = [np.asarray(groups[i].tm) for i in work]
    m = np.array([groups[i].micro for i in work], dtype=np.float64)
    S = np.array([groups[i].n_stages for i in work], dtype=np.float64)
    cnt = np.array([groups[i].count for i in work], dtype=np.float64)
    devices = float(np.sum(cnt * S)) * tensor
    cap = power.cap_factor * devices * power.p_nominal_w
    nominal = max(dataclasses.replace(groups[i], freq=None).pipe_s() for i in work)

    def clocks(T: float):
        tau = T / (m + S - 1)
        out = []
        watts = 0.0
        for j in range(len(work)):
            room = tau[j] - tm[j]
            if np.any(room <= 0):
                return None
            f = np.maximum(tc[j] / room, power.f_min)
            if np.any(f > power.f_max * (1 + 1e-12)):
                return None
            f = np.minimum(f, power.f_max)
            watts += cnt[j] * tensor * float(np.sum(power.power(f)))
            out.append(f)
        return out if watts <= cap * (1 + 1e-12) else None

    lo = max(
        float(np.max(tc[j] / power.f_max + tm[j])) * (m[j] + S[j] - 1) for j in range(len(work))
    )
    hi = nominal * 2.0
    if clocks(hi) is None:
        return tuple(groups), False
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if clocks(mid) is None:
            lo = mid
        else:
            hi = mid
    fs = clocks(hi)
    new = list(groups)
    for j, i in enumerate(work):
        new[i] = dataclasses.replace(groups[i], freq=tuple(float(x) for x in fs[j]))
    if max(new[i].pipe_s() for i in work) < nominal * (1 - 1e-9):
        return tuple(new), True
    return tuple(groups), False


__all__ = ["PowerModel", "stage_time", "step_energy_j", "balance"]
