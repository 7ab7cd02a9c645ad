"""Recovery strategies: from a set of failed devices to the post-change steady state.

Every strategy is a function `(Scenario, failed device ids) -> Outcome` over the same cost
model (`cluster.step_time`), so the differences between them are only the modelled behaviours
below. What is modelled, and what is simplified, per strategy:

- **elaswave** (`planner.plan_heterogeneous`): broken pipelines keep their surviving stages
  and re-split layers by the minimax DP preferring fewest moved bytes (heterogeneous stage
  counts); micro-batches spread by greedy min-max, global batch unchanged; may drop slow
  broken pipelines or fall back to rerouting; DVFS on top. Recovery: detection, in-place
  communicator edit ([P] < 1 s), planning, the blocking copy of the lost stages' layers from
  data-parallel peers; the rebalancing copies run asynchronously and only the part not hidden
  under `async_overlap_steps` steps is exposed. Not modelled: RNG and snapshot costs (per-step
  snapshots are assumed overlapped), stage-memory "resize" of micro-batches.
- **recycle** (ReCycle-like): no repartition; lost stages' micro-batches rerouted to peers at
  the same stage, absorbed by bubbles with efficiency `recycle_bubble_fill` (1.0 = optimistic
  for ReCycle). Global batch unchanged. Not modelled: its MILP schedule, activation memory of
  peers, staggered-optimizer details. If a stage has no surviving peer it cannot continue and
  falls back to checkpoint-restart.
- **torchft** (TorchFT-like, DYNAMIC world size): every pipeline with a failed device is
  dropped; the survivors keep their micro-batches, so the global batch shrinks. Recovery:
  detection + a quorum / process-group reconfiguration ("partial rebuild"). With no replica
  left it falls back to checkpoint-restart.
- **oobleck** (Oobleck-like): pipeline templates for every stage count from the memory minimum
  `n0` to `S`; a broken pipeline re-instantiates the template for its survivors, borrows
  groups from the largest pipeline or merges with another short one when below `n0`; batch
  distribution by the same min-max spread. No DVFS; no preference for fewer moved bytes.
  Recovery is stop-the-world: a full communicator rebuild plus the whole copy.
- **elasjax_spmd** (this repository's rectangular re-plan): every pipeline must be identical
  (SPMD), so the survivors are regrouped into the best rectangular `data x stage x tensor`
  mesh (tensor degree may shrink); the global batch is kept by more micro-batches per replica
  with weight-0 padding slots that still cost compute. Recovery: plan + (standby hit or
  compile) + resharding every device's state when the mesh shape changes.
- **checkpoint_restart**: restart on the surviving complete pipelines (same stage and tensor
  degree, a resharding restore) with gradient accumulation to keep the global batch; loses the
  work since the last checkpoint (half of Young's interval in expectation) plus restart and
  load time.
"""

from __future__ import annotations

import dataclasses
import math
import types

import numpy as np

from ..models.costmodel import pipeline_step_cost
from .cluster import PipeGroup, assign, make_group, step_time
from .dvfs import step_energy_j
from .hetplan import broken_classes, plan_heterogeneous, reroute_step, reshape_class
from .scenario import Outcome, Scenario


def _failed(sc: Scenario, failed) -> np.ndarray:
    f = np.unique(np.asarray(list(failed), dtype=np.int64))
    if f.size and (f.min() < 0 or f.max() >= sc.layout.n_devices):
        raise ValueError(f"failed device ids must be in 0 .. {sc.layout.n_devices - 1}")
    return f


def _tokens(sc: Scenario, samples: int, step_s: float) -> float:
    return samples * sc.dims.seq_len / step_s if step_s > 0 and np.isfinite(step_s) else 0.0


def _describe(groups) -> str:
    parts = [f"{g.count}x[{g.n_stages} st, m={g.micro}]" for g in groups if g.count]
    return " + ".join(parts[:4] + ([f"... {len(parts) - 4} more"] if len(parts) > 4 else []))


def baseline_groups(sc: Scenario) -> tuple[PipeGroup, ...]:
    """The failure-free plan: every pipeline runs `microbatches` on the balanced partition."""
    g = make_group(sc.workload(), sc.partition(sc.layout.stage).sizes, sc.layout.data)
    return (dataclasses.replace(g, micro=sc.microbatches),)


def failure_free(sc: Scenario, name: str = "failure-free") -> Outcome:
    """The configured plan with nothing failed (nominal clocks)."""
    if sc.partition(sc.layout.stage) is None:
        raise ValueError(
            f"the failure-free plan does not fit device memory ({sc.device.mem_bytes:.3g} B) "
            f"with stage = {sc.layout.stage}; use more stages or tensor parallelism"
        )
    groups = baseline_groups(sc)
    st = step_time(groups, sc.workload())
    e = step_energy_j(groups, sc.layout.tensor, st.total_s, sc.power, 0)
    return Outcome(
        strategy=name, step_s=st.total_s, samples_per_step=sc.global_batch,
        global_batch=sc.global_batch, batch_preserved=True,
        tokens_per_s=_tokens(sc, sc.global_batch, st.total_s), recovery_s=0.0, lost_s=0.0,
        grow_s=0.0, moved_bytes=0.0, devices_used=sc.layout.n_devices,
        energy_j_per_token=e / sc.tokens_per_step, plan=_describe(groups),
    )


def _live(sc: Scenario, f: np.ndarray) -> int:
    return sc.layout.n_devices - int(f.size)


def elaswave(sc: Scenario, failed, *, dvfs: bool | None = None) -> Outcome:
    """ElasWave-style heterogeneous re-plan (see the module docstring)."""
    f = _failed(sc, failed)
    broken = sc.layout.broken(f)
    name = "elaswave" if (sc.dvfs if dvfs is None else dvfs) else "elaswave (no DVFS)"
    try:
        plan = plan_heterogeneous(sc, broken, dvfs=dvfs, live_devices=_live(sc, f))
    except ValueError:
        return dataclasses.replace(checkpoint_restart(sc, f), strategy=name,
                                   note="no pipeline left: fell back to checkpoint-restart")
    rc, bw = sc.recovery, sc.device.inter_host_bw
    step = plan.step.total_s
    exposed = max(0.0, plan.in_bytes_max / bw - rc.async_overlap_steps * step)
    recovery = rc.detect_s + rc.comm_edit_s + rc.plan_s + plan.blocking_bytes_max / bw + exposed
    if not broken.any():
        recovery = 0.0
    used = sum(g.count * g.n_stages for g in plan.groups if g.micro > 0) * sc.layout.tensor
    if plan.choice == "reroute":
        used = int((sc.layout.data - broken.sum(axis=0)).sum()) * sc.layout.tensor
    return Outcome(
        strategy=name, step_s=step, samples_per_step=sc.global_batch,
        global_batch=sc.global_batch, batch_preserved=True,
        tokens_per_s=_tokens(sc, sc.global_batch, step), recovery_s=recovery,
        lost_s=0.5 * step if broken.any() else 0.0, grow_s=rc.comm_edit_s + rc.plan_s,
        moved_bytes=plan.moved_bytes, devices_used=used,
        energy_j_per_token=plan.energy_j / sc.tokens_per_step,
        plan=f"{plan.choice}: " + (plan.describe() if plan.groups else "reroute to peers"),
        dvfs_used=plan.dvfs_used,
    )


def recycle(sc: Scenario, failed) -> Outcome:
    """ReCycle-like rerouting into peers' bubbles (see the module docstring)."""
    f = _failed(sc, failed)
    broken = sc.layout.broken(f)
    rr = reroute_step(sc, broken)
    if rr is None:
        return dataclasses.replace(checkpoint_restart(sc, f), strategy="recycle",
                                   note="a stage has no surviving peer: checkpoint-restart")
    step = rr.step.total_s
    p = sc.power
    live = _live(sc, f)
    e = (rr.busy_device_s * p.p_nominal_w + (rr.devices * step - rr.busy_device_s)
         * p.p_static_w + max(0, live - rr.devices) * step * p.p_static_w)
    rc = sc.recovery
    return Outcome(
        strategy="recycle", step_s=step, samples_per_step=sc.global_batch,
        global_batch=sc.global_batch, batch_preserved=True,
        tokens_per_s=_tokens(sc, sc.global_batch, step),
        recovery_s=(rc.detect_s + rc.partial_rebuild_s) if broken.any() else 0.0,
        lost_s=0.5 * step if broken.any() else 0.0, grow_s=rc.partial_rebuild_s,
        moved_bytes=0.0, devices_used=rr.devices, energy_j_per_token=e / sc.tokens_per_step,
        plan=f"reroute; extra micro-batches per peer by stage {list(rr.rerouted_per_peer)}",
    )


def torchft(sc: Scenario, failed) -> Outcome:
    """TorchFT-like: drop every replica with a failed device; the global batch shrinks."""
    f = _failed(sc, failed)
    broken = sc.layout.broken(f)
    left = int(sc.layout.data - broken.any(axis=1).sum())
    if left == 0:
        return dataclasses.replace(checkpoint_restart(sc, f), strategy="torchft",
                                   note="no replica left: fell back to checkpoint-restart")
    g = dataclasses.replace(baseline_groups(sc)[0], count=left)
    st = step_time([g], sc.workload())
    samples = left * sc.microbatches * sc.micro_batch
    used = left * sc.layout.stage * sc.layout.tensor
    e = step_energy_j([g], sc.layout.tensor, st.total_s, sc.power, _live(sc, f) - used)
    rc = sc.recovery
    return Outcome(
        strategy="torchft", step_s=st.total_s, samples_per_step=samples, global_batch=samples,
        batch_preserved=samples == sc.global_batch,
        tokens_per_s=_tokens(sc, samples, st.total_s),
        recovery_s=(rc.detect_s + rc.partial_rebuild_s) if broken.any() else 0.0,
        lost_s=0.5 * st.total_s if broken.any() else 0.0, grow_s=rc.partial_rebuild_s,
        moved_bytes=0.0, devices_used=used,
        energy_j_per_token=e / (samples * sc.dims.seq_len), plan=_describe([g]),
    )


def oobleck(sc: Scenario, failed) -> Outcome:
    """Oobleck-like pipeline templates (see the module docstring)."""
    f = _failed(sc, failed)
    broken = sc.layout.broken(f)
    S, T, D = sc.layout.stage, sc.layout.tensor, sc.layout.data
    w = sc.workload()
    n0 = next((n for n in range(1, S + 1) if sc.partition(n) is not None), S)
    healthy, classes = broken_classes(broken)
    sizes = [S] * healthy  # groups per pipeline after the failure
    shrunk = []  # (survivor count, lost) for pipelines that keep their own survivors
    for lost, n in classes:
        shrunk += [(S - len(lost), lost)] * n
    keep = [(k, lost) for k, lost in shrunk if k >= n0]
    short = sorted((k for k, _ in shrunk if 0 < k < n0), reverse=True)
    pool = sizes + [k for k, _ in keep]
    full_copy = 0  # pipelines re-instantiated from borrowed or merged groups
    leftover = []
    for k in short:  # borrow groups from the largest pipeline if it stays >= n0 ...
        need = n0 - k
        donor = int(np.argmax(pool)) if pool else -1
        if donor >= 0 and pool[donor] - need >= n0:
            pool[donor] -= need
            pool.append(n0)
            full_copy += 2  # the donor and the borrower are both re-instantiated
        else:
            leftover.append(k)
    acc = 0
    for k in leftover:  # ... else merge short pipelines until they reach n0
        acc += k
        if acc >= n0:
            pool.append(acc)
            full_copy += 1
            acc = 0
    if not pool:
        return dataclasses.replace(checkpoint_restart(sc, f), strategy="oobleck",
                                   note="no template fits the survivors: checkpoint-restart")
    counts: dict[int, int] = {}
    for p in pool:
        counts[p] = counts.get(p, 0) + 1
    groups = [make_group(w, sc.partition(n).sizes, c, label=f"template {n}")
              for n, c in sorted(counts.items(), reverse=True)]
    groups = assign(groups, sc.total_micro)
    st = step_time(groups, w)
    # bytes: a shrunk pipeline copies the layers whose stage changes under its template; a
    # borrowed or merged pipeline copies everything it holds (re-instantiation).
    mb = w.move_bytes(D)
    owner = np.repeat(np.arange(S), sc.partition(S).sizes)
    moved, in_max = 0.0, 0.0
    for k, lost in keep:
        sig = np.asarray([s for s in range(S) if s not in lost])
        new_owner = np.repeat(np.arange(k), sc.partition(k).sizes)
        got = np.where(sig[new_owner] == owner, 0.0, mb)
        moved += float(got.sum())
        in_max = max(in_max, float(np.bincount(new_owner, weights=got).max()))
    moved += full_copy * float(mb.sum())
    if full_copy:
        in_max = max(in_max, float(mb.sum()) / n0)
    rc, bw = sc.recovery, sc.device.inter_host_bw
    step = st.total_s
    used = sum(g.count * g.n_stages for g in groups if g.micro > 0) * T
    e = step_energy_j(groups, T, step, sc.power, _live(sc, f) - used)
    return Outcome(
        strategy="oobleck", step_s=step, samples_per_step=sc.global_batch,
        global_batch=sc.global_batch, batch_preserved=True,
        tokens_per_s=_tokens(sc, sc.global_batch, step),
        recovery_s=(rc.detect_s + rc.full_rebuild_s + in_max / T / bw) if broken.any() else 0.0,
        lost_s=0.5 * step if broken.any() else 0.0, grow_s=rc.full_rebuild_s,
        moved_bytes=moved, devices_used=used, energy_j_per_token=e / sc.tokens_per_step,
        plan=f"templates n0={n0}: " + _describe(groups),
    )


def _rect_step(sc: Scenario, stage: int, tensor: int, data: int):
    """(step, micro-batches per replica, stage times group) of a rectangular SPMD layout."""
    part = sc.partition(stage, tensor=tensor, data=data)
    if part is None:
        return None
    m = math.ceil(sc.total_micro / data)
    w = sc.workload(tensor)
    g = dataclasses.replace(make_group(w, part.sizes, data), micro=m)
    st = step_time([g], w)
    return st, m, g


def _tensor_options(sc: Scenario) -> list[int]:
    d = sc.dims
    return [t for t in range(1, sc.layout.tensor + 1)
            if sc.layout.tensor % t == 0 and d.n_heads % t == 0 and d.d_mlp % t == 0]


def elasjax_spmd(sc: Scenario, failed, *, full_search: bool | None = None) -> Outcome:
    """Rectangular re-plan over the survivors (see the module docstring)."""
    f = _failed(sc, failed)
    L = sc.layout
    if f.size == 0:  # growing back onto the full mesh: every device loads its shard
        w, part = sc.workload(), sc.partition(L.stage)
        ff = failure_free(sc, "elasjax_spmd")
        load = float(np.bincount(np.repeat(np.arange(L.stage), part.sizes),
                                 weights=w.state_bytes(L.data)).max()) / sc.device.inter_host_bw
        return dataclasses.replace(ff, grow_s=sc.recovery.plan_s + load)
    per_group = np.full(L.n_groups, L.tensor) - np.bincount(L.group_of(f), minlength=L.n_groups)
    full = L.n_devices <= 512 if full_search is None else full_search
    best = None
    for t in _tensor_options(sc):
        groups = int((per_group // t).sum())
        hi = min(sc.dims.n_layers + 2, groups)
        stages = range(1, hi + 1) if full else range(max(1, L.stage - 2), min(hi, L.stage + 2) + 1)
        for s in stages:
            d = groups // s
            if d < 1:
                continue
            r = sc.memo(("rect", s, t, d), lambda s=s, t=t, d=d: _rect_step(sc, s, t, d))
            if r is None:
                continue
            key = (r[0].total_s, -d * s * t)
            if best is None or key < best[0]:
                best = (key, s, t, d, r)
    if best is None:
        return dataclasses.replace(checkpoint_restart(sc, f), strategy="elasjax_spmd",
                                   note="no rectangular layout fits: checkpoint-restart")
    _, s, t, d, (st, m, g) = best
    w = sc.workload(t)
    used = d * s * t
    rc, bw = sc.recovery, sc.device.inter_host_bw
    if (s, t) == (L.stage, L.tensor):  # only the ZeRO shards are re-striped
        reshard = float(w.state_bytes(d).max()) * 12 / 16 / bw
    else:  # every device loads its new shard of params + optimizer state
        reshard = float(np.bincount(np.repeat(np.arange(s), g.sizes),
                                    weights=w.state_bytes(d)).max()) / bw
    recovery = rc.detect_s + rc.plan_s + (0.0 if rc.standby_hit else rc.compile_s) + reshard
    e = step_energy_j([g], t, st.total_s, sc.power, _live(sc, f) - used)
    pad = d * m - sc.total_micro
    return Outcome(
        strategy="elasjax_spmd", step_s=st.total_s, samples_per_step=sc.global_batch,
        global_batch=sc.global_batch, batch_preserved=True,
        tokens_per_s=_tokens(sc, sc.global_batch, st.total_s), recovery_s=recovery,
        lost_s=0.5 * st.total_s, grow_s=rc.plan_s + reshard, moved_bytes=float(
            w.state_bytes(d).sum() * t * d), devices_used=used,
        energy_j_per_token=e / sc.tokens_per_step,
        plan=f"data={d} stage={s} tensor={t}, m={m}, {pad} padding micro-batch slot(s)",
        samples_processed=sc.global_batch,
    )


def checkpoint_restart(sc: Scenario, failed) -> Outcome:
    """Restart from the last checkpoint on the complete surviving pipelines."""
    f = _failed(sc, failed)
    if f.size == 0:
        return failure_free(sc, "checkpoint_restart")
    L = sc.layout
    healthy_groups = int(L.n_groups - L.broken(f).sum())
    d = healthy_groups // L.stage
    rc = sc.recovery
    interval = sc.ckpt_interval_s()
    w = sc.workload()
    load = float(w.state_bytes(max(d, 1)).sum()) / L.stage / sc.device.storage_bw
    if d < 1 or sc.partition(L.stage, data=d) is None:
        return Outcome(
            strategy="checkpoint_restart", step_s=float("inf"), samples_per_step=0,
            global_batch=sc.global_batch, batch_preserved=True, tokens_per_s=0.0,
            recovery_s=rc.detect_s + rc.restart_s + load, lost_s=0.5 * interval,
            grow_s=rc.restart_s + load, moved_bytes=0.0, devices_used=0,
            energy_j_per_token=float("nan"), plan="no complete pipeline: down until repair",
            note="down",
        )
    m = math.ceil(sc.total_micro / d)
    g = dataclasses.replace(make_group(w, sc.partition(L.stage, data=d).sizes, d), micro=m)
    st = step_time([g], w)
    used = d * L.stage * L.tensor
    e = step_energy_j([g], L.tensor, st.total_s, sc.power, _live(sc, f) - used)
    return Outcome(
        strategy="checkpoint_restart", step_s=st.total_s, samples_per_step=sc.global_batch,
        global_batch=sc.global_batch, batch_preserved=True,
        tokens_per_s=_tokens(sc, sc.global_batch, st.total_s),
        recovery_s=rc.detect_s + rc.restart_s + load, lost_s=0.5 * interval,
        grow_s=rc.ckpt_save_s + rc.restart_s + load, moved_bytes=0.0, devices_used=used,
        energy_j_per_token=e / sc.tokens_per_step,
        plan=f"data={d} stage={L.stage} tensor={L.tensor}, m={m} (accumulation)",
    )


def elaswave_no_dvfs(sc: Scenario, failed) -> Outcome:
    return elaswave(sc, failed, dvfs=False)


STRATEGIES = types.MappingProxyType({
    "elaswave": elaswave,
    "elaswave_no_dvfs": elaswave_no_dvfs,
    "recycle": recycle,
    "torchft": torchft,
    "oobleck": oobleck,
    "elasjax_spmd": elasjax_spmd,
    "checkpoint_restart": checkpoint_restart,
})


def ideal_tokens_per_s(sc: Scenario, failed, *, dvfs: bool) -> float:
    """Upper bound: every live device busy on FLOP-counted work at the highest allowed clock
    (f_max with DVFS, f0 without), no bubbles, no communication, no memory-bound time."""
    f = _failed(sc, failed)
    live = sc.layout.n_devices - f.size
    clock = sc.power.f_max if dvfs else 1.0
    return live * sc.device.peak_flops * sc.device.mfu * clock / sc.dims.flops_per_token()


def reshape_for(sc: Scenario, lost: tuple[int, ...]):
    """The ElasWave re-split of a pipeline that lost `lost` stages (for inspection)."""
    return reshape_class(sc, lost, 1)


__all__ = [
    "STRATEGIES",
    "baseline_groups",
    "failure_free",
    "elaswave",
    "elaswave_no_dvfs",
    "recycle",
    "torchft",
    "oobleck",
    "elasjax_spmd",
    "checkpoint_restart",
    "ideal_tokens_per_s",
    "reshape_for",
    "pipeline_step_cost",
]
