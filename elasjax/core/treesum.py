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
after its last one), keeping only the nodes still waiting for a sibling: its "pending" nodes,
the canonical pieces of its range (at most 2 * ceil(log2 K), one where its range is a whole
subtree, as in a fault-free layout of whole powers of two). Every other node spans a boundary
between replicas. Those are computed by every replica, each on its own 1/D-th of the elements:
one `all_to_all` over the data axis gives each replica its chunk of every replica's pending
nodes, every replica runs the same additions, in the tree's order, on its chunk (elementwise:
the chunking changes no bit), and one `all_gather` puts the root's chunks together on every
replica, except for the leaves the caller keeps in chunks (`TreeSum.finish`): a ZeRO storage
that is the leaf's row cut in D equal parts holds exactly replica r's chunk on replica r. A
leaf of `packing.OWN_EXCHANGE` elements or more travels on its own, the smaller leaves of one
dtype packed in one vector (`packing.groups`), each leaf cut in D chunks of its own: two
collectives per such group, one where all of its leaves stay in chunks.

Memory per device: `TreeSchedule.n_regs - 1` gradient-sized registers for the local phase (the
device's shard of the gradient under tensor parallelism; the schedule's scratch register is
never stored), at most ceil(log2 K) + 3 for every layout the planner deals (tests/test_treesum.py
checks every replica count 1..K for K up to 64); then the pending nodes packed for the exchange
and the chunks received, P gradients' worth each (P: the most pending nodes of a replica), a
chunk per cross-replica node and the gathered sum.
None of it grows with the replica count. The plain data-parallel step keeps one accumulator.

Communication per device: P (D - 1) / D gradients sent and received by the `all_to_all`, and
(D - 1) / D by the `all_gather`: two collectives per group whatever the tree's depth. A plain
all-reduce moves about 2 (D - 1) / D (ring reduce-scatter + all-gather): the same where P = 1.
A leaf kept in chunks skips the `all_gather`: like a reduce-scatter, (D - 1) / D where P = 1.
An earlier form sent the boundary nodes level by level (one `ppermute` per leaf and level, then
a broadcast): under `elasjax launch`, where each collective crosses processes, the ZeRO demo's
step takes 0.50-0.62 of its time with this one (experiments/RESULTS.md, "The tree sum's
cross-replica phase").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import packing
from .mesh import DATA

PyTree = Any

MERGES_PER_STEP = 1  # local additions per micro-batch; later ones wait for the flush round
SCRATCH = 0  # register that padding slots and no-op additions write to; never read into a sum


@dataclasses.dataclass(frozen=True)
class TreeSchedule:
    """Register-level program of the fixed-order tree sum for one layout (see module docstring).

    Local phase, rank r: `write[r, k]` is the register its k-th micro-batch's value goes to
    (SCRATCH for a padding slot), `step_ops[r, k, i]` = (dst, a, b) the additions after that
    write (register dst = a + b), `flush[r, i]` those after its last micro-batch. Cross phase:
    `pending[r]` are the registers of rank r's pending nodes (P of them, in canonical order; a
    rank with fewer repeats register 1, never read); in the gathered table, entry r * P + i is
    `pending[r][i]` and `cross` = ((dst, a, b), ...) appends entry dst = a + b, in order; the sum
    is entry `root`."""

    n_canonical: int
    n_regs: int
    write: np.ndarray  # [D, m] int32
    step_ops: np.ndarray  # [D, m, MERGES_PER_STEP, 3] int32
    flush: np.ndarray  # [D, n, 3] int32 (n >= 1; SCRATCH rows are no-ops)
    pending: np.ndarray  # [D, P] int32
    cross: tuple[tuple[int, int, int], ...]
    root: int


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

    n = max(1, max(len(f) for f in flush))
    flush_tab = np.full((D, n, 3), SCRATCH, np.int32)
    for r, f in enumerate(flush):
        if f:
            flush_tab[r, : len(f)] = f
    pending, cross, root = _cross_phase(where, owner, is_local, K, L, D)
    n_regs = max(rg.top for rg in regs)
    return TreeSchedule(K, n_regs, write, step_ops, flush_tab, pending, cross, root)


def _cross_phase(where, owner, is_local, K: int, L: int, D: int):
    """(pending registers [D, P], cross additions, root entry) from the local phase's end:
    `where` maps each pending node to its register on the rank holding its first index;
    `is_local(level, j)`: does one rank hold all of that node's indices."""
    held = [sorted((j << level, (level, j)) for (level, j) in where if owner[j << level] == r)
            for r in range(D)]
    P = max(1, max(len(h) for h in held))
    entry: dict[tuple[int, int], int] = {}
    pending = np.ones((D, P), np.int32)
    for r, h in enumerate(held):
        for i, (_, node) in enumerate(h):
            entry[node] = r * P + i
            pending[r, i] = where[node]
    cross: list[tuple[int, int, int]] = []
    for level in range(1, L + 1):
        for j in range(((K - 1) >> level) + 1):
            if (level, j) in entry or is_local(level, j):
                continue  # pending, or inside a pending node
            kids = _children(level, j, K)
            if len(kids) == 1:  # no addition: the node is its only child
                entry[(level, j)] = entry[kids[0]]
                continue
            entry[(level, j)] = D * P + len(cross)
            cross.append((D * P + len(cross), entry[kids[0]], entry[kids[1]]))
    return pending, tuple(cross), entry[(L, 0)]


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
    device program does (registers, the gathered table, additions), returning the sum."""
    m, D = np.asarray(slots).shape
    regs = np.zeros((D, sched.n_regs) + values.shape[1:], values.dtype)
    for k in range(m):
        for r in range(D):
            c = slots[k, r]
            regs[r, sched.write[r, k]] = values[c] if c >= 0 else np.nan
            for dst, a, b in sched.step_ops[r, k]:
                regs[r, dst] = regs[r, a] + regs[r, b]
    for r in range(D):
        for dst, a, b in sched.flush[r]:
            regs[r, dst] = regs[r, a] + regs[r, b]
    regs[:, SCRATCH] = np.nan  # a padding slot's value or a no-op's result: never summed
    table = [regs[r, reg] for r in range(D) for reg in sched.pending[r]]
    for dst, a, b in sched.cross:
        assert dst == len(table)
        table.append(table[a] + table[b])
    return table[sched.root]


# -- the device program -------------------------------------------------------------------------
#
# Registers are separate arrays (SCRATCH is never stored), and every addition is static code:
# the replicas' programs for a micro-batch (or the flush, or the choice of pending nodes) are
# grouped into the distinct ones, and a table indexed by the replica (and the micro-batch) picks
# its own: a `lax.switch` for the flush and the pending nodes, an elementwise select per register
# for a micro-batch's program, inside the loop (`_merged`). The cross phase is the same code on
# every replica. One stacked
# register file indexed at run time cost 4x this on XLA:CPU (a dynamic slice or update of the
# file per register access, and every replica doing every addition, scratch ones included):
# experiments/RESULTS.md, "The tree sum's device program".


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


def _run(regs: tuple, ops) -> tuple:
    """`ops` (dst, a, b: register ids) on the registers (register i is `regs[i - 1]`)."""
    regs = list(regs)
    for dst, a, b in ops:
        regs[dst - 1] = jax.tree.map(jnp.add, regs[a - 1], regs[b - 1])
    return tuple(regs)


def _select(index, branches, *args):
    """`branches[index](*args)`; static when there is one branch."""
    if len(branches) == 1:
        return branches[0](*args)
    return jax.lax.switch(index, branches, *args)


def _merged(index, branches, regs: tuple, x) -> tuple:
    """`branches[index](regs, x)` as one elementwise select per register: every branch's
    additions are traced, and each register takes its value from the branch `index` names (a
    register no branch changes is passed through). Inside the micro-batch loop a `lax.switch`
    over the programs came out with a copy of every live register into the loop's state after
    it, a gradient's worth each micro-batch; the selects update the registers in place. The
    same bits: the selected values are the branch's own (additions only, no contraction)."""
    if len(branches) == 1:
        return branches[0](regs, x)
    outs = [b(regs, x) for b in branches]

    def pick(i):
        cands = [o[i] for o in outs]
        if all(c is regs[i] for c in cands):
            return regs[i]
        return jax.tree.map(lambda *c: jax.lax.select_n(index, *c), *cands)

    return tuple(pick(i) for i in range(len(regs)))


class TreeSum:
    """`sched` on a mesh, for a pytree of values each replica computes per micro-batch.

    `specs` gives each value leaf's PartitionSpec without the data axis (its tensor sharding);
    the per-replica values passed to `step` are `[D, *leaf]`, sharded over `data` on axis 0.
    `init()` -> registers; `step(regs, values, k)` stores micro-batch k's values and does that
    step's additions; `finish(regs)` adds the replicas' pending nodes (the module docstring's
    cross phase) and returns the sum on every replica."""

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
        self._flush = _programs((D,), {r: _adds(sched.flush[r]) for r in range(D)})
        self._pending = _programs((D,), {r: tuple(int(i) for i in sched.pending[r])
                                         for r in range(D)})

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
            return _merged(table[jax.lax.axis_index(DATA), k], branches, regs, x)

        with jax.named_scope("tree_step"):
            return self._shard_map(local, regs, values, k,
                                   rest_specs=(self._val_specs, PartitionSpec()))

    def finish(self, regs: tuple, chunked: PyTree = None) -> PyTree:
        """The sum on every replica; a leaf whose entry in `chunked` (a pytree of bools shaped
        like the values, None: none) is True comes out as the replicas' chunks instead: `[D,
        1, c]` (`[D, rows, c]` for a leaf sharded over one mesh axis besides `data`), replica
        r's chunk being elements [r * c, (r + 1) * c) of its block flattened, where c = n / D
        (D must divide the block's n elements). That is a ZeRO storage tier of the leaf where
        the tier is the row cut in `data` equal parts (`storage.TierPlace.exact`): the
        gradient needs no gather before the optimizer (`step._deterministic_grad_fn`)."""
        sched, D = self.sched, self.D
        flush_tab, flush_progs = self._flush
        pend_tab, pend_progs = self._pending
        P = sched.pending.shape[1]
        spec_leaves, treedef = jax.tree.flatten(self.specs, is_leaf=self._is_spec)
        keep = ([False] * len(spec_leaves) if chunked is None
                else treedef.flatten_up_to(chunked))

        def cross_sum(xs, keep):
            """Each `xs[i]` [P, n_i] (one dtype: replica's pending nodes of leaf i) -> the sum
            [n_i], or this replica's chunk of it [c_i] where `keep[i]`. Every leaf is cut in D
            chunks of its own, so a replica's chunk of a leaf is one contiguous run of it."""
            ns = [x.shape[1] for x in xs]
            cs = [-(-n // D) for n in ns]  # elements per chunk; the last chunk padded
            # [destination, P, c] (a reshape where P = 1): each replica's chunks one contiguous
            # block, which the exchange sends as it is; split on the middle axis, XLA:CPU copied
            # every chunk out and the received ones back together (experiments/RESULTS.md,
            # "The cross phase per large leaf")
            parts = [jnp.pad(x, ((0, 0), (0, c * D - n))).reshape(P, D, c)
                     for x, n, c in zip(xs, ns, cs)]
            x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)
            x = jnp.swapaxes(x, 0, 1)
            # [source replica, P, C]: this replica's chunk of every replica's pending nodes
            x = jax.lax.all_to_all(x, DATA, 0, 0) if D > 1 else x
            table = [x[i // P, i % P] for i in range(D * P)]
            for _, a, b in sched.cross:  # the same additions on every replica
                table.append(table[a] + table[b])
            total = table[sched.root]
            at = np.concatenate([[0], np.cumsum(cs)])
            out = [total[at[i]: at[i + 1]] for i in range(len(xs))]
            gather = [i for i in range(len(xs)) if not keep[i]]
            if gather and D > 1:
                g = jnp.concatenate([out[i] for i in gather]) if len(gather) > 1 else out[gather[0]]
                g = jax.lax.all_gather(g, DATA)  # [D, sum of their c]
                off = 0
                for i in gather:
                    out[i] = g[:, off: off + cs[i]].reshape(-1)
                    off += cs[i]
            return [o if keep[i] else o[: ns[i]] for i, o in enumerate(out)]

        def summed(nodes):
            """The sum of every leaf from the P pending trees: a leaf of `packing.OWN_EXCHANGE`
            elements or more on its own, the smaller leaves of one dtype packed together (two
            collectives per group; one where all of a group's leaves stay chunked)."""
            leaves = [jax.tree.leaves(t) for t in nodes]
            out = [None] * len(leaves[0])
            for i, x in enumerate(leaves[0]):
                if keep[i] and x.size % D:
                    raise ValueError(f"leaf {i}: a block of {x.size} elements cannot be cut in "
                                     f"{D} equal chunks")
            for idx in packing.groups(leaves[0]):
                totals = cross_sum([jnp.stack([ls[i].reshape(-1) for ls in leaves]) for i in idx],
                                   [keep[i] for i in idx])
                for i, total in zip(idx, totals):
                    shape = leaves[0][i].shape[1:]
                    out[i] = total.reshape((1, 1, -1)) if keep[i] else total.reshape(shape)
            return jax.tree.unflatten(jax.tree.structure(nodes[0]), out)

        def local(regs):
            r = jax.lax.axis_index(DATA)
            regs = _select(jnp.asarray(flush_tab)[r],
                           [lambda R, ops=ops: _run(R, ops) for ops in flush_progs], regs)
            nodes = _select(jnp.asarray(pend_tab)[r],
                            [lambda R, ids=ids: tuple(R[i - 1] for i in ids) for ids in pend_progs],
                            regs)
            return summed(nodes)

        out = [chunk_spec(s) if k else s for s, k in zip(spec_leaves, keep)]
        with jax.named_scope("tree_finish"):
            return self._shard_map(local, regs, out=jax.tree.unflatten(treedef, out))


def chunk_spec(spec: PartitionSpec) -> PartitionSpec:
    """The PartitionSpec of a leaf's chunks `[D, rows, c]` (`TreeSum.finish`) for the leaf's
    own `spec` (without `data`): rows over the one other mesh axis it is sharded on, if any."""
    axes = [e for e in spec if e is not None]
    if len(axes) > 1 or any(isinstance(e, tuple) for e in axes):
        raise ValueError(f"a chunked leaf is sharded over at most one mesh axis; got {spec}")
    return PartitionSpec(DATA, axes[0] if axes else None, None)
