"""Loss deviation between two runs (a run and its reference, e.g. the fault-free run)."""

from __future__ import annotations

from pathlib import Path

from .metrics import deviation, losses_by_step, read_jsonl


def _first_recovery(run_dir: Path) -> int | None:
    p = run_dir / "events.jsonl"
    if not p.exists():
        return None
    steps = [e["step"] for e in read_jsonl(p) if e.get("type") == "recovery"]
    return min(steps) if steps else None


def _digests(run_dir: Path, key: str = "batch_digest") -> dict[int, str]:
    out = {}
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        if key in r:
            out[int(r["step"])] = r[key]
    return out


class RunsDifferError(ValueError):
    """Two runs that did not log the same steps (`compare_runs` without `common_steps`)."""


def _span(steps) -> str:
    steps = sorted(steps)
    if not steps:
        return "no step"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}..{steps[-1]}"
    return f"{len(steps)} steps ({steps[0]}..{steps[-1]}, with gaps)"


def compare_runs(run: str | Path, reference: str | Path, common_steps: bool = False) -> dict:
    """The deviation of `run`'s losses from `reference`'s, step by step. Runs that logged
    different steps raise `RunsDifferError` naming both spans, unless `common_steps` (then the
    steps both logged are compared, and the final states only where both ended at one step)."""
    run, reference = Path(run), Path(reference)
    for d in (run, reference):
        if not (d / "metrics.jsonl").exists():
            raise FileNotFoundError(f"{d}/metrics.jsonl not found: is {d} an elasjax output directory?")
    a, ref = losses_by_step(run), losses_by_step(reference)
    if set(a) != set(ref):
        if not common_steps:
            raise RunsDifferError(
                f"compare: {run} logged {_span(a)} and {reference} logged {_span(ref)}; allowed: "
                "two runs of the same steps (or --common-steps to compare the steps both logged)")
        keep = set(a) & set(ref)
        a = {s: v for s, v in a.items() if s in keep}
        ref = {s: v for s, v in ref.items() if s in keep}
    out = {"run": str(run), "reference": str(reference), "all": deviation(a, ref)}
    first = _first_recovery(run)
    if first is not None:
        out["first_recovery_step"] = first
        out["post_failure"] = deviation(a, ref, steps=[s for s in a if s >= first])
    ea, eref = losses_by_step(run, "eval_loss"), losses_by_step(reference, "eval_loss")
    if ea and eref:
        out["eval"] = deviation(ea, eref)
    ends = [
        [e for e in read_jsonl(d / "events.jsonl") if e.get("type") == "end"] if (d / "events.jsonl").exists() else []
        for d in (run, reference)
    ]
    if (all(ends) and all("state_digest" in e[-1] for e in ends)
            and ends[0][-1].get("step") == ends[1][-1].get("step")):
        out["final_state_identical"] = ends[0][-1]["state_digest"] == ends[1][-1]["state_digest"]
    da, dref = _digests(run), _digests(reference)
    common = set(da) & set(dref)
    out["batches_identical"] = bool(common) and all(da[s] == dref[s] for s in common)
    # the first step after which the states differ (each step's state digest), None: none
    sa, sref = _digests(run, "state_digest"), _digests(reference, "state_digest")
    both = sorted(set(sa) & set(sref))
    if both:
        out["first_state_difference"] = next((s for s in both if sa[s] != sref[s]), None)
    out["steps_only_in_one"] = sorted(set(losses_by_step(run)) ^ set(losses_by_step(reference)))
    return out


def format_report(r: dict) -> str:
    lines = [f"run       {r['run']}", f"reference {r['reference']}"]

    def row(name, d):
        return (
            f"{name:<34} steps {d['steps']:>5}   max rel dev {d['max_rel']:.3e}   "
            f"mean rel dev {d['mean_rel']:.3e}"
        )

    lines.append(row("train loss, all steps", r["all"]))
    if "post_failure" in r:
        lines.append(row(f"train loss, steps >= {r['first_recovery_step']} (post-failure)", r["post_failure"]))
        lines.append(
            "  convergence deviation = mean over post-failure steps of |loss - loss_ref| / loss_ref"
            f" = {r['post_failure']['mean_rel']:.3e}"
        )
    if "eval" in r:
        lines.append(row("held-out loss", r["eval"]))
    lines.append(f"identical sample ids per step: {'yes' if r['batches_identical'] else 'NO'}")
    if "final_state_identical" in r:
        lines.append(
            "final parameters and optimizer state bitwise identical (checksums): "
            + ("yes" if r["final_state_identical"] else "no")
        )
    if "first_state_difference" in r:
        s = r["first_state_difference"]
        lines.append("state after every step bitwise identical (checksums): "
                     + ("yes" if s is None else f"no, first at step {s}"))
    if r["steps_only_in_one"]:
        lines.append(f"steps logged in only one run (not compared): {r['steps_only_in_one'][:10]}"
                     + (" ..." if len(r["steps_only_in_one"]) > 10 else ""))
    return "\n".join(lines)
