"""Which failures a committed state survives, read from its layout and its snapshot records.

A failure set (device ids failing together) is survived when every slice of every leaf still has
a copy: a holder that lives, a buddy copy on a live device, or a host copy in the memory of a
host that still has a live device (a host whose devices all failed takes its memory with it).
That is the rule recovery applies (`SnapshotPool.sources`, `shards.uncovered`), evaluated on
descriptions only: no buffer is read, nothing is copied or compiled, so the same answer is
available for a running `ElasticState` and for a loop's plan that has not started
(`recovery.plan_coverage`, `elasjax plan --coverage`).

Only single and double failures are enumerated (every device, every host, every pair of each):
their number grows as n^2, and they are what the snapshot settings are chosen against
(`snapshot.copies: k` is stated for k hosts).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable

from ..plan.planner import Topology
from .shards import ShardStore, box_str, uncovered


@dataclasses.dataclass
class Coverage:
    """Which failures the committed state survives (`ElasticState.coverage`), read from its
    shardings and the snapshot pool's copies alone: nothing runs. A failure set is survived when
    every slice of every leaf has a live holder, a buddy copy on a live device or a host copy on
    a host that still has a live device. `lost` maps each failure set checked (device ids) that
    is not survived to one slice it loses."""

    devices: list[int]  # the live devices the failure sets are drawn from
    hosts: dict[int, list[int]]  # host -> its live devices
    single_devices: bool  # every single device failure is survived
    single_hosts: bool  # every single host failure is survived
    device_pairs: bool | None  # every two devices failing together (None: not checked)
    host_pairs: bool | None  # every two hosts failing together (None: not checked or < 2 hosts)
    lost: dict[tuple[int, ...], str]

    def __str__(self) -> str:
        def yn(v):
            return "not checked" if v is None else ("yes" if v else "no")

        lines = [
            f"survives: every single device {yn(self.single_devices)}; every single host "
            f"{yn(self.single_hosts)}; every device pair {yn(self.device_pairs)}; every host pair "
            f"{yn(self.host_pairs)} ({len(self.devices)} devices, {len(self.hosts)} hosts)"
        ]
        for fs, what in list(self.lost.items())[:8]:
            lines.append(f"  devices {list(fs)} lose {what}")
        if len(self.lost) > 8:
            lines.append(f"  ... and {len(self.lost) - 8} more failure sets")
        return "\n".join(lines)


def loses(described: ShardStore, pool, topo: Topology, dead: set[int],
          dead_hosts: Iterable[int] = ()) -> str | None:
    """One slice a failure of `dead` would lose (`described`: the state's shards, read from its
    shardings; `pool`: the `SnapshotPool` placed for it; `dead_hosts`: hosts lost before), or
    None if every slice has a live copy."""
    gone_hosts = topo.hosts_lost(dead) | set(dead_hosts)
    missing = uncovered(described.without(dead), pool.describe_sources(dead, gone_hosts))
    if not missing:
        return None
    path, box = missing[0]
    return f"'{path}' {box_str(box)}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")


def coverage(described: ShardStore, pool, topo: Topology, live: Iterable[int], *,
             dead_hosts: Iterable[int] = (), pairs: bool = True) -> Coverage:
    """Which failures of the `live` devices a state laid out as `described` survives with the
    copies `pool` places (`SnapshotPool.place` or `configure`): every single device, every
    single host and, with `pairs`, every two devices and every two hosts together. Devices of
    the topology that are not live have failed already (as have `dead_hosts`)."""
    live = sorted(live)
    hosts: dict[int, list[int]] = {}
    for d in live:
        hosts.setdefault(topo.host_of(d), []).append(d)
    sets = [(d,) for d in live] + [tuple(ds) for ds in hosts.values()]
    if pairs:
        sets += list(itertools.combinations(live, 2))
        sets += [tuple(hosts[a] + hosts[b]) for a, b in itertools.combinations(sorted(hosts), 2)]
    gone = set(topo.device_ids) - set(live)
    lost: dict[tuple[int, ...], str] = {}
    for fs in dict.fromkeys(sets):
        what = loses(described, pool, topo, gone | set(fs), dead_hosts)
        if what is not None:
            lost[fs] = what
    return Coverage(
        live, hosts,
        single_devices=not any(len(fs) == 1 for fs in lost),
        single_hosts=not any(fs in lost for fs in map(tuple, hosts.values())),
        device_pairs=(not any(len(fs) == 2 for fs in lost)) if pairs else None,
        host_pairs=(not any(
            tuple(hosts[a] + hosts[b]) in lost for a, b in itertools.combinations(sorted(hosts), 2)
        )) if pairs and len(hosts) > 1 else None,
        lost=lost,
    )


@dataclasses.dataclass(frozen=True)
class Spelling:
    """How an explanation names what the user can change: the pieces API's
    `SnapshotConfig(host=True)` and `ElasticState.coverage()`, or a config's
    `snapshot.host=true` and `elasjax plan --coverage`."""

    setting: Callable[..., str]
    coverage: str
    last_resort: str


PIECES = Spelling(
    lambda **f: "SnapshotConfig(" + ", ".join(f"{k}={v!r}" for k, v in f.items()) + ")",
    "ElasticState.coverage()", "a checkpoint (CheckpointConfig) is the last rung",
)
LOOP = Spelling(
    lambda **f: ", ".join(f"snapshot.{k}={str(v).lower()}" for k, v in f.items()),
    "elasjax plan CONFIG --coverage", "a checkpoint (checkpoint.dir) is the last rung",
)


def explain(path: str, box, described: ShardStore, pool, topo: Topology, live: Iterable[int],
            failed: Iterable[int], dead: Iterable[int], spelling: Spelling = PIECES) -> str:
    """Why no copy of leaf `path`'s slice `box` survived: which devices held it and each copy
    (from `described`, the committed state's shards, and `pool`'s records), that `dead` (every
    device down) took all of them, and which snapshot setting would have kept one. `failed`:
    the devices failed since the copies were placed; `live`: those still alive."""
    failed, live, setting = set(failed), set(live), spelling.setting
    i = described.paths.index(path) if path in described.paths else None
    overlaps = lambda b: all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(b, box))  # noqa: E731
    holders = sorted({s.device for s in described.shards[i] if overlaps(s.box)}) if i is not None else []
    recs = [r for r in pool.records if r.path == path and overlaps(r.box)]
    buddies = sorted({r.buddy for r in recs if r.buddy is not None})
    hosts = sorted({r.host for r in recs if r.host is not None})
    parts = [f"held by devices {holders} (hosts {sorted({topo.host_of(d) for d in holders})})"]
    parts.append(f"buddy copies on devices {buddies}" if buddies else "no buddy copy")
    parts.append(f"host copies in the memory of hosts {hosts}" if hosts else "no host copy")
    why = f"{'; '.join(parts)}; devices {sorted(set(dead))} failed, taking all of them"
    holder_hosts = {topo.host_of(d) for d in holders}
    if len(holder_hosts) > 1:  # not a unique shard: no snapshot copies it
        return (why + f"; its holders are on {len(holder_hosts)} hosts, and snapshots copy only "
                "shards whose every holder is on one host (a failure that takes a holder on "
                f"each host is not covered by any snapshot setting); {spelling.last_resort}")
    cfg = pool.cfg
    live_hosts = {topo.host_of(d) for d in live}
    fixes = []
    if not cfg.host and any(topo.host_of(d) in live_hosts for d in holders):
        fixes.append(f"{setting(host=True)}: a copy in the holder's host memory, whose host "
                     "still has live devices")
    if not cfg.buddy and topo.n_hosts > 1:
        fixes.append(f"{setting(buddy=True)}: a copy on a device of another host")
    # buddy copies on more hosts than this failure reached (besides the holders'), placed over
    # the hosts that were live when the copies were taken
    reached = {topo.host_of(d) for d in failed} - holder_hosts
    placeable = {topo.host_of(d) for d in live | failed} - holder_hosts
    k = len(reached) + 1
    more = None
    if k > cfg.copies and k <= len(placeable):
        more = (f"{setting(buddy=True, copies=k)}: buddy copies on {k} different hosts, more "
                f"than the {len(reached)} other host(s) this failure reached")
    if fixes:
        return why + "; it would have been kept by " + " or ".join(fixes + [more] * bool(more))
    return (why + "; no snapshot setting of one copy per shard covers this failure set "
            f"({spelling.coverage} lists such sets); "
            + (f"it would have been kept by {more}; " if more else "")
            + spelling.last_resort)
