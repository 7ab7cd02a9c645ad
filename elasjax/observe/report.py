"""What a run prints: the progress bar, one line per recovery and cut-over, the summary tables.

Every printed MTTR says how the failure happened and was detected (`failure_simulation`), and a
standby hit is printed only when the executable was ready at detection.
"""

from __future__ import annotations

from ..plan.planner import Plan


def verified_text(verified: bool, verify: dict | None) -> str:
    """What a move's verification compared (its event's `verify`), in a few words: "verified
    57 leaves (5.55 MB)" where the checksums were equal."""
    if not verify:
        return "verified" if verified else "NOT verified"
    if not verified:
        return (f"NOT verified: {verify['leaves']} leaves, digest {verify['digest_after']} "
                f"!= {verify['digest_before']}")
    return f"verified {verify['leaves']} leaves ({verify['bytes'] / 1e6:.2f} MB)"


def recovery_line(ev) -> str:
    fast = (
        f" (fast path; optimal {ev.optimal_plan} compiling in the background)"
        if ev.migration == "async"
        else ""
    )
    retried = f" after {ev.attempts} attempts" if ev.attempts > 1 else ""
    spare = (
        f" (spare host(s) {ev.spare_took_over} took over; {ev.from_n_devices} -> "
        f"{ev.to_n_devices} devices)" if ev.spare_took_over else ""
    )
    return (
        f"step {ev.step}: {ev.fault} failed -> {ev.from_plan} => {ev.to_plan}{spare}{fast} via "
        f"{ev.rung}"
        f"{retried}; {ev.bytes_moved / 1e6:.2f} MB in {ev.transfers} transfers"
        f"{' (planned ahead)' if ev.transfer_plan_hit else ''}; MTTR {ev.mttr_s:.2f}s "
        f"(detect {ev.detect_s:.2f}s, compile {ev.compile_s:.2f}s"
        f"{', standby hit' if ev.standby_hit else ''}); {verified_text(ev.verified, ev.verify)}"
    )


def join_line(ev: dict) -> str:
    then = (f"growing to {ev['best_plan']} (predicted {ev['predicted_gain']:.0%} faster), "
            "once it is compiled on every process" if ev["grow"] else f"staying on {ev['plan']}: "
            f"{ev['reason']}")
    moved, v = "", ev.get("verify")
    if v:  # an admission: the state moved onto the new client first
        ok = v["leaves"] > 0 and v["digest_before"] == v["digest_after"]
        moved = f"; the state on the new client {verified_text(ok, v)}"
    return f"step {ev['step']}: {ev['spec']} -> devices {ev['devices']} returned; {then}{moved}"


def migration_line(mig: dict) -> str:
    if mig["type"] == "growth":
        return (
            f"step {mig['step']}: grew {mig['from_plan']} => {mig['to_plan']} "
            f"({mig['from_n_devices']} -> {mig['n_devices']} devices) after "
            f"{mig['steps_on_fast_path']} steps on the old plan; stalled {mig['stall_s']:.3f}s"
            + (f" ({mig['compile_wait_s']:.2f}s waiting for its compile)"
               if mig.get("compile_wait_s") else "")
            + f"; {mig['bytes_moved'] / 1e6:.2f} MB from live devices; "
            + verified_text(mig["verified"], mig.get("verify"))
        )
    return (
        f"step {mig['step']}: cut over {mig['from_plan']} => {mig['to_plan']} after "
        f"{mig['steps_on_fast_path']} fast-path steps; stalled {mig['stall_s']:.3f}s"
        + (f" ({mig['compile_wait_s']:.2f}s waiting for its compile)"
           if mig.get("compile_wait_s") else "")
        + f"; optimal plan running {mig['time_to_optimal_s']:.2f}s after the failure; "
        + verified_text(mig["verified"], mig.get("verify"))
    )


class Progress:
    """A rich progress bar (step, loss, devices), or nothing."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total = enabled, total
        self._p = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._p = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("devices {task.fields[devices]}"),
                TextColumn("{task.fields[plan]}"),
                TimeElapsedColumn(),
            )
            self._p.__enter__()
            self._task = self._p.add_task("train", total=self.total, loss="-", devices="-", plan="")
        return self

    def update(self, step: int, loss: float, plan: Plan) -> None:
        if self._p is not None:
            self._p.update(
                self._task, completed=step, loss=f"{loss:.4f}", devices=plan.n_devices, plan=plan.name
            )

    def log(self, msg: str) -> None:
        if self._p is not None:
            self._p.console.log(msg)

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)


def print_summary(recoveries, losses, evals, plan: Plan, out_dir, notes=(), growths=(),
                  costs=(), goodput=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if recoveries:
        t = Table(title=f"Recoveries ({recoveries[0].failure_simulation})")
        for col in ("step", "failure", "plan change", "rung", "moved", "xfers", "verified", "MTTR"):
            t.add_column(col)
        for e in recoveries:
            rung = e.rung + (f" (-{e.steps_lost} steps)" if e.steps_lost else "")
            t.add_row(
                str(e.step), e.fault, f"{e.from_plan} -> {e.to_plan}" + (
                    f" (spare host {e.spare_took_over} took over, {e.to_n_devices} devices)"
                    if e.spare_took_over else ""), rung,
                f"{e.bytes_moved / 1e6:.2f} MB", str(e.transfers),
                f"{e.verify['leaves']} leaves" if e.verified and e.verify else (
                    "yes" if e.verified else "NO"), f"{e.mttr_s:.2f}s",
            )
        con.print(t)
        t = Table(title="MTTR breakdown (seconds)")
        cols = ("step", "detect", "plan", "compile", "transfer", "verify", "snapshot", "1st step",
                "total")
        for col in cols:
            t.add_column(col, justify="right")
        for e in recoveries:
            t.add_row(
                str(e.step), f"{e.detect_s:.4f}", f"{e.plan_s:.4f}", f"{e.compile_s:.3f}",
                f"{e.transfer_s:.3f}", f"{e.verify_s:.3f}", f"{e.snapshot_s:.3f}",
                f"{e.first_step_s:.3f}", f"{e.mttr_s:.3f}",
            )
        con.print(t)
        if costs:
            t = Table(title="Time lost per failure, until back at pace (seconds)")
            for col in ("step", "recovery", "slow steps", "fast path", "pauses", "redone",
                        "total", "steps to pace"):
                t.add_column(col, justify="right")
            for c in costs:
                t.add_row(
                    str(c["step"]), f"{c['phases_s']:.3f}", f"{c['slow_steps_s']:.3f}",
                    f"{c['fast_path_s']:.3f}", f"{c['pauses_s']:.3f}", f"{c['redone_s']:.3f}",
                    f"{c['time_lost_s']:.3f}",
                    str(c["steps_to_pace"]) + ("" if "note" not in c else " (not back)"),
                )
            con.print(t)
    else:
        con.print("no failures were injected")
    if goodput and goodput.get("goodput") is not None:
        b = goodput["badput"]
        con.print(
            f"goodput {goodput['goodput']:.3f} ({goodput['useful_steps']} steps x "
            f"{goodput['pace_s']:.3f}s fault-free pace / {goodput['wall_s']:.1f}s wall); badput s: "
            + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f}" for k, v in b.items())
        )
    if growths:
        t = Table(title="Growth (returned devices; cut-over at a step boundary)")
        for col in ("join", "cut-over", "devices", "plan change", "moved", "compile wait", "stall",
                    "verified"):
            t.add_column(col)
        for g in growths:
            t.add_row(
                str(g["join_step"]), str(g["step"]), f"{g['from_n_devices']} -> {g['n_devices']}",
                f"{g['from_plan']} -> {g['to_plan']}", f"{g['bytes_moved'] / 1e6:.2f} MB",
                f"{g['compile_wait_s']:.2f}s", f"{g['stall_s']:.3f}s",
                f"{g['verify']['leaves']} leaves" if g["verified"] and g.get("verify") else (
                    "yes" if g["verified"] else "NO"),
            )
        con.print(t)
    for note in notes:
        con.print(note)
    if losses:
        last = max(losses)
        msg = f"final loss {losses[last]:.4f} at step {last}; final plan {plan.describe()}"
    else:  # resumed from the checkpoint of the run's last step
        msg = f"no step left to train; final plan {plan.describe()}"
    if evals:
        k = max(evals)
        msg += f"; held-out loss {evals[k]:.4f}"
    con.print(msg)
    if out_dir is not None:
        con.print(f"outputs: {out_dir}/config.yaml, metrics.jsonl, events.jsonl")


# -- the standby's lines: what it will build, when it is ready, what it cost -------------------


def standby_line(cfg, on: bool, no_worker: str | None, worker, shared: bool,
                 n_plans: int, n_programs: int) -> str:
    """What the standby does in this run, for the start line: `on` (`config.standby_on`), why
    no compile worker can build the plans (`no_worker`), the worker (None: a thread builds),
    whether the job's processes share compiles, how many plans it builds and how many programs
    they need (`ExecutableSource.programs`: fewer where a program serves several device sets)."""
    given = cfg.standby.enabled
    if not on:
        if given is False:
            return "standby: off (standby.enabled: false): a recovery compiles its new plan"
        why = (no_worker or "standby.compiler is thread: its compiles would run beside "
               "the steps, on the training process's threads")
        return ("standby: off (standby.enabled: auto, on where a compile worker process "
                "builds the plans, or under launch where the processes share the compiles "
                f"of the built-in GPT and optimizer; here {why}; --standby or "
                "standby.enabled: true turns it on): a recovery compiles its new plan")
    where = (f"in a compile worker process at nice {worker.nice}" + (
                 f", paced to {worker.share:g} of the cores while steps run beside it"
                 if worker.share is not None else "")
             if worker is not None else "on a thread of this process")
    if shared:
        where += " (each program compiled by one process of the job, loaded by the others)"
    pause = ("training waits until they are built" if cfg.standby.wait_at_start else
             "training goes on meanwhile; a 'standby ready' line says when they are built")
    progs = f"{n_programs} program{'' if n_programs == 1 else 's'}"
    what = (f"{progs}, each compiled once and loaded for the other device sets"
            if n_programs < n_plans else f"{progs}, one per plan")
    return (f"standby: building the {n_plans} plans of the likeliest next failures "
            f"(standby.enabled: {str(given).lower()}) {where}: {what}; {pause}")


def standby_ready_line(head: str, sb, wait_s: float, warm_s: float, map_budget: float) -> str:
    """The `standby_ready` line: `head`, then what the standby compiler `sb` built and how."""
    return (f"{head}: {sb.compiled + sb.rebound + sb.loaded} plans built so far "
            f"({sb.compiled} compiled in {sb.compile_s:.1f}s, "
            + (f"{sb.loaded} loaded from a compile elsewhere in {sb.load_s:.1f}s, "
               if sb.loaded else "")
            + f"{sb.rebound} rebound from them in {sb.rebind_s:.1f}s)"
            + (f", warmed in {warm_s:.1f}s" if wait_s else "")
            + (f"; {sb.over_budget} left unbuilt: the process reached standby.map_budget = "
               f"{map_budget} of its memory-mapping limit, recoveries to them compile"
               if sb.over_budget else ""))


def standby_cost(sb, worker, warmed: int = 0) -> dict | None:
    """What the background builds cost (the `end` event's `standby`); None without them.
    `warmed`: the executables run once on zeros between steps (`ExecutableSource.warm_built`)."""
    if sb is None:
        return None
    return {"compiled": sb.compiled, "rebound": sb.rebound, "loaded": sb.loaded,
            "compile_s": round(sb.compile_s + sb.rebind_s, 3),
            "worker_cpu_s": (round(worker.compile_cpu_s, 3) if worker is not None else None),
            "worker_paced_s": (round(worker.paced_s, 3) if worker is not None else None),
            "warmed": warmed}


def standby_cost_line(cost: dict) -> str:
    """The end's line for `standby_cost`."""
    return (f"standby: {cost['compiled']} plans compiled, "
            + (f"{cost['loaded']} loaded from a compile elsewhere, " if cost["loaded"] else "")
            + f"{cost['rebound']} rebound in the background ({cost['compile_s']:.1f}s of builds"
            + (f", {cost['worker_cpu_s']:.1f} CPU seconds in the compile worker"
               + (f", held {cost['worker_paced_s']:.1f}s by its pace"
                  if cost.get("worker_paced_s") else "") + ")"
               if cost["worker_cpu_s"] is not None else " on a thread of this process)")
            + (f"; {cost['warmed']} warmed between steps" if cost.get("warmed") else ""))


def shared_cost(shared) -> dict | None:
    """This process's part in compiling once per job (`compilation.shared.SharedBuilds`; the
    `end` event's `shared_compiles`); None where the processes do not share compiles."""
    if shared is None:
        return None
    return {"published": shared.published, "loaded": shared.loaded,
            "compiled_alone": shared.compiled_alone, "waited_s": round(shared.waited_s, 3)}


def shared_cost_line(cost: dict) -> str:
    """The end's line for `shared_cost`."""
    return (f"compiled once per job: {cost['published']} programs compiled here for the "
            f"others, {cost['loaded']} loaded from another process's compile "
            f"({cost['waited_s']:.1f}s waiting), {cost['compiled_alone']} compiled alone")
