"""Fresh CPU collectives after a failure (the multi-controller runtime on CPU/gloo).

Why: XLA:CPU creates one gloo communicator per clique (the ordered device list of a replica
group) the first time a collective runs over it, and keeps it for the life of the client
(`xla/backends/cpu/collectives/cpu_cliques.cc`: erased only when the client's collectives
object is destroyed). A gloo pair that waits longer than the collective timeout is closed for
good ("Application timeout caused pair closure"). When a peer dies in the middle of a step, a
survivor's device thread can be waiting in a collective with *another survivor's* device (for
example its own process's tensor pair), whose thread already left the step on the dead peer's
socket error: that wait runs into the timeout and closes a communicator whose members all
survive. The next plan reuses that clique (the same device list: a process's tensor pair keeps
its devices), and its first collective fails while every process is alive: a hot spare's
takeover, which keeps the mesh's shape, hits this whenever a survivor's step collective failed
only at the collective timeout (experiments/RESULTS.md, "A closed gloo communicator reused by
the spare's mesh").

The fix: the survivors drop the CPU client and create a new one (`clear_backends`), whose
collectives object starts with no communicator. The coordination service still holds the old
client's rendezvous keys (`cpu:gloo/...`, the topology exchange's `cpu:local_topology/...` and
`cpu:global_topology/...`): the lowest live process deletes them first and re-posts the dead
processes' local topologies (a new client's topology exchange expects every process of the
job). Arrays of the old client stay readable and `jax.device_put` copies them to the new
client's devices. Executables compiled for the old client do not run on the new devices, but
need no compile either: `executables.rehome` serializes them and loads them onto the new devices
(a reload is far cheaper than a compile; figures in experiments/RESULTS.md).

A renewal follows **every interrupted block**, not only a timed-out one. XLA:CPU runs every
gloo collective of a kind on a communicator under one tag (`gloo_communicator.cc`: "how to do
tags?") and gloo hands a receive the oldest message of its slot (`transport/tcp/pair.cc`). A
process that left a block on an error (a dead peer's socket, an abort) skipped collectives that
its peers may already have posted to; the next collective of that kind on the same communicator
receives the stale message. Where the sizes differ gloo's size check throws on its own network
thread, which has no handler: SIGABRT in a healthy survivor; where they match, the stale bytes
are summed in silently (experiments/repro_gloo_stale_message.py shows both with plain JAX, and a
renewal avoiding them). The old client cannot be kept merely "when the next plan's groups are
new": other programs (checksums, evaluation, a later plan) may reach an old communicator among
survivors, and gloo may already hold a stale message in user space where shutting the socket
down does not reach it. So the rule below asks of every communicator the client ever made.

What may keep the client, though a renewal was asked for:
- A failure whose every stale communicator is out of reach (`reachable_cliques`): each communicator
  the client made has its rendezvous keys in the coordination service (`cpu:gloo/<device ids>/
  <rank>`, intra-process cliques too), and a communicator is only ever used again by a program
  whose replica group is exactly its device list. When every one of them includes a dead
  process's device, no later program of this client can reach one (a plan holds live devices
  only; a dead process returns only through an admission, which makes a new client), so no
  stale message can be received: the next plan's collectives make new communicators. Every live
  process reads the keys after draining its own block and sends what it saw with its vote: a
  communicator a survivor helped make is in that survivor's reading, so the union is complete. A
  process that shut its sockets down (`abort_collectives`) cut the transfer server's connections
  too: every live process starts a new transfer server instead. A plan whose every group spans
  every process is this case; a plan with a group among survivors only (a tensor pair inside a
  process, a pipeline stage, the pairs the suite's 4-process ZeRO-1 launches make) renews. Test
  of the rule: tests/test_multiprocess.py::
  test_a_client_is_kept_only_where_no_communicator_among_survivors_exists; launches that kept
  the client (the ZeRO demo at both kills, the demo at its second): experiments/RESULTS.md,
  "Clipping inside the optimizer's branch".
- A failure found at a guard's *entry* barrier by every process, none of
which aborted its collectives. Nothing ran since the last exit barrier, and no process posts
"done" at an exit barrier before every program it dispatched in the block has finished (the
block commits what it dispatched; a block that raised is drained, `drain`), so every
communicator of the client is at rest: each collective posted was matched. Dead processes'
communicators are never used again (no later plan holds their devices; a rejoin brings a new
client). Tests: tests/test_multiprocess.py::test_every_interrupted_block_renews_the_client_and_an_entry_barrier_failure_keeps_it
(the votes), and the launches of that file under default flags.

Two more uses of a renewal. `abort_collectives`: when the kernel reports a same-host peer's
exit, a process shuts its gloo sockets down, so that no collective waits for the timeout (the
multi-controller runtime's exit watcher), and then asks for a renewal. And a step whose
collectives failed while every process was alive (a straggler past the collective timeout) is
retried on a new client instead of stopping the job (`MultiControllerRuntime.guard`;
tests/test_multiprocess.py::test_a_collective_that_times_out_among_live_processes_is_retried_on_fresh_collectives).
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable

import jax

from .inprocess import DeviceFailure

# the coordination-service directories of a CPU client: the gloo rendezvous of each clique
# and the topology exchange at client creation
GLOO_KEYS = "cpu:gloo"
LOCAL_TOPOLOGY = "cpu:local_topology"
GLOBAL_TOPOLOGY = "cpu:global_topology"


@dataclasses.dataclass(frozen=True)
class Renewal:
    """Every live process's CPU client replaced at once (`Runtime.renew_collectives`): the new
    client's generation, how long the replacement took here, and each voter's reason. `kept`:
    a renewal was asked for and not needed (every communicator of the client includes a dead
    device, `reachable_cliques`): the client stays, with new transfer servers."""

    generation: int
    renew_s: float
    reasons: str
    kept: bool = False


def reachable_cliques(client, live: Iterable[int]) -> list[str]:
    """The gloo communicators of this CPU client that a later program could use: those whose
    devices all live (two or more: one rank alone exchanges no message), read from their
    rendezvous keys (`cpu:gloo/<ids>/<rank>`). A key of another form, or a store that cannot be
    read, counts as reachable ("?"): the caller then renews the client, as it would without
    this reading."""
    live = set(live)
    try:
        keys = [k for k, _ in client.key_value_dir_get_bytes(GLOO_KEYS + "/")]
    except Exception as err:  # noqa: BLE001 (unreadable: assume the worst)
        return [f"? (the store: {type(err).__name__})"]
    out = set()
    for key in keys:
        clique, _, rank = key[len(GLOO_KEYS) + 1:].rpartition("/")
        try:
            ids = [int(i) for i in clique.split(",")]
        except ValueError:
            out.add(f"? ({key})")
            continue
        if rank == STOOD_IN:  # a marker: the clique's ranks' keys are read for it
            continue
        if not rank.isdigit():
            out.add(f"? ({key})")
        elif len(ids) > 1 and set(ids) <= live:  # a communicator of one rank sends nothing
            out.add(clique)
    return sorted(out)


def renewal_reason(mode: str, platform: str, failure: DeviceFailure, aborted: str | None = None) -> str | None:
    """This process's vote, with its reason (every live process votes; one reason renews all),
    or None. `auto`: a process that shut its collectives' sockets down (`aborted`, see
    `abort_collectives`), whose block in the failed guard raised (`failure.report.interrupted`,
    set by the runtime), or that retries a block (`report.renew`) asks; a failure found at an
    entry barrier, where no block ran, asks nothing (the module docstring says why that is
    safe). `always`: every failure. `never`, and off CPU: None. `mode` is
    `RuntimeConfig.renew_collectives`, checked there."""
    if platform != "cpu" or mode == "never":
        return None
    if aborted:
        return aborted
    if failure.report.renew:
        return failure.report.renew
    if failure.report.interrupted:
        return f"its {failure.phase} block was interrupted ({failure.report.interrupted})"
    return "renew_collectives=always" if mode == "always" else None


def drain(arrays) -> tuple[int, int]:
    """Wait until every array of `arrays` (`jax.live_arrays()`: what every program dispatched
    so far wrote) is ready or failed, ignoring their errors, so that no program of a block that
    raised still runs (a collective among them would post to a communicator its peers have left)
    when the process reports the block. Returns (arrays waited for, how many had failed). A
    program waiting in a collective with a peer that left returns at its socket's shutdown
    (`abort_collectives`) or at the collective timeout."""
    n = failed = 0
    for x in arrays:
        n += 1
        try:
            x.block_until_ready()
        except Exception:  # noqa: BLE001 (a failed program's output: it has ended)
            failed += 1
    return n, failed


def renew_cpu_client(client, live: Iterable[int], generation: int, writer: bool, wait_ms: int,
                     read: Callable[[str, int], str] | None = None) -> list:
    """Replace this process's CPU client by a new one (every live process calls it, at the same
    point). Returns the new client's devices, ordered by (process, id). The old client's
    arrays stay valid (copy them with `jax.device_put`), its executables do not run on the new
    devices. `read(key, ms)`: how a process that is not the writer waits for the writer's
    go-ahead (`kvwait.read`, which ends when the writer dies; the plain read by default)."""
    from jax.extend import backend

    ready = f"elasjax/renew/{generation}"
    live = set(live)
    if writer:
        saved = dict(client.key_value_dir_get_bytes(LOCAL_TOPOLOGY))
        glob = dict(client.key_value_dir_get_bytes(GLOBAL_TOPOLOGY)) if 0 not in live else {}
        for d in (GLOO_KEYS, GLOBAL_TOPOLOGY, LOCAL_TOPOLOGY):
            client.key_value_delete(d)
        for key, value in saved.items():  # "cpu:local_topology/cpu/<process>"
            if int(key.rsplit("/", 1)[1]) not in live:
                client.key_value_set_bytes(key, value)
        # XLA's process 0 assembles the global topology from the local ones; when it is dead the
        # last one is published again: the same devices, the dead processes' local topologies
        # being kept (tests/test_multiprocess.py::test_killing_process_0_is_survived_...)
        for key, value in glob.items():
            client.key_value_set_bytes(key, value)
        client.key_value_set(ready, repr(time.time()))
    else:
        (read or client.blocking_key_value_get)(ready, wait_ms)
    backend.clear_backends()
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


# gloo's TCP event loop (`gloo/transport/tcp/loop.cc`: `epoll_wait(fd, events, 64, 10)`, one
# thread per CPU client's collectives): the arguments that tell its thread from gRPC's pollers
# in /proc/<pid>/task/<tid>/syscall, and the syscall numbers of epoll_wait (x86_64 232,
# aarch64 22 for epoll_pwait, x86_64 281)
_GLOO_LOOP_ARGS = ("0x40", "0xa")
_EPOLL_WAITS = {"232", "281", "22"}
_gloo_loops: set[int] = set()


def gloo_loops() -> frozenset[int]:
    """The thread ids of this process's gloo event loops found so far (`quiet_gloo_loops`): they
    move the bytes of collectives that device threads posted and never post one."""
    return frozenset(_gloo_loops)


def quiet_gloo_loops(policy: str = "idle", tries: int = 50,
                     exclude: Iterable[int] | None = None) -> list[int]:
    """Find this process's gloo event-loop threads not found before and, under `policy` "idle",
    put them under SCHED_IDLE, so that they run only on a core nothing else wants ("normal":
    leave their priority). Why: the loop polls its sockets level-triggered and returns to
    `epoll_wait` at once while a message waits for its receive, so during a step each process's
    loop spins: with 4 processes on 2 cores about 0.6 of a core each, more than the devices'
    compute got, and the demo's step under `launch` took 0.29 s against 0.13 s with the loops
    idle (experiments/RESULTS.md, "gloo's event loop spins"). A device thread waiting for a
    message leaves its core idle, which is when the loop runs. Linux only; returns the threads
    found. A loop is told by its `epoll_wait` arguments (64 events, 10 ms), read up to `tries`
    times: a spinning loop is mostly outside the call; `exclude` (by default this process's
    Python threads, which gloo never starts) is never taken for one."""
    if not os.path.isdir("/proc/self/task"):
        return []
    if exclude is None:
        exclude = {t.native_id for t in threading.enumerate()}
    found: set[int] = set()
    skip = set(exclude) | _gloo_loops
    for _ in range(tries):
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return []
        for tid in tids:
            if tid in skip or tid in found:
                continue
            try:
                with open(f"/proc/self/task/{tid}/syscall") as f:
                    fields = f.read().split()
            except OSError:
                continue
            if (len(fields) > 4 and fields[0] in _EPOLL_WAITS
                    and tuple(fields[3:5]) == _GLOO_LOOP_ARGS):
                found.add(tid)
        if found:
            break
        time.sleep(0.001)
    _gloo_loops.update(found)
    if policy == "idle":
        for tid in sorted(found):
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:  # the thread ended
                continue
    return sorted(found)


CONTEXT_FAILED = "Gloo context initialization failed"

# A dead rank's rendezvous entry (`end_rendezvous`): gloo's TCP transport reads a rank's entry as
# (size_t hostname size, hostname, size_t address size, address, pair ids) and checks that an
# address has the size of its socket address (`tcp::Address(bytes)`: "sizeof(impl_) ==
# bytes.size()"); a one-byte address fails that check, which throws, and XLA turns the throw into
# the collective's error. An empty entry crashed the reader instead (SIGSEGV, jax 0.10.2): it must
# parse. Read in gloo/transport/tcp/context.cc and address.cc; checked on jax 0.10.2 and 0.12.1 by
# tests/test_multiprocess.py::test_a_dead_ranks_rendezvous_entry_ends_the_survivors_wait_at_once.
DEAD_RANK = struct.pack("=Q", 4) + b"dead" + struct.pack("=Q", 1) + b"\0"
STOOD_IN = "stood-in"  # a clique's key once its dead ranks' stand-in closed (`stood_in`)


def end_rendezvous(client, dead: Callable[[int], bool]) -> list[str]:
    """End every wait in the making of a gloo communicator for a rank that will never come:
    for each clique some of whose ranks have published their address (`cpu:gloo/<ids>/<rank>`,
    rank r being the clique's r-th device) whose rank 0 is a `dead` device (a device of a
    process known dead), or whose dead ranks all come after every live one, publish `DEAD_RANK`
    for every missing dead rank; where a dead rank lies between live ones, once every live rank
    has published, a stand-in's entry (`deadranks.StandIn`). Why: a survivor that entered a
    communicator's making waits for every rank's entry for gloo's 30 s, whatever else it knows
    (shutting its sockets down does not reach that wait); a dead rank's entry makes the making
    fail with gloo's own error, which the guard reads as the collective failure it is (the MTTR
    fuzz's kill as a recovery's verification began: experiments/RESULTS.md).

    Why only those: once every entry is in, each rank connects to the others in rank order,
    one pair at a time, and fails at the first dead one. Where rank 0 is dead that is every
    live rank's first pair: all fail before connecting anything. Where the dead ranks come after
    every live one, each live rank connects to every other live rank before its first dead
    pair, so every live pair is made and then each live rank fails (experiments/RESULTS.md, "A
    second death during a script's recovery"). Otherwise a live rank below a dead one fails
    after connecting to the ranks before it, and a live rank above it waits for a connection
    the failed one never makes, for gloo's connect timeout (150 s, seen in 3 of 8 fuzz
    launches; in a probe of three plain-JAX processes, the dead rank between the two live ones,
    the one above it was still waiting when the other ended). There the stand-in completes
    the dead rank's pairs instead, so every live rank connects every pair, and closes them
    after (tests/test_multiprocess.py::test_a_dead_rank_between_live_ones_is_stood_in_for). A
    rank published meanwhile keeps its own entry (the store refuses a second write).
    Only a proven death may call this (an exit, a death notice). Entries of a client are deleted
    when a renewal or an admission replaces it (`renew_cpu_client`). Returns the keys
    written."""
    keys = dict(client.key_value_dir_get_bytes(GLOO_KEYS + "/"))
    out = []
    for clique in sorted({k.rpartition("/")[0] for k in keys}):
        try:
            ids = [int(i) for i in clique[len(GLOO_KEYS) + 1:].split(",")]
        except ValueError:
            continue
        gone = [r for r, d in enumerate(ids) if dead(d)]
        live = [r for r, d in enumerate(ids) if not dead(d)]
        if not gone:
            continue
        entry: Callable[[int], tuple | None] = lambda r: (DEAD_RANK, None)  # noqa: E731
        if not (gone[0] == 0 or min(gone) > max(live, default=-1)):
            # a dead rank between live ones: a stand-in, once every live rank has published
            if any(f"{clique}/{r}" not in keys for r in live):
                continue
            entry = _stand_in_entries(client, clique, {r: keys[f"{clique}/{r}"] for r in live},
                                      len(ids))
        for r, d in enumerate(ids):
            key = f"{clique}/{r}"
            if key in keys or not dead(d):
                continue
            made = entry(r)
            if made is None:
                break
            value, written = made
            try:
                client.key_value_set_bytes(key, value)
            except Exception:  # noqa: BLE001 (published meanwhile, or another survivor wrote it)
                continue
            if written is not None:
                written()  # the stand-in's calls, for the entry that is in
            out.append(key)
    return out


def _stand_in_entries(client, clique: str, live: dict[int, bytes], size: int
                      ) -> Callable[[int], tuple | None]:
    """For a clique of `size` ranks whose live ranks have all published (`live`: rank -> its
    entry): dead rank -> a stand-in's entry for it and what to call once it is written
    (`deadranks.StandIn.entry`), or None where a live
    entry does not parse or no stand-in can listen on its family and an address of this host.
    Once the stand-in has closed a dead rank's connections it posts `<clique>/STOOD_IN`
    (`stood_in`)."""
    from . import deadranks

    got = {r: deadranks.parse(bytes(v)) for r, v in live.items()}
    si = None if any(e is None for e in got.values()) else deadranks.stand_in_for(
        list(got.values()))
    if si is None:
        return lambda r: None

    def closed():
        try:
            client.key_value_set(f"{clique}/{STOOD_IN}", "closed", allow_overwrite=True)
        except Exception:  # noqa: BLE001 (the client renewed meanwhile: its keys are gone)
            pass

    return lambda r: si.entry(r, size, got, closed)


def stood_in(client) -> set[str]:
    """The cliques (`cpu:gloo/<ids>`) whose dead ranks' stand-in has closed its connections:
    their communicators are made, and a survivor's collective over one waits on live peers
    that may already have failed, so each survivor shuts its collectives down again
    (`aborts.CollectiveAborts`)."""
    return {k.rpartition("/")[0] for k, _ in client.key_value_dir_get_bytes(GLOO_KEYS + "/")
            if k.endswith("/" + STOOD_IN)}


def rendezvous_note(client, err: BaseException) -> str | None:
    """For an error of gloo's communicator creation (`CONTEXT_FAILED`), which ranks of which
    cliques have published their address in the coordination service (`cpu:gloo/<devices>/
    <rank>`): a rank missing from a clique whose others published is the process that did not
    enter that communicator's creation within gloo's 30 s wait (skew, or a process blocked
    elsewhere); every rank published means the pairs' connects failed instead. None for any
    other error, or where the store cannot be read."""
    if CONTEXT_FAILED not in str(err):
        return None
    try:
        entries = client.key_value_dir_get_bytes(GLOO_KEYS + "/")
    except Exception:  # noqa: BLE001 (a diagnostic: never in the way of the failure itself)
        return None
    ranks: dict[str, list[int]] = {}
    ended: dict[str, list[int]] = {}
    for key, value in entries:  # "cpu:gloo/<d0,d1,...>/<rank>"
        clique, _, rank = key[len(GLOO_KEYS) + 1:].rpartition("/")
        if rank.isdigit():
            (ended if bytes(value) == DEAD_RANK else ranks).setdefault(clique, []).append(int(rank))
    parts = []
    for clique in sorted(set(ranks) | set(ended)):
        got, dead = ranks.get(clique, []), sorted(ended.get(clique, []))
        size = clique.count(",") + 1
        missing = sorted(set(range(size)) - set(got) - set(dead))
        gap = f" (missing ranks {missing})" if missing else ""
        gap += f" (dead ranks {dead}: `end_rendezvous`)" if dead else ""
        parts.append(f"[{clique}] {len(got)}/{size}{gap}")
    return "gloo rendezvous keys published: " + ("; ".join(parts) or "none")


def abort_collectives(keep_ports: Iterable[int]) -> int:
    """Shut down this process's established TCP connections except those to or from
    `keep_ports` (the coordination service's: its gRPC channel must live on). What is left are
    the CPU client's gloo pairs (and its transfer server's connections): every collective
    blocked on one of them fails at once instead of at the collective timeout. The client's
    communicators are unusable afterwards, so every live process must renew its client
    (`renew_cpu_client`) before the next collective; `renewal_reason` asks for it. Linux only
    (/proc); returns how many sockets were shut down."""
    import socket

    keep = set(keep_ports)
    targets: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != "01":  # 01: ESTABLISHED
                continue
            local, remote = (int(c.rsplit(":", 1)[1], 16) for c in cols[1:3])
            if local not in keep and remote not in keep:
                targets.add(cols[9])  # the socket's inode
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not (link.startswith("socket:[") and link[8:-1] in targets):
            continue
        try:
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)  # the socket itself, under every descriptor
            n += 1
        except OSError:
            pass
        finally:
            sock.close()  # the duplicate only
    return n
