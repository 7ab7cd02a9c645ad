"""Deterministic mode's reduction: the canonical micro-batches summed in one fixed tree.

Float addition is not associative, so a sum is bitwise reproducible across meshes only if the
same additions happen in the same order whatever the layout. The order chosen here is a
balanced binary tree over the K canonical micro-batches (K is fixed for the run): node (l, j)
covers canonical indices [j * 2**l, min((j + 1) * 2**l, K)) and is `node(l-1, 2j) +
node(l-1, 2j+1)`, or `node(l-1, 2j)` itself when the right child would start at or past K. The
root (level L = ceil(log2 K)) is the sum. Neither the tree nor any of its additions depends on
the number of replicas or on which replica holds which micro-batch.

The planner deals each replica a contiguous run of canonical indices (`Plan.canonical_slots`).
A replica computes every node whose indices it holds entirely ("local" nodes) as its
micro-batch gradients arrive, at most `MERGES_PER_STEP` additions per micro-batch (the rest
after its last one), keeping only the nodes still waiting for a sibling. Every other node spans
a boundary between replicas; it is computed by the replica holding its first index, in rounds
of one level each: the replica holding the right child sends it (one `ppermute` per round; each
replica sends at most one gradient and receives at most one per round, since at most one
node of a level contains its range's first index, and at most one its last). The root ends on
replica 0 and is broadcast by a `psum` in which every other replica contributes -0.0, which
leaves every bit of it unchanged (x + -0.0 == x for every float x, -0.0 included).

Memory per device: `TreeSchedule.n_regs - 1` gradient-sized registers (the device's shard of
the gradient under tensor parallelism; the schedule's scratch register is never stored);
`n_regs` is at most ceil(log2 K) + 3 for every layout the planner deals (tests/test_treesum.py
checks every replica count 1..K for K up to 64), so the extra memory is
O(log K) gradients and does not grow with the replica count. The plain data-parallel step
keeps one accumulator.

Communication per device: at most one gradient per tree level sent and one received (ceil(log2
K) rounds; fewer in practice: only replicas whose range boundary falls inside a node of that
level take part), then the broadcast, an all-reduce of one gradient. A plain data-parallel
all-reduce moves about 2 gradients per device (ring reduce-scatter + all-gather), so the tree
costs at most (ceil(log2 K) + 2) / 2 times that in bytes, and ceil(log2 K) extra latency steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .mesh import DATA

PyTree = Any

MERGES_PER_STEP = 1  # local additions per micro-batch; later ones wait for the flush round
SCRATCH = 0  # register that padding slots and no-op additions write to; never read into a sum


@dataclasses.dataclass(frozen=True)
class Round:
    """One step of the cross-replica phase: an optional transfer, then local additions.

    `perm` is the (source, destination) data ranks of the transfer (empty: none); `send[r]` is
    the register rank r sends, `recv[r]` the one it writes what it receives to (SCRATCH when it
    takes no part). `ops[r, i]` = (dst, a, b): rank r sets register dst to a + b."""

    perm: tuple[tuple[int, int], ...]
    send: np.ndarray  # [D] int32
    recv: np.ndarray  # [D] int32
    ops: np.ndarray  # [D, n, 3] int32


@dataclasses.dataclass(frozen=True)
class TreeSchedule:
    """Register-level program of the fixed-order tree sum for one layout (see module docstring).

    `write[r, k]`: register rank r stores its k-th micro-batch's value in (SCRATCH for a padding
    slot); `step_ops[r, k, i]` = (dst, a, b) additions after that write; then `rounds`; the sum
    ends in register `root` of rank 0."""

    n_canonical: int
    n_regs: int
    write: np.ndarray  # [D, m] int32
    step_ops: np.ndarray  # [D, m, MERGES_PER_STEP, 3] int32
    rounds: tuple[Round, ...]
    root: int

    @property
    def n_levels(self) -> int:
        return tree_levels(self.n_canonical)


def tree_levels(k: int) -> int:
    """Levels above the leaves: ceil(log2 k)."""
    return max(0, int(k - 1).bit_length())


def register_bound(k: int) -> int:
    """Registers a schedule of `k` canonical micro-batches uses at most, scratch included."""
    return tree_levels(k) + 3


def _children(level: int, j: int, k: int) -> list[tuple[int, int]]:
    out = [(level - 1, 2 * j)]
    if ((2 * j + 1) << (level - 1)) < k:
        out.append((level - 1, 2 * j + 1))
    return out


class _Regs:
    def __init__(self):
        self.free: list[int] = []
        self.top = 1  # register 0 is SCRATCH

    def alloc(self) -> int:
        if self.free:
            return self.free.pop()
        self.top += 1
        return self.top - 1

    def release(self, r: int) -> None:
        self.free.append(r)


def schedule(slots: np.ndarray) -> TreeSchedule:
    """The tree-sum program for a layout: `slots[k, r]` is the canonical index rank r holds in
    its k-th micro-batch (-1 = padding), as `Plan.canonical_slots()` gives it. Each rank's
    indices must be one increasing contiguous run, and together they must be 0..K-1."""
    slots = np.asarray(slots)
    m, D = slots.shape
    held = [[int(c) for c in slots[:, r] if c >= 0] for r in range(D)]
    K = sum(len(h) for h in held)
    owner = np.full(K, -1, np.int64)
    for r, h in enumerate(held):
        if h and h != list(range(h[0], h[0] + len(h))):
            raise ValueError(f"rank {r} holds canonical micro-batches {h}: not one contiguous run")
        for c in h:
            if not 0 <= c < K or owner[c] >= 0:
                raise ValueError(f"canonical micro-batch {c} is out of 0..{K - 1} or dealt twice")
            owner[c] = r
        if list(slots[: len(h), r]) != h:
            raise ValueError(f"rank {r}: padding slots must come after its micro-batches")
    if K == 0:
        raise ValueError("no canonical micro-batches to sum")
    L = tree_levels(K)

    def span(level, j):
        return j << level, min((j + 1) << level, K)

    def is_local(level, j):
        a, b = span(level, j)
        return owner[a] == owner[b - 1]

    where: dict[tuple[int, int], int] = {}  # node -> register on owner(first index)
    regs = [_Regs() for _ in range(D)]
    write = np.full((D, m), SCRATCH, np.int32)
    step_ops = np.full((D, m, MERGES_PER_STEP, 3), SCRATCH, np.int32)
    flush: list[list[tuple[int, int, int]]] = [[] for _ in range(D)]

    # local phase, rank by rank (ranks do not interact here)
    for r in range(D):
        ready: list[tuple[int, int]] = []

        def computed(node, r=r, ready=ready):
            level, j = node
            while level < L:
                parent = (level + 1, j // 2)
                if not is_local(*parent):
                    return
                kids = _children(*parent, K)
                if len(kids) == 1:  # no addition: the parent is its only child
                    where[parent] = where.pop(node)
                    node, level, j = parent, parent[0], parent[1]
                    continue
                if all(c in where for c in kids):
                    ready.append(parent)
                return

        def merge(r=r, ready=ready):
            ready.sort()
            node = ready.pop(0)
            left, right = _children(*node, K)
            dst, b = where.pop(left), where.pop(right)
            regs[r].release(b)
            where[node] = dst
            computed(node)
            return (dst, dst, b)

        for k, c in enumerate(held[r]):
            reg = regs[r].alloc()
            write[r, k] = reg
            where[(0, c)] = reg
            computed((0, c))
            for i in range(MERGES_PER_STEP):
                if ready:
                    step_ops[r, k, i] = merge()
        while ready:
            flush[r].append(merge())

    rounds = [_round(D, (), {}, {}, flush)] if any(flush) else []
    # cross-replica phase: level by level, the nodes spanning a boundary
    for level in range(1, L + 1):
        perm, send, recv = [], {}, {}
        ops: list[list[tuple[int, int, int]]] = [[] for _ in range(D)]
        freed: list[tuple[int, int]] = []
        for j in range(((K - 1) >> level) + 1):
            node = (level, j)
            if is_local(*node):
                continue
            kids = _children(*node, K)
            a = int(owner[span(*kids[0])[0]])
            if len(kids) == 1:
                where[node] = where.pop(kids[0])
                continue
            b = int(owner[span(*kids[1])[0]])
            ra, rb = where.pop(kids[0]), where.pop(kids[1])
            if a != b:
                if a in recv or b in send:
                    raise AssertionError(f"rank {a} or {b} in two transfers at level {level}")
                perm.append((b, a))
                send[b] = rb
                recv[a] = regs[a].alloc()
                freed.append((b, rb))
                ops[a].append((ra, ra, recv[a]))
                freed.append((a, recv[a]))
            else:
                ops[a].append((ra, ra, rb))
                freed.append((a, rb))
            where[node] = ra
        for r, reg in freed:
            regs[r].release(reg)
        if perm or any(ops):
            rounds.append(_round(D, tuple(perm), send, recv, ops))
    root = where.pop((L, 0))
    if owner[0] != 0 or where:
        raise AssertionError("the tree sum did not end on rank 0 alone")
    n_regs = max(rg.top for rg in regs)
    return TreeSchedule(K, n_regs, write, step_ops, tuple(rounds), root)


def _round(D, perm, send, recv, ops) -> Round:
    n = max(1, max(len(o) for o in ops))
    tab = np.full((D, n, 3), SCRATCH, np.int32)
    for r, o in enumerate(ops):
        if o:
            tab[r, : len(o)] = o
    s = np.array([send.get(r, SCRATCH) for r in range(D)], np.int32)
    v = np.array([recv.get(r, SCRATCH) for r in range(D)], np.int32)
    return Round(perm, s, v, tab)


def reference_sum(values: np.ndarray) -> np.ndarray:
    """The tree's sum of `values[c]` (canonical order), in plain numpy: what every layout's
    schedule must reproduce bit for bit."""
    level = list(values)
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return level[0]


def simulate(sched: TreeSchedule, slots: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Run `sched` in numpy on `values[c]` (one array per canonical micro-batch) the way the
    device program does (registers, transfers, additions), returning rank 0's root."""
    m, D = np.asarray(slots).shape
    regs = np.zeros((D, sched.n_regs) + values.shape[1:], values.dtype)
    for k in range(m):
        for r in range(D):
            c = slots[k, r]
            regs[r, sched.write[r, k]] = values[c] if c >= 0 else np.nan
            for dst, a, b in sched.step_ops[r, k]:
                regs[r, dst] = regs[r, a] + regs[r, b]
    for rd in sched.rounds:
        got = {dst: regs[src, rd.send[src]].copy() for src, dst in rd.perm}
        for r in range(D):
            regs[r, rd.recv[r]] = got.get(r, np.nan)
            for dst, a, b in rd.ops[r]:
                regs[r, dst] = regs[r, a] + regs[r, b]
    return regs[0, sched.root]


# -- the device program -------------------------------------------------------------------------
#
# Registers are separate arrays (SCRATCH is never stored), and every addition is static code:
# the replicas' programs for a micro-batch (or a round) are grouped into the distinct ones, and a
# `lax.switch` on a table indexed by the replica (and the micro-batch) runs its own. One stacked
# register file indexed at run time cost 4x this on XLA:CPU (a dynamic slice or update of the
# file per register access, and every replica doing every addition, scratch ones included):
# experiments/RESULTS.md, "The tree sum's device program".

RECV = -1  # an operand of a round's addition: the value received in that round


def _programs(shape: tuple[int, ...], keys: dict) -> tuple[np.ndarray, list]:
    """{index: program} -> (table of program ids by index, of `shape`; the distinct programs)."""
    uniq: dict = {}
    table = np.zeros(shape, np.int32)
    for at, prog in keys.items():
        table[at] = uniq.setdefault(prog, len(uniq))
    return table, list(uniq)


def _adds(ops) -> tuple[tuple[int, int, int], ...]:
    """A program's additions, the no-ops (those writing SCRATCH) left out."""
    return tuple((int(d), int(a), int(b)) for d, a, b in ops if d != SCRATCH)


def _run(regs: tuple, ops, got=None) -> tuple:
    """`ops` (dst, a, b: register ids, or RECV for `got`) on the registers (register i is
    `regs[i - 1]`)."""
    regs = list(regs)
    for dst, a, b in ops:
        va = got if a == RECV else regs[a - 1]
        vb = got if b == RECV else regs[b - 1]
        regs[dst - 1] = jax.tree.map(jnp.add, va, vb)
    return tuple(regs)


def _select(index, branches, *args):
    """`branches[index](*args)`; static when there is one branch."""
    if len(branches) == 1:
        return branches[0](*args)
    return jax.lax.switch(index, branches, *args)


class TreeSum:
    """`sched` on a mesh, for a pytree of values each replica computes per micro-batch.

    `specs` gives each value leaf's PartitionSpec without the data axis (its tensor sharding);
    the per-replica values passed to `step` are `[D, *leaf]`, sharded over `data` on axis 0.
    `init()` -> registers; `step(regs, values, k)` stores micro-batch k's values and does that
    step's additions; `finish(regs)` runs the rounds and returns the sum on every replica."""

    def __init__(self, sched: TreeSchedule, mesh: Mesh, specs: PyTree):
        self.sched, self.mesh, self.specs = sched, mesh, specs
        self.D = mesh.shape[DATA]
        D, m = sched.write.shape
        if D != self.D:
            raise ValueError(f"schedule for {D} replicas on a mesh of {self.D}")
        is_spec = lambda s: isinstance(s, PartitionSpec)  # noqa: E731
        self._is_spec = is_spec
        self._val_specs = jax.tree.map(lambda s: PartitionSpec(DATA, *s), specs, is_leaf=is_spec)
        self._steps = _programs((D, m), {
            (r, k): (int(sched.write[r, k]), _adds(sched.step_ops[r, k]))
            for r in range(D) for k in range(m)
        })
        self._rounds = [self._round(rd) for rd in sched.rounds]

    def _round(self, rd: Round):
        """(senders' register table, distinct registers sent, op table, distinct op programs)."""
        senders = dict(rd.perm)
        sent = sorted({int(rd.send[s]) for s in senders}) or [None]
        send_tab = np.array([sent.index(int(rd.send[r])) if r in senders else 0
                             for r in range(self.D)], np.int32)
        receivers = {d for _, d in rd.perm}
        progs = {}
        for r in range(self.D):
            recv = int(rd.recv[r]) if r in receivers else None
            ops = _adds(rd.ops[r])
            if recv is not None:
                if any(d == recv for d, _, _ in ops):
                    raise AssertionError(f"rank {r} writes its receive register {recv}")
                ops = tuple((d, RECV if a == recv else a, RECV if b == recv else b)
                            for d, a, b in ops)
            progs[r] = ops
        op_tab, op_progs = _programs((self.D,), progs)
        return send_tab, sent, op_tab, op_progs

    def _map(self, f, *trees):
        return jax.tree.map(f, *trees, is_leaf=self._is_spec)

    def init(self, like: PyTree) -> tuple:
        """Zeroed registers (a tuple, register i at i - 1) for values shaped like `like` (one
        replica's value per leaf)."""
        return tuple(
            self._map(
                lambda s, x: jax.lax.with_sharding_constraint(
                    jnp.zeros((self.D,) + x.shape, x.dtype), NamedSharding(self.mesh, s)
                ),
                self._val_specs, like,
            )
            for _ in range(self.sched.n_regs - 1)
        )

    def constrain(self, values: PyTree) -> PyTree:
        return self._map(
            lambda s, x: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, s)),
            self._val_specs, values,
        )

    def _shard_map(self, f, regs, *rest, rest_specs=(), out=None):
        reg_specs = tuple(self._val_specs for _ in regs)
        return jax.shard_map(
            f, mesh=self.mesh, in_specs=(reg_specs, *rest_specs),
            out_specs=reg_specs if out is None else out, check_vma=False,
        )(regs, *rest)

    def step(self, regs: tuple, values: PyTree, k: jax.Array) -> tuple:
        table, progs = self._steps

        def branch(prog):
            w, ops = prog

            def run(regs, x):
                if w != SCRATCH:  # a padding slot's value is dropped
                    regs = regs[: w - 1] + (x,) + regs[w:]
                return _run(regs, ops)

            return run

        branches = [branch(p) for p in progs]
        table = jnp.asarray(table)

        def local(regs, x, k):
            return _select(table[jax.lax.axis_index(DATA), k], branches, regs, x)

        return self._shard_map(local, regs, values, k,
                               rest_specs=(self._val_specs, PartitionSpec()))

    def finish(self, regs: tuple) -> PyTree:
        sched, rounds = self.sched, self._rounds

        def local(regs):
            r = jax.lax.axis_index(DATA)
            for rd, (send_tab, sent, op_tab, op_progs) in zip(sched.rounds, rounds):
                got = None
                if rd.perm:
                    out = _select(jnp.asarray(send_tab)[r],
                                  [lambda R, i=i: R[i - 1] for i in sent], regs)
                    got = jax.lax.ppermute(out, DATA, rd.perm)
                branches = [lambda R, g, ops=ops: _run(R, ops, g) for ops in op_progs]
                regs = _select(jnp.asarray(op_tab)[r], branches, regs,
                               got if got is not None else regs[0])
            # only rank 0 holds the root; -0.0 elsewhere leaves its bits unchanged in the psum
            mine = jax.tree.map(
                lambda x: jnp.where(r == 0, x[0], jnp.array(-0.0, x.dtype)), regs[sched.root - 1]
            )
            return jax.lax.psum(mine, DATA)

        return self._shard_map(local, regs, out=self.specs)
