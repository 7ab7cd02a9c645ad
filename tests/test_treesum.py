"""The fixed-order tree sum of deterministic mode (`elasjax.core.treesum`), as numpy programs.

Every layout the planner deals (each replica count 1..K+2 over K canonical micro-batches, ranges
from `Plan.canonical_slots`) must give the tree's sum bit for bit, with at most
`register_bound(K)` registers: the memory bound does not depend on the replica count."""

import numpy as np
import pytest

from elasjax.core import packing, treesum
from elasjax.plan.planner import Plan


def slots(K: int, D: int) -> np.ndarray:
    """The planner's dealing of K canonical micro-batches (of one sample) over D replicas."""
    m = -(-K // D)
    plan = Plan(tuple(range(D)), D, 1, m, 1, K, canonical_micro=1)
    return plan.canonical_slots()


def pieces(lo: int, hi: int, K: int) -> int:
    """The tree's nodes that [lo, hi) is made of, the largest ones (a replica's pending nodes)."""
    def count(level, j):
        a, b = j << level, min((j + 1) << level, K)
        if lo <= a and b <= hi:
            return 1
        if b <= lo or hi <= a:
            return 0
        right = count(level - 1, 2 * j + 1) if ((2 * j + 1) << (level - 1)) < K else 0
        return count(level - 1, 2 * j) + right
    return count(treesum.tree_levels(K), 0)


def values(K: int, seed: int) -> np.ndarray:
    # magnitudes spread over 12 decades, so that any change of the addition order shows in the bits
    rng = np.random.default_rng(seed)
    scale = np.float32(10.0) ** rng.integers(-6, 6, (K, 1)).astype(np.float32)
    return rng.standard_normal((K, 4)).astype(np.float32) * scale


@pytest.mark.parametrize("K", [1, 2, 3, 5, 8, 13, 16, 31, 49, 64])
def test_every_dealing_gives_the_trees_bits_within_the_register_bound(K):
    x = values(K, K)
    ref = treesum.reference_sum(x)
    for D in range(1, K + 3):
        s = slots(K, D)
        sched = treesum.schedule(s)
        got = treesum.simulate(sched, s, x)
        assert got.view(np.uint32).tolist() == ref.view(np.uint32).tolist(), f"D={D}"
        assert sched.n_regs <= treesum.register_bound(K), f"D={D}: {sched.n_regs} registers"
        # a replica's pending nodes are the canonical pieces of its range; the cross phase adds
        # each node spanning two replicas once (one addition fewer than the pieces, in all)
        held = [[c for c in s[:, r] if c >= 0] for r in range(D)]
        n = [pieces(h[0], h[-1] + 1, K) if h else 0 for h in held]
        assert sched.pending.shape[1] == max(1, max(n)) <= max(1, 2 * treesum.tree_levels(K))
        assert len(sched.cross) == sum(n) - 1, (D, n, sched.cross)
    # a replica holding a whole subtree has one pending node: the fault-free layouts of powers
    # of two exchange one gradient per replica
    if K & (K - 1) == 0:
        for D in (d for d in range(1, K + 1) if K % d == 0):
            assert treesum.schedule(slots(K, D)).pending.shape[1] == 1, (K, D)


def test_the_tree_is_not_a_left_fold():
    # the reference is a balanced tree: with these values a left fold loses the small terms
    x = np.array([[1e8], [1.0], [-1e8], [1.0]], np.float32)
    assert treesum.reference_sum(x)[0] == np.float32(0.0)  # (1e8 + 1) + (-1e8 + 1) rounds to 0
    assert ((x[0] + x[1]) + x[2]) + x[3] == np.float32(1.0)


def test_padding_is_never_added():
    # `simulate` writes NaN for padding slots: a schedule that read one would return NaN
    K, D = 7, 3  # ranges 3, 2, 2: two padding slots
    s = slots(K, D)
    assert (s < 0).sum() == 2
    assert np.isfinite(treesum.simulate(treesum.schedule(s), s, values(K, 0))).all()


def test_bad_dealings_are_refused():
    with pytest.raises(ValueError, match="not one contiguous run"):
        treesum.schedule(np.array([[0, 1], [2, 3]]))  # rank 0 holds 0 and 2
    with pytest.raises(ValueError, match="out of 0..1 or dealt twice"):
        treesum.schedule(np.array([[0, 0]]))


@pytest.mark.parametrize("K,own,chunk", [(7, None, False), (8, None, False), (13, None, False),
                                         (13, 4, False), (8, None, True), (13, 4, True)])
def test_the_device_program_gives_the_trees_bits_on_every_replica_count(K, own, chunk,
                                                                        monkeypatch):
    """`TreeSum` on meshes of 1..8 replicas (the planner's dealings, padding slots included):
    every replica ends with the tree's sum of each leaf, bit for bit. With `own` = 4 the leaf of
    4 elements is exchanged on its own and the two of 3 packed together (`packing.OWN_EXCHANGE`);
    otherwise all three are packed. With `chunk`, each leaf whose size the replica count divides
    stays in the replicas' chunks (`finish(chunked=...)`, the ZeRO storage's form): replica r
    holds elements [r * c, (r + 1) * c) of the sum, gathered or not beside it in a group."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if own is not None:
        monkeypatch.setattr(packing, "OWN_EXCHANGE", own)
    x = values(K, K)
    parts = {"g": x, "h": x[:, :3], "k": x[:, 1:]}
    refs = {name: treesum.reference_sum(v) for name, v in parts.items()}
    for D in range(1, 9):
        s = slots(K, D)
        m = s.shape[0]
        mesh = Mesh(np.array(jax.devices()[:D]).reshape(D), ("data",))
        # the per-slot values [m, D, n]; padding slots hold NaN, which must never be added
        per = {name: np.where((s >= 0)[..., None], v[np.maximum(s, 0)], np.nan).astype(np.float32)
               for name, v in parts.items()}
        tree = treesum.TreeSum(treesum.schedule(s), mesh, {name: P() for name in parts})
        assert len(packing.groups([v[0] for v in parts.values()])) == (1 if own is None else 2)

        @jax.jit
        def run(v):
            def micro(regs, kv):
                k, xs = kv
                return tree.step(regs, tree.constrain(xs), k), None

            like = {name: jnp.zeros(a.shape[1:], jnp.float32) for name, a in parts.items()}
            regs, _ = jax.lax.scan(micro, tree.init(like), (jnp.arange(m, dtype=jnp.int32), v))
            kept = {name: chunk and a.shape[1] % D == 0 for name, a in parts.items()}
            return tree.finish(regs, kept if chunk else None), kept

        got, kept = run(jax.device_put(per, NamedSharding(mesh, P(None, "data"))))
        for name, ref in refs.items():
            if kept[name]:
                c = ref.size // D
                assert got[name].shape == (D, 1, c)
                assert got[name].sharding.is_equivalent_to(
                    NamedSharding(mesh, P("data", None, None)), 3), got[name].sharding
                for shard in got[name].addressable_shards:
                    r = shard.index[0].start or 0
                    assert (np.asarray(shard.data).reshape(-1).view(np.uint32).tolist()
                            == ref[r * c: (r + 1) * c].view(np.uint32).tolist()), (name, D)
                continue
            for shard in got[name].addressable_shards:  # the sum on every replica
                assert (np.asarray(shard.data).view(np.uint32).tolist()
                        == ref.view(np.uint32).tolist()), (name, D)
