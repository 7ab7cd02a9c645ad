"""Convergence under failures: elastic recovery vs the baselines, against fault-free runs.

    .venv/bin/python experiments/convergence.py [--steps 300 --fail 90:3 --fail-host 190:0]

The demo GPT (`configs/demo.yaml`: data 4 x tensor 2 on 8 fake CPU devices) trains on the
standard-library corpus for `--steps` steps; device 3 fails before step 90 and host 0 (devices
0, 1) before step 190 (single-process simulated device loss). Runs, all in one process sharing
compiled executables (`executables.ExecutableCache`):

  fault_free, elastic                   the reference and elastic recovery (per-sample RNG)
  det_fault_free, elastic_det           the same with `train.deterministic: true`
  torchft_like                          drop broken replicas, shrink the global batch
  per_device_fault_free, per_device     the `rng.mode: per_device` ablation and its reference
  checkpoint_restart                    Orbax checkpoint every `--ckpt-every` steps, restore in
                                        process onto the new mesh, redo the lost steps

Convergence deviation of a run against its reference (`elasjax.observe.compare`):

    dev = mean over post-failure steps s >= s_fail of |loss(s) - loss_ref(s)| / loss_ref(s)

(for a redone step the final value counts). Writes `convergence.md`, `convergence.json`,
`convergence_loss.png` and `convergence_deviation.png` under `--out`. Every number is measured
in this run. Targets (issue 5, benchmarks): elastic deviation <= 1% of torchft_like's;
deterministic: 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import typing
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch

from elasjax import config
from elasjax.loop import trainer  # noqa: E402
from elasjax.observe.compare import compare_runs  # noqa: E402
from elasjax.compilation.executables import ExecutableCache  # noqa: E402
from elasjax.observe.metrics import losses_by_step, read_jsonl  # noqa: E402

# name -> (overrides, reference run or None, with the failure schedule?)
RUNS = {
    "fault_free": ([], None, False),
    "elastic": ([], "fault_free", True),
    "det_fault_free": (["train.deterministic=true"], None, False),
    "elastic_det": (["train.deterministic=true"], "det_fault_free", True),
    "torchft_like": (["recovery.strategy=torchft_like"], "fault_free", True),
    "per_device_fault_free": (["rng.mode=per_device"], None, False),
    "per_device": (["rng.mode=per_device"], "per_device_fault_free", True),
    "checkpoint_restart": (["recovery.strategy=checkpoint_restart"], "fault_free", True),
}
LABELS = {
    "elastic": "elastic (ours)",
    "elastic_det": "elastic, deterministic",
    "torchft_like": "TorchFT-like",
    "per_device": "per-device RNG ablation",
    "checkpoint_restart": "checkpoint-restart",
}
STYLE = {
    "fault_free": ("k", "-", 2.2),
    "elastic": ("#1f77b4", "--", 1.2),
    "elastic_det": ("#17becf", ":", 1.2),
    "torchft_like": ("#d62728", "-", 1.0),
    "per_device": ("#ff7f0e", "-", 1.0),
    "checkpoint_restart": ("#2ca02c", "-.", 1.2),
}
MARK = {"elastic": "x", "checkpoint_restart": "+"}
TARGET_FRACTION = 0.01
FLOOR = 1e-9  # where exact zeros are drawn on the log-scale deviation plot


def parse_fault(text: str, kind: str) -> str:
    try:
        step, what = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--fail / --fail-host must look like STEP:ID, got {text!r}") from None
    return f"{{at_step: {step}, {kind}: [{what}]}}"


def require_values() -> None:
    hints = typing.get_type_hints(config.RecoveryConfig)
    allowed = typing.get_args(hints["strategy"])
    missing = [s for s in ("torchft_like", "checkpoint_restart") if s not in allowed]
    if missing:
        raise SystemExit(f"recovery.strategy {missing} not available in this elasjax version "
                         f"(allowed: {', '.join(allowed)})")
    config.load(None, ["train.deterministic=true"])  # raises a ConfigError if not available


def run_all(args, out: Path, faults: list[str]) -> dict[str, dict]:
    cache = ExecutableCache(max_entries=32)
    base = [f"train.steps={args.steps}", "train.eval_every=0"]
    done: dict[str, dict] = {}
    for name, (extra, _, faulted) in RUNS.items():
        over = base + extra + [f"faults=[{', '.join(faults)}]" if faulted else "faults=[]"]
        if name == "checkpoint_restart":
            ck = (out / "runs/ckpt_dir").absolute()
            shutil.rmtree(ck, ignore_errors=True)
            over += [f"checkpoint.dir={ck}", f"checkpoint.every={args.ckpt_every}"]
        cfg = config.load(args.config, over)
        d = out / "runs" / name
        shutil.rmtree(d, ignore_errors=True)
        t0 = time.perf_counter()
        s = trainer.run(cfg, d, exe_cache=cache)
        wall = time.perf_counter() - t0
        rows = read_jsonl(d / "metrics.jsonl")
        batches = list(dict.fromkeys(r["global_batch"] for r in rows))
        done[name] = {
            "dir": d, "wall_s": wall, "plans": list(dict.fromkeys(s.plans)),
            "checksums": s.checksums, "batches": batches,
            "recoveries": [(e.step, e.to_plan, e.rung, e.steps_lost) for e in s.recoveries],
        }
        rec = "; ".join(f"step {st}: -> {p} via {r}" + (f" (-{lost} steps)" if lost else "")
                        for st, p, r, lost in done[name]["recoveries"]) or "no failures"
        print(f"  {name:<22} {wall:6.1f} s  final loss {s.final_loss:.4f}  global batch "
              f"{' -> '.join(map(str, batches))}  {rec}")
    return done


def deviations(done: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for name, (_, ref, _) in RUNS.items():
        if ref is None:
            continue
        r = compare_runs(done[name]["dir"], done[ref]["dir"])
        a, b = losses_by_step(done[name]["dir"]), losses_by_step(done[ref]["dir"])
        out[name] = {
            "reference": ref,
            "first_failure": r.get("first_recovery_step"),
            "post": r.get("post_failure", r["all"]),
            "all": r["all"],
            "bitwise_losses": a == b,
            "bitwise_state": done[name]["checksums"] == done[ref]["checksums"],
            "batches_identical": r["batches_identical"],
        }
    return out


def table(dev: dict[str, dict], done: dict[str, dict]) -> str:
    tft = dev["torchft_like"]["post"]["mean_rel"]
    lines = [
        "| method | reference | post-failure steps | convergence deviation | max rel. dev. | "
        "% of TorchFT-like's | reduction vs TorchFT-like | losses bitwise equal | final state "
        "bitwise equal | global batch | run s |",
        "|---" * 11 + "|",
    ]
    for name, d in dev.items():
        m = d["post"]["mean_rel"]
        lines.append(
            f"| {LABELS[name]} | {d['reference']} | {d['post']['steps']} (>= {d['first_failure']}) "
            f"| {m:.3e} | {d['post']['max_rel']:.3e} | {_pct(m / tft)} | "
            f"{_pct(1 - m / tft)} | {'yes' if d['bitwise_losses'] else 'no'} | "
            f"{'yes' if d['bitwise_state'] else 'no'} | "
            f"{' -> '.join(map(str, done[name]['batches']))} | {done[name]['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def _pct(x: float) -> str:
    """A fraction as a percentage that keeps small differences visible (99.9997%, 0.0003%)."""
    p = 100 * x
    if p in (0.0, 100.0):
        return f"{p:g}%"
    return f"{p:.2g}%" if abs(p) < 1 else f"{p:.6g}%"


def plot(done: dict[str, dict], fail_steps: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = {n: losses_by_step(d["dir"]) for n, d in done.items()}
    fig, (ax, axz) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    last = max(loss["fault_free"])
    lo, hi = max(fail_steps[0] - 15, 0), min(fail_steps[-1] + 40, last)
    for name, (c, ls, lw) in STYLE.items():
        steps = sorted(loss[name])
        for a in (ax, axz):
            a.plot(steps, [loss[name][s] for s in steps], color=c, ls=ls, lw=lw,
                   label=LABELS.get(name, "fault-free (reference)"))
    axz.set_xlim(lo, hi)
    sel = [v for n in STYLE for s, v in loss[n].items() if lo <= s <= hi]
    axz.set_ylim(min(sel) - 0.05, max(sel) + 0.05)
    for a in (ax, axz):
        for f in fail_steps:
            a.axvline(f, color="grey", lw=0.8, ls=":")
        a.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("Loss, demo GPT on the stdlib corpus; dotted lines: failures", fontsize=10)
    axz.set_title(f"zoom: steps {lo} .. {hi}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "convergence_loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 5.6))
    for name, (_, ref, _) in RUNS.items():
        if ref is None:
            continue
        c, ls, lw = STYLE[name]
        steps = sorted(set(loss[name]) & set(loss[ref]))
        diff = [abs(loss[name][s] - loss[ref][s]) for s in steps]
        zeros = all(x == 0 for x in diff)
        label = f"{LABELS[name]} vs {ref}" + (" (all exactly 0, drawn at floor)" if zeros else "")
        ys = [max(x, FLOOR) for x in diff]
        if 0 < max(diff) < 1e-5:  # rounding-level differences: points read better than lines
            ax.plot(steps, ys, color=c, ls="none", marker=MARK[name], ms=4, label=label)
        else:
            ax.plot(steps, ys, color=c, ls=ls, lw=max(lw, 1.0), label=label)
    for f in fail_steps:
        ax.axvline(f, color="grey", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_ylim(FLOOR / 3, None)
    ax.set_xlabel("step")
    ax.set_ylabel(f"|loss - reference loss|  (< {FLOOR:.0e} drawn at {FLOOR:.0e})")
    ax.set_title("Deviation from the fault-free reference (single-process simulated device "
                 "loss); dotted lines: failures", fontsize=10)
    ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    fig.tight_layout()
    fig.savefig(out / "convergence_deviation.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fail", default="90:3", help="STEP:DEVICE of the device failure")
    ap.add_argument("--fail-host", default="190:0", help="STEP:HOST of the host failure")
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--out", default="results/convergence")
    args = ap.parse_args()
    require_values()
    dev_step, host_step = (int(x.split(":")[0]) for x in (args.fail, args.fail_host))
    faults = [parse_fault(args.fail, "devices"), parse_fault(args.fail_host, "hosts")]
    faults = faults if dev_step <= host_step else faults[::-1]  # the config wants them in order
    fail_steps = sorted((dev_step, host_step))
    base = config.load(args.config, [f"train.steps={args.steps}", f"faults=[{', '.join(faults)}]"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    settings = (
        f"{args.config}, {args.steps} steps, global batch {base.train.global_batch}, "
        f"{base.data.source} corpus, dropout {base.model.dropout}; device "
        f"{args.fail.split(':')[1]} fails before step {dev_step}, host "
        f"{args.fail_host.split(':')[1]} before step {host_step} (single-process simulated "
        f"device loss); checkpoint-restart saves every {args.ckpt_every} steps; jax "
        f"{jax.__version__}, {len(jax.devices())} fake CPU devices on {os.cpu_count()} cores"
    )
    print(f"# convergence: {settings}")
    done = run_all(args, out, faults)
    dev = deviations(done)
    tft = dev["torchft_like"]["post"]["mean_rel"]
    el, det = dev["elastic"]["post"]["mean_rel"], dev["elastic_det"]["post"]["mean_rel"]
    ok1, ok2 = el <= TARGET_FRACTION * tft, det == 0.0
    report = "\n".join([
        "# Convergence deviation under failures", "", settings, "",
        "convergence deviation = mean over post-failure steps s (s >= first failure) of "
        "|loss(s) - loss_ref(s)| / loss_ref(s); reduction vs TorchFT-like = 1 - dev / "
        "dev(TorchFT-like)", "",
        table(dev, done), "",
        f"- elastic deviation = {_pct(el / tft)} of TorchFT-like's "
        f"(target <= {100 * TARGET_FRACTION:.0f}%: {'met' if ok1 else 'MISSED'})",
        f"- deterministic deviation = {det!r}; losses bitwise equal at every step: "
        f"{'yes' if dev['elastic_det']['bitwise_losses'] else 'NO'}; final state bitwise equal: "
        f"{'yes' if dev['elastic_det']['bitwise_state'] else 'NO'} "
        f"(target 0: {'met' if ok2 else 'MISSED'})",
        f"- script runtime {time.perf_counter() - t0:.0f} s",
    ])
    (out / "convergence.md").write_text(report + "\n")
    (out / "convergence.json").write_text(json.dumps(
        {"settings": settings, "runs": done, "deviation": dev}, indent=1, default=str))
    plot(done, fail_steps, out)
    print("\n" + report)
    print(f"\nwrote {out}/convergence.md, convergence.json, convergence_loss.png, "
          "convergence_deviation.png")


if __name__ == "__main__":
    main()
