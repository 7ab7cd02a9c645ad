"""Transitions rebuild the state on a new mesh from live shards only, exactly."""

import jax
import numpy as np
import pytest
from conftest import tiny_config

from elasjax.plan import planner
from elasjax.runtime.faults import inject
from elasjax.core.mesh import make_mesh
from elasjax.core.sharding import path_str
from elasjax.layout.state import StateFactory, make_optimizer
from elasjax.transfer.reshard import transition
from elasjax.transfer.shards import ShardStore, UnrecoverableStateError

CFG = tiny_config()
TOPO = planner.Topology(tuple(range(8)), 2)
DEVS = {d.id: d for d in jax.devices()}


@pytest.fixture(scope="module")
def factory():
    return StateFactory(CFG, make_optimizer(CFG))


def _mesh(plan):
    return make_mesh(plan.mesh_shape, [DEVS[i] for i in plan.device_ids])


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _check_log(log, failed, shardings, state):
    assert log.entries
    assert not log.sources() & set(failed), "a transfer read a failed device"
    # every destination shard is covered exactly once by its pieces
    covered = {}
    for t in log.entries:
        covered.setdefault((t.leaf, t.dst), 0)
        covered[(t.leaf, t.dst)] += t.nbytes
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        for s in x.addressable_shards:
            assert covered[(path_str(path), s.device.id)] == s.data.nbytes


def test_device_then_host_then_device(factory):
    init = planner.initial_plan(TOPO, CFG)
    state = factory.init(_mesh(init))
    ref = _host(state)
    plan, live = init, set(TOPO.device_ids)
    for failed in ([3], [0, 1], [5, 6]):
        store = ShardStore.capture(state)
        doomed = [s.data for leaf in store.shards for s in leaf if s.device in failed]
        assert store.fail(failed) == sum(x.nbytes for x in doomed) > 0
        assert all(x.is_deleted() for x in doomed)  # their memory is gone
        assert not store.devices() & set(failed)
        live -= set(failed)
        plan = planner.replan(sorted(live), TOPO, CFG, plan, init)
        assert plan.n_devices == len(live)
        sh = factory.shardings(_mesh(plan))
        state, log = transition(store, sh)
        _check_log(log, failed, sh, state)
        jax.tree.map(np.testing.assert_array_equal, _host(state), ref)
        for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(sh)):
            assert x.sharding == s
    assert plan.n_devices == 3


def test_tensor_change_moves_the_missing_halves(factory):
    init = planner.initial_plan(TOPO, CFG)
    state = factory.init(_mesh(init))
    ref = jax.tree.leaves(_host(state))
    store, _ = inject(state, (3,))
    plan = planner.replan([0, 1, 2, 4, 5, 6, 7], TOPO, CFG, init, init)
    assert plan.tensor == 1
    new, log = transition(store, factory.shardings(_mesh(plan)))
    # Each of the 7 destinations already holds one tensor half of every tensor-sharded leaf and
    # receives the other half: moved bytes = 7 x half of the tensor-sharded bytes.
    tensor_sharded = sum(
        x.size * x.dtype.itemsize
        for x, s in zip(jax.tree.leaves(factory.abstract), jax.tree.leaves(factory.shardings(_mesh(init))))
        if "tensor" in s.spec
    )
    assert log.bytes_moved == 7 * tensor_sharded // 2
    assert all(t.src != t.dst for t in log.moved)
    # every replica holds the data; the replicas of a box share one host buffer (as a
    # replicated device_put of a numpy array does on CPU), which a step that donates its input
    # must not write through: every device's output is computed from the old values
    step = jax.jit(lambda t: jax.tree.map(lambda a: a * 2 + 1 if a.dtype == np.float32 else a, t),
                   donate_argnums=0)
    for x, want in zip(jax.tree.leaves(new), ref):
        for s in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), want[s.index])
    shared = [x for x in jax.tree.leaves(new) if x.dtype == np.float32 and x.sharding.is_fully_replicated
              and len({s.data.unsafe_buffer_pointer() for s in x.addressable_shards}) == 1]
    assert shared  # the tensor-sharded leaves, now replicated over 7 devices
    out = step(new)
    for x, want in zip(jax.tree.leaves(out), ref):
        if x.dtype == np.float32:
            for s in x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(s.data), want[s.index] * 2 + 1)


def test_replicated_state_moves_nothing_on_host_loss(factory):
    init = planner.initial_plan(TOPO, CFG)
    p7 = planner.plan_for_shape([0, 1, 2, 4, 5, 6, 7], TOPO, CFG, data=7, tensor=1)
    state = factory.init(_mesh(p7))
    store, _ = inject(state, (0, 1))
    p5 = planner.replan([2, 4, 5, 6, 7], TOPO, CFG, p7, init)
    assert set(p5.device_ids) <= set(p7.device_ids)
    _, log = transition(store, factory.shardings(_mesh(p5)))
    assert log.bytes_moved == 0 and log.transfers == 0


def test_slice_without_live_copy_is_unrecoverable(factory):
    init = planner.initial_plan(TOPO, CFG)
    state = factory.init(_mesh(init))
    store, _ = inject(state, (0, 2, 4, 6))  # every holder of tensor slice 0
    plan = planner.replan([1, 3, 5, 7], TOPO, CFG, init, init)
    with pytest.raises(UnrecoverableStateError, match=r"state leaf '.*' slice \[.*\] has no live copy"):
        transition(store, factory.shardings(_mesh(plan)))
