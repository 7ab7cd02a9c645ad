"""What the run prepares for: the likeliest next failures of a plan, and the plans recovery
would move to after each (or after every down device returned). Pure planning, no JAX: the
standby compiles these plans ahead (`compilation.source`), and the transitions to them are
planned in the background (`recovery.TransitionPlanner`)."""

from __future__ import annotations

from ..config import Config, grow_standby
from .planner import (
    NoPlanError,
    Plan,
    Topology,
    fast_path_plan,
    growth_plan,
    replan,
    same_shape,
    substitute_spares,
)


class Contingencies:
    """The next failures and plans of a job on `topo` started on `initial`. `device_failures`:
    can one device fail alone (the in-process runtime), or only a whole process's devices;
    `can_grow`: can devices return (`Runtime.devices_return`); `standby`: is the standby on."""

    def __init__(self, cfg: Config, topo: Topology, initial: Plan, *, device_failures: bool,
                 can_grow: bool, standby: bool, depth: int = 1):
        self.cfg, self.topo, self.initial = cfg, topo, initial
        self.device_failures, self.can_grow = device_failures, can_grow
        self.standby = standby  # the standby is on (`config.standby_on`)
        self.depth = depth  # failures ahead it covers (`config.standby_depth`)

    def failures(self, plan: Plan, live: set[int]) -> list[tuple[set[int], set[int]]]:
        """The likeliest next failures of `plan`: (devices lost, hosts lost) for every single
        device (where one can fail alone) and every single host."""
        topo = self.topo
        fails = [({d}, set()) for d in plan.device_ids] if self.device_failures else []
        fails += [
            (set(topo.host_devices(h)) & live, {h})
            for h in range(topo.n_hosts)
            if set(topo.host_devices(h)) & set(plan.device_ids)
        ]
        return fails

    def survivors(self, live: set[int]) -> list[int]:
        """`live` in the job's device order (the order every plan lists its devices in)."""
        return [d for d in self.topo.device_ids if d in live]

    def recovery_plan(self, plan: Plan, survivors: list[int]) -> tuple[Plan, Plan]:
        """(plan to resume on, optimal plan) after a failure of `plan` that leaves `survivors`:
        the optimal plan, or with `recovery.migration: async` a no-movement fast path first."""
        cfg = self.cfg
        optimal = replan(survivors, self.topo, cfg, plan, self.initial)
        if cfg.parallel.spares and same_shape(plan, optimal):
            return optimal, optimal  # a hot spare took over: nothing faster to resume on
        if cfg.recovery.migration == "async" and cfg.recovery.strategy == "elastic":
            fast = fast_path_plan(plan, survivors, cfg)
            if fast is not None and fast != optimal:
                return fast, optimal
        return optimal, optimal

    def standby_plans(self, plan: Plan, live: set[int]) -> list:
        """The compile keys of the plans recovery would need after the likeliest next failures
        of `plan` (`failures`): their optimal plans with the standby on; the no-movement
        fast paths with `recovery.migration: async`; and with `recovery.grow_standby`, the plan
        of the likeliest growth (every down device returns; with none down, the plans a rejoin
        after the likeliest failures would grow to: `rejoin_plans`). With depth 2
        (`standby.depth`), also one plan of each new program (`Plan.shape_key`) needed after a
        second failure of each of those: after a recovery, the standby set of the new plan
        then needs no compile, only loads (`executables.rebind`). One per program, not every
        device set: a loaded CPU executable holds hundreds of memory mappings, and a process
        has a bounded number (`standby.map_budget`)."""
        first = self._next_plans(plan, live)
        out = [p for p, _ in first]
        if self.standby and self.depth == 2:
            programs = {p.shape_key for p in out}
            for nxt, survivors in first:
                for p, _ in self._next_plans(nxt, survivors):
                    if p.shape_key not in programs:
                        programs.add(p.shape_key)
                        out.append(p)
        if grow_standby(self.cfg) and self.can_grow:
            grown = self.growth_candidate(plan, live)
            if grown is not None:
                out.append(grown)
            else:
                out += self.rejoin_plans(plan, live)
        return list(dict.fromkeys(p.compile_key for p in out))

    def rejoin_plans(self, plan: Plan, live: set[int]) -> list[Plan]:
        """With every device live, the plans a job would grow back to after one of `plan`'s
        likeliest failures and the return of what it lost (a restarted worker's rejoin), where
        that is not `plan` itself: compiled ahead, a rejoin late in a run grows at once instead
        of waiting for a compile it has no steps left for (experiments/RESULTS.md, the issue-45
        soak). Usually one plan: the best one over every device."""
        if not set(self.topo.device_ids) <= set(live):
            return []
        out: dict = {}
        everyone = list(self.topo.device_ids)
        for gone, _ in self.failures(plan, live):
            survivors = self.survivors(live - gone)
            if not survivors:
                continue
            try:
                after = replan(survivors, self.topo, self.cfg, plan, self.initial)
                back = growth_plan(everyone, self.topo, self.cfg, after, self.initial)
            except NoPlanError:
                continue
            if back.grow and back.best.compile_key != plan.compile_key:
                out.setdefault(back.best.compile_key, back.best)
        return list(out.values())

    def _next_plans(self, plan: Plan, live: set[int]) -> list[tuple[Plan, set[int]]]:
        """(plan, its live devices) after each of `plan`'s likeliest next failures."""
        cfg = self.cfg
        out: list[tuple[Plan, set[int]]] = []
        for gone, _ in self.failures(plan, live):
            survivors = self.survivors(live - gone)
            if not survivors:
                continue
            left = set(survivors)
            if cfg.parallel.spares and (self.standby or cfg.recovery.migration == "async"):
                # a spare would take over: recovery resumes on that plan, async or not
                kept = substitute_spares(plan, survivors, self.topo)
                if kept is not None:
                    out.append((kept, left))
                    continue
            if cfg.recovery.migration == "async":
                fast = fast_path_plan(plan, survivors, cfg)
                if fast is not None:
                    out.append((fast, left))
            if self.standby:
                try:
                    out.append((replan(survivors, self.topo, cfg, plan, self.initial), left))
                except NoPlanError:  # a failure the planner cannot serve needs no standby
                    pass
        return out

    def growth_candidate(self, plan: Plan, live: set[int]) -> Plan | None:
        """The plan growth would move to from `plan` if every down device of the job returned
        (`recovery.grow_standby`); None when none is down or it would not grow."""
        if set(self.topo.device_ids) <= set(live):
            return None
        try:
            g = growth_plan(list(self.topo.device_ids), self.topo, self.cfg, plan, self.initial)
        except NoPlanError:  # nothing to compile ahead for a set the planner cannot serve
            return None
        return g.best if g.grow else None
