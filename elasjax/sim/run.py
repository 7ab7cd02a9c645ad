"""`elasjax sim CONFIG`: run the simulator's studies and print *simulated* tables.

Two studies, both over the same strategies and cost model:

- **post_change**: at `layout.devices`, for k in `post_change.failures`, draw `draws` random
  sets of k failed devices (seeded; the same sets for every strategy) and report each
  strategy's steady throughput after the change, its ratio to the failure-free plan, the
  batch it trains with and its recovery time; ratios of ElasWave-style against ReCycle-like and
  TorchFT-like are ratios of the mean throughputs. A DVFS table gives throughput and energy
  with and without the frequency policy; a sensitivity table varies ReCycle's bubble fill.
- **trace**: at every device count in `trace.scales`, replay one seeded MTBF trace per strategy
  and report goodput over time, plus the planner's latency at that scale.
- **growth**: at the same scales, each of `growth.strategies` under three policies for the
  devices that come back (`elasjax.sim.spares`): shrink only, rejoin after repair, hot spares;
  goodput per active and per total (spares included) device.

Every title says *simulated*: these are model outputs, not measurements.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import settings as simconfig
from .hetplan import plan_heterogeneous
from .scenario import Scenario
from .spares import simulate_policy, spare_hosts_for, swap_seconds
from .strategies import STRATEGIES, failure_free
from .timeline import simulate
from .traces import TraceParams, make_trace

SIM = "(simulated)"


def md_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table with a bold title line."""

    def cell(v: object) -> str:
        if isinstance(v, float):
            if not np.isfinite(v):
                return "n/a"
            if v == int(v) and abs(v) < 1e6:
                return str(int(v))
            return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}"
        return str(v)

    lines = [f"**{title}**", "", "| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def describe_setting(sc: Scenario) -> str:
    d, L, dev = sc.dims, sc.layout, sc.device
    return (
        f"{L.n_devices} x {dev.name} (stated parameters: {dev.peak_flops / 1e12:.0f} TFLOP/s "
        f"peak, MFU {dev.mfu:.2f}, {dev.mem_bytes / 1e9:.0f} GB, intra-host "
        f"{dev.intra_host_bw / 1e9:.0f} GB/s, inter-host {dev.inter_host_bw / 1e9:.0f} GB/s, "
        f"{dev.power_w:.0f} W); GPT-like L={d.n_layers} d={d.d_model} heads={d.n_heads} "
        f"mlp={d.d_mlp} vocab={d.vocab_size} seq={d.seq_len} ({d.n_params / 1e9:.1f}B params); "
        f"DP {L.data} x PP {L.stage} x TP {L.tensor}; {sc.microbatches} micro-batches of "
        f"{sc.micro_batch} per pipeline (global batch {sc.global_batch})"
    )


def failure_draws(sc: Scenario, k: int, draws: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, k])
    return [np.sort(rng.choice(sc.layout.n_devices, k, replace=False)) for _ in range(draws)]


def post_change_study(cfg: simconfig.SimConfig, sc: Scenario | None = None) -> dict:
    """Mean post-change throughput per strategy and failure count (see module docstring)."""
    sc = sc or simconfig.scenario(cfg)
    ff = failure_free(sc)
    ff_dvfs = STRATEGIES["elaswave"](sc, [])
    out = {"setting": describe_setting(sc), "failure_free": dataclasses.asdict(ff),
           "failure_free_dvfs": dataclasses.asdict(ff_dvfs), "by_failures": {}}
    for k in cfg.post_change.failures:
        sets = failure_draws(sc, k, cfg.post_change.draws, cfg.post_change.seed)
        rows = {}
        for name in cfg.strategies:
            outs = [STRATEGIES[name](sc, s) for s in sets]
            cost = getattr(cfg.step_cost, name)  # the strategy's fault-free step tax
            rows[name] = {
                "tokens_per_s": float(np.mean([o.tokens_per_s for o in outs])) / cost,
                "fraction": float(np.mean([o.tokens_per_s for o in outs]) / ff.tokens_per_s)
                / cost,
                "step_cost": cost,
                "step_s": float(np.mean([o.step_s for o in outs])),
                "global_batch": float(np.mean([o.global_batch for o in outs])),
                "batch_preserved": all(o.batch_preserved for o in outs),
                "recovery_s": float(np.mean([o.recovery_s for o in outs])),
                "lost_s": float(np.mean([o.lost_s for o in outs])),
                "energy_j_per_token": float(np.mean([o.energy_j_per_token for o in outs])),
                "dvfs_used": int(sum(o.dvfs_used for o in outs)),
                "fallbacks": int(sum(bool(o.note) for o in outs)),
                "example_plan": outs[0].plan,
            }
        out["by_failures"][k] = rows
    return out


def recycle_sensitivity(cfg: simconfig.SimConfig, fills: Sequence[float] = (1.0, 0.5, 0.0)
                        ) -> dict:
    """ElasWave-style / ReCycle-like throughput ratio as ReCycle's bubble fill varies."""
    out = {}
    for fill in fills:
        sc = dataclasses.replace(simconfig.scenario(cfg), recycle_bubble_fill=fill)
        row = {}
        for k in cfg.post_change.failures:
            sets = failure_draws(sc, k, cfg.post_change.draws, cfg.post_change.seed)
            ew = np.mean([STRATEGIES["elaswave"](sc, s).tokens_per_s for s in sets])
            rc = np.mean([STRATEGIES["recycle"](sc, s).tokens_per_s for s in sets])
            row[k] = float(ew / rc) if rc > 0 else float("inf")
        out[fill] = row
    return out


def planner_latency(sc: Scenario, fraction: float = 1e-3, seed: int = 0, reps: int = 3) -> dict:
    """Median wall time of `plan_heterogeneous` with `fraction` of the devices failed."""
    rng = np.random.default_rng(seed)
    k = max(1, int(round(fraction * sc.layout.n_devices)))
    times, plan = [], None
    for _ in range(reps):
        failed = rng.choice(sc.layout.n_devices, k, replace=False)
        broken = sc.layout.broken(failed)
        t0 = time.perf_counter()
        plan = plan_heterogeneous(sc, broken)
        times.append(time.perf_counter() - t0)
    return {"devices": sc.layout.n_devices, "failed": k, "median_s": float(np.median(times)),
            "max_s": float(np.max(times)), "choice": plan.choice,
            "candidates": plan.evaluated}


def trace_study(cfg: simconfig.SimConfig) -> dict:
    """Goodput over time at every scale of `trace.scales` (see module docstring)."""
    out = {}
    tc = cfg.trace
    for n in tc.scales:
        sc = simconfig.scenario(cfg, n)
        trace = make_trace(TraceParams(
            n_devices=sc.layout.n_devices, devices_per_host=sc.layout.devices_per_host,
            hours=tc.hours, mtbf_hours=tc.mtbf_hours, host_fraction=tc.host_fraction,
            repair_hours=tc.repair_hours, seed=tc.seed,
        ))
        ref = failure_free(sc).tokens_per_s
        lines = {}
        for name in cfg.strategies:
            tl = simulate(sc, name, STRATEGIES[name], trace, tc.hours, tc.bin_hours, ref,
                          getattr(cfg.step_cost, name))
            lines[name] = dataclasses.asdict(tl)
        out[n] = {
            "devices": sc.layout.n_devices,
            "setting": describe_setting(sc),
            "failures": sum(e.kind == "fail" for e in trace),
            "failed_devices": sum(len(e.devices) for e in trace if e.kind == "fail"),
            "host_failures": sum(e.host_level for e in trace if e.kind == "fail"),
            "ckpt_interval_s": sc.ckpt_interval_s(),
            "timelines": lines,
            "planner": planner_latency(sc, seed=tc.seed),
        }
    return out


def growth_study(cfg: simconfig.SimConfig) -> dict:
    """Shrink only / rejoin / hot spares at every scale of `trace.scales` (module docstring).
    The trace covers the job's hosts and the spare hosts, and every policy replays it."""
    out = {}
    tc, gc = cfg.trace, cfg.growth
    for n in tc.scales:
        sc = simconfig.scenario(cfg, n)
        k = spare_hosts_for(sc, gc.spare_fraction)
        dph = sc.layout.devices_per_host
        trace = make_trace(TraceParams(
            n_devices=sc.layout.n_devices + k * dph, devices_per_host=dph, hours=tc.hours,
            mtbf_hours=tc.mtbf_hours, host_fraction=tc.host_fraction,
            repair_hours=tc.repair_hours, seed=tc.seed,
        ))
        swap = swap_seconds(sc) if gc.swap_s is None else gc.swap_s
        ref = failure_free(sc).tokens_per_s
        lines = {}
        for strat in gc.strategies:
            for pol in gc.policies:
                tl = simulate_policy(sc, pol, trace, tc.hours, tc.bin_hours, ref,
                                     spare_hosts=k if pol == "spares" else 0, swap_s=swap,
                                     strategy=strat, step_cost=getattr(cfg.step_cost, strat))
                lines[f"{strat} {pol}"] = dataclasses.asdict(tl)
        job = [e for e in trace if e.kind == "fail" and min(e.devices) < sc.layout.n_devices]
        out[n] = {
            "devices": sc.layout.n_devices, "spare_hosts": k, "spare_devices": k * dph,
            "swap_s": swap,
            "grow_s": {s: STRATEGIES[s](sc, []).grow_s for s in gc.strategies},
            "job_failures": len(job),
            "spare_failures": sum(e.kind == "fail" for e in trace) - len(job),
            "timelines": lines,
        }
    return out


def growth_tables(res: dict, cfg: simconfig.SimConfig) -> str:
    tc, gc = cfg.trace, cfg.growth
    rows = []
    for r in res.values():
        for tl in r["timelines"].values():
            rows.append([
                r["devices"], tl["strategy"], tl["policy"], tl["spare_hosts"], tl["total_devices"], tl["mean_goodput"],
                tl["goodput_per_total_device"], tl["mean_filled"], tl["downtime_s"] / 60,
                tl["lost_work_s"] / 60, tl["swaps"], tl["fallbacks"],
            ])
    title = (
        f"Growing back: shrink only / rejoin / hot spares over {tc.hours:g} h "
        f"{SIM} (goodput = surviving tokens / failure-free tokens; per active device: over the "
        "job's devices; per total device: over the job's + the idle spares')"
    )
    text = [md_table(title, [
        "devices", "strategy", "policy", "spare hosts", "total devices", "goodput / active device",
        "goodput / total device", "plan size (time avg)", "downtime min", "lost work min",
        "swaps", "pool empty"], rows)]
    notes = "; ".join(
        f"{r['devices']} devices: {r['job_failures']} failures of the job's devices, "
        f"{r['spare_failures']} of idle spares, swap {r['swap_s']:.0f} s, grow "
        + ", ".join(f"{v:.1f} s ({k})" for k, v in r["grow_s"].items()) for r in res.values())
    text.append(
        f"Parameters {SIM}: per-device MTBF {tc.mtbf_hours:.0f} h, host-level share "
        f"{tc.host_fraction:g}, repair {tc.repair_hours:g} h (elasjax/sim/traces.py), spares = "
        f"{gc.spare_fraction:.0%} of the job's hosts rounded up; {notes}. Shrink only never "
        "takes a repaired device back; rejoin grows back after the repair; spares keep the "
        "plan's size while the pool lasts and cost their idle devices in the per-total column.\n")
    return "\n".join(text)


def plot_growth(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(res), 1, figsize=(9, 2.6 * len(res)), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], res.values()):
        for pol, tl in r["timelines"].items():  # "strategy policy"
            e = np.asarray(tl["bin_edges_h"])
            g = list(tl["goodput"])
            ax.step(e, g + g[-1:], where="post", lw=1.2,
                    label=f"{pol} (per total device {tl['goodput_per_total_device']:.4f})")
        ax.set_title(f"SIMULATED growing back, {r['devices']} devices + {r['spare_devices']} "
                     f"spare, {r['job_failures']} job failures", fontsize=10)
        ax.set_ylabel("goodput / failure-free")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    axes[-1, 0].set_xlabel("hours")
    fig.suptitle("Simulated: shrink only vs rejoin vs hot spares (per active device)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def post_change_tables(res: dict, strategies: Sequence[str]) -> str:
    text = [f"Setting {SIM}: {res['setting']}.", ""]
    ff = res["failure_free"]
    text.append(f"Failure-free {SIM}: {ff['tokens_per_s']:.4g} tokens/s, step "
                f"{ff['step_s']:.3f} s, plan {ff['plan']}.\n")
    for k, rows in res["by_failures"].items():
        body = []
        for name in strategies:
            r = rows[name]
            body.append([
                name, r["tokens_per_s"], r["fraction"], r["step_s"], r["global_batch"],
                r["recovery_s"], f"{r['fallbacks']}", r["example_plan"][:70],
            ])
        text.append(md_table(
            f"Post-change throughput after {k} failed device(s) {SIM}, mean of the draws",
            ["strategy", "tokens/s", "x failure-free", "step s", "global batch",
             "recovery s", "fallbacks", "example plan"], body))
    ratio_rows = []
    for k, rows in res["by_failures"].items():
        ew = rows.get("elaswave", {}).get("tokens_per_s")
        r = [k]
        for base in ("recycle", "torchft", "oobleck", "elasjax_spmd", "checkpoint_restart"):
            b = rows.get(base, {}).get("tokens_per_s")
            r.append(ew / b if ew and b else float("nan"))
        ratio_rows.append(r)
    text.append(md_table(
        f"ElasWave-style throughput ratio vs each baseline {SIM}",
        ["failures", "vs ReCycle-like", "vs TorchFT-like", "vs Oobleck-like", "vs elasjax SPMD",
         "vs ckpt-restart"], ratio_rows))
    return "\n".join(text)


def dvfs_table(res: dict) -> str:
    ff, ffd = res["failure_free"], res["failure_free_dvfs"]
    rows = [["failure-free", ff["tokens_per_s"], ffd["tokens_per_s"],
             ffd["tokens_per_s"] / ff["tokens_per_s"], ff["energy_j_per_token"],
             ffd["energy_j_per_token"]]]
    for k, r in res["by_failures"].items():
        if "elaswave" in r and "elaswave_no_dvfs" in r:
            a, b = r["elaswave_no_dvfs"], r["elaswave"]
            rows.append([f"{k} failed", a["tokens_per_s"], b["tokens_per_s"],
                         b["tokens_per_s"] / a["tokens_per_s"], a["energy_j_per_token"],
                         b["energy_j_per_token"]])
    return md_table(
        f"DVFS: ElasWave-style throughput and energy without / with the frequency policy {SIM}",
        ["case", "tokens/s no DVFS", "tokens/s DVFS", "speedup", "J/token no DVFS",
         "J/token DVFS"], rows)


def sensitivity_table(sens: dict, failures: Sequence[int]) -> str:
    rows = [[fill] + [sens[fill][k] for k in failures] for fill in sens]
    return md_table(
        f"ElasWave-style / ReCycle-like throughput vs ReCycle's bubble fill {SIM}",
        ["bubble fill"] + [f"{k} failed" for k in failures], rows)


def trace_tables(res: dict, strategies: Sequence[str], hours: float) -> str:
    text = []
    rows = []
    for n, r in res.items():
        for name in strategies:
            tl = r["timelines"][name]
            rows.append([n, name, tl["mean_goodput"], tl["downtime_s"] / 60, tl["lost_work_s"]
                         / 60, tl["transitions"]])
    text.append(md_table(
        f"Goodput over {hours:g} h under an MTBF trace {SIM} (fraction of the failure-free "
        "tokens/s at nominal clocks; DVFS can exceed 1)",
        ["devices", "strategy", "mean goodput", "downtime min", "lost work min", "transitions"],
        rows))
    rows = [[r["devices"], r["failures"], r["failed_devices"], r["host_failures"],
             r["ckpt_interval_s"] / 60, r["planner"]["median_s"] * 1e3, r["planner"]["failed"],
             r["planner"]["choice"]] for r in res.values()]
    text.append(md_table(
        "Trace and planner latency (planner latency is measured wall time of the pure-Python "
        "planner on this machine; everything else simulated)",
        ["devices", "failure events", "failed devices", "host-level", "ckpt interval min",
         "planner ms", "planner: failed devices", "planner choice"], rows))
    return "\n".join(text)


def plot_goodput(res: dict, strategies: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(res), 1, figsize=(9, 2.8 * len(res)), sharex=True,
                             squeeze=False)
    for ax, (n, r) in zip(axes[:, 0], res.items()):
        for name in strategies:
            tl = r["timelines"][name]
            e = np.asarray(tl["bin_edges_h"])
            g = list(tl["goodput"])
            ax.step(e, g + g[-1:], where="post", label=name, lw=1.2)
        ax.set_title(f"SIMULATED goodput, {r['devices']} devices, {r['failures']} failure "
                     f"events", fontsize=10)
        ax.set_ylabel("goodput / failure-free")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("hours")
    axes[0, 0].legend(fontsize=7, ncol=4, loc="lower left")
    fig.suptitle("Simulated: goodput over time under a per-device MTBF trace (1.0 = failure-free"
                 " at nominal clocks; DVFS can exceed it)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_post_change(res: dict, strategies: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(res["by_failures"])
    fig, ax = plt.subplots(figsize=(10, 4.0))
    width = 0.8 / len(strategies)
    for i, name in enumerate(strategies):
        vals = [res["by_failures"][k][name]["fraction"] for k in ks]
        ax.bar(np.arange(len(ks)) + i * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(ks)) + 0.4 - width / 2, [f"{k} failed" for k in ks])
    ax.set_ylabel("throughput / failure-free")
    ax.set_title("SIMULATED post-change throughput, " + res["setting"][:60] + "...",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=len(strategies), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: simconfig.SimConfig, out: str | Path | None = None, *, plots: bool = True) -> dict:
    """Run the studies of `cfg`, print their tables, and write tables/JSON/plots to `out`."""
    results: dict = {}
    text = [f"# elasjax sim {SIM}", "",
            "All numbers below are SIMULATED by elasjax.sim from stated hardware parameters "
            "(see elasjax/sim/hardware.py); none is a measurement.", ""]
    strategies = list(cfg.strategies)
    if "post_change" in cfg.run:
        pc = post_change_study(cfg)
        results["post_change"] = pc
        text.append(post_change_tables(pc, strategies))
        if "elaswave" in strategies and "elaswave_no_dvfs" in strategies:
            text.append(dvfs_table(pc))
        if "elaswave" in strategies and "recycle" in strategies:
            sens = recycle_sensitivity(cfg)
            results["recycle_sensitivity"] = sens
            text.append(sensitivity_table(sens, cfg.post_change.failures))
    if "trace" in cfg.run and cfg.trace.scales:
        tr = trace_study(cfg)
        results["trace"] = tr
        text.append(trace_tables(tr, strategies, cfg.trace.hours))
    if "growth" in cfg.run:
        gr = growth_study(cfg)
        results["growth"] = gr
        text.append(growth_tables(gr, cfg))
    report = "\n".join(text)
    print(report)
    if out is not None:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "tables.md").write_text(report)
        (d / "config.yaml").write_text(simconfig.dump(cfg))
        (d / "results.json").write_text(json.dumps(results, indent=1, default=str))
        if plots:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                plots = False
                print("plots skipped: matplotlib is not installed (pip install 'elasjax[experiments]')")
        if plots and "post_change" in results:
            plot_post_change(results["post_change"], strategies, d / "post_change.png")
        if plots and "trace" in results:
            plot_goodput(results["trace"], strategies, d / "goodput.png")
        if plots and "growth" in results:
            plot_growth(results["growth"], d / "growth.png")
        print(f"wrote {d}/tables.md, results.json, config.yaml" + (" and plots" if plots else ""))
    return results


def main(config_path: str, overrides: Sequence[str] = (), out: str | None = None) -> int:
    """Entry point of `elasjax sim CONFIG [--set k=v ...] [--out DIR]`."""
    cfg = simconfig.load(config_path, overrides)
    run(cfg, out)
    return 0


__all__ = [
    "md_table",
    "describe_setting",
    "post_change_study",
    "recycle_sensitivity",
    "planner_latency",
    "trace_study",
    "growth_study",
    "run",
    "main",
]
