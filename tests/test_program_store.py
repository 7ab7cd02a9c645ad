"""The program store (`standby.programs_dir`, `elasjax.compilation.store`): a plan compiled once is
loaded by the next process that needs its program, on any device set of its shape, with the bits
of a compile; what it cannot read it compiles again; what it keeps stays under its size."""

import jax
import numpy as np
import pytest
from conftest import tiny_config

from elasjax.loop import trainer
from elasjax.compilation.executables import ExecutableCache, compile_plan, from_portable, rebind
from elasjax.compilation.store import ProgramStore
from elasjax.core.counters import CompileCounter
from elasjax.plan.planner import replan


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config("faults=[]")
    t = trainer.Trainer(cfg, None, exe_cache=ExecutableCache())
    live = list(t.topo.device_ids)
    a = replan(live[1:], t.topo, cfg, t.initial, t.initial)
    b = replan(live[:-1], t.topo, cfg, t.initial, t.initial)
    assert a.shape_key == b.shape_key and a.device_ids != b.device_ids
    yield cfg, t, a, b
    t.rt.close()


def test_a_stored_program_loads_on_another_device_set_with_the_bits_of_a_compile(setup, tmp_path):
    cfg, t, a, b = setup
    store = ProgramStore(tmp_path)
    first = compile_plan(cfg, t.factory, a, t.devices, donate=False, store=store)
    assert first.origin == "compiled" and store.stored == 1
    assert len(list(tmp_path.glob("*.pkl"))) == 1
    # another process (here: a fresh store object) needing the program on b's devices
    again = ProgramStore(tmp_path)
    with CompileCounter() as cc:
        got = compile_plan(cfg, t.factory, b, t.devices, donate=False, store=again)
    assert cc.count == 0 and got.origin == "stored" and again.loaded == 1
    assert [d.id for d in got.mesh.devices.flat] == list(b.device_ids)
    assert got.portable_ok  # its serialized form came along: it can be rebound and shipped
    native = rebind(first, b, t.devices)
    state = native.init()
    batch = native.put_batch(t.data.batch(0, b).arrays())
    x, y = native.train(state, batch), got.train(state, batch)
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(native.checksum(state)), np.asarray(got.checksum(state)))
    # another program (donation changes the module) is its own entry
    compile_plan(cfg, t.factory, a, t.devices, donate=True, store=again)
    assert again.stored == 1 and len(list(tmp_path.glob("*.pkl"))) == 2


def test_the_fresh_states_program_travels_with_the_plans_and_loads_without_a_compile(setup):
    """Under launch the process that compiles the start plan compiles the fresh state's program
    with it and publishes both; the others load it (`ExecutableSource.start`): loaded onto
    another device set of the program's shape, it compiles nothing and makes the state a
    compile there makes, bit for bit."""
    cfg, t, a, b = setup
    first = compile_plan(cfg, t.factory, a, t.devices, donate=False)
    assert first.portable().init is None  # not compiled yet: nothing to carry
    first.compile_init()
    src = first.portable()
    assert src.init is not None and src.train == first.portable().train
    got = from_portable(cfg, t.factory, b, t.devices, src, 0.0)
    with CompileCounter() as cc:
        got.compile_init()
        state = got.init()
    assert cc.count == 0
    want = compile_plan(cfg, t.factory, b, t.devices, donate=False).init()
    for u, v in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        assert u.sharding.is_equivalent_to(v.sharding, u.ndim)
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_a_start_compiles_its_programs_side_by_side_counted_as_its_own_and_stores_no_init(
        setup, tmp_path):
    """`compile_plan(init=True, beside=True)` (a fresh start's plan, a core idle) compiles the
    checksum, evaluation and fresh-state programs on a thread beside the train program: every
    compile still counts as the caller's (`CompileCounter`: a recovery proves with it that it
    compiled nothing), the
    fresh state is the one `compile_init` makes, and the store keeps no fresh-state program
    (its initial values are baked in, and the store's key names the train and checksum
    programs only)."""
    _, t, a, b = setup
    cfg = tiny_config("faults=[]", "train.eval_every=2")  # a run that evaluates
    store = ProgramStore(tmp_path)
    with CompileCounter() as cc:
        exe = compile_plan(cfg, t.factory, a, t.devices, donate=False, store=store,
                           evaluate=True, init=True, beside=True)
    # train on this thread; checksum, evaluation and fresh state beside it
    assert cc.count == 4 and exe._init is not None and exe._eval_exe is not None
    assert store.get(next(iter(p.stem for p in tmp_path.glob("*.pkl")))).init is None
    want = compile_plan(cfg, t.factory, a, t.devices, donate=False)
    want.compile_init()
    for u, v in zip(jax.tree.leaves(exe.init()), jax.tree.leaves(want.init()), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    # loaded from the store, its fresh state's program is compiled where it runs, not loaded
    got = compile_plan(cfg, t.factory, a, t.devices, donate=False, store=ProgramStore(tmp_path),
                       evaluate=True, init=True)
    assert got.origin == "stored" and got._init is None
    for u, v in zip(jax.tree.leaves(got.init()), jax.tree.leaves(want.init()), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_an_unreadable_entry_is_deleted_and_the_plan_compiled(setup, tmp_path):
    cfg, t, a, _ = setup
    store = ProgramStore(tmp_path)
    compile_plan(cfg, t.factory, a, t.devices, donate=False, store=store)
    (entry,) = tmp_path.glob("*.pkl")
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    with CompileCounter() as cc:
        got = compile_plan(cfg, t.factory, a, t.devices, donate=False, store=store)
    assert cc.count > 0 and got.origin == "compiled" and store.unreadable == 1
    assert entry.exists() and entry.stat().st_size > 100  # written whole again


def test_the_key_follows_what_the_compiled_code_depends_on(monkeypatch, tmp_path):
    store = ProgramStore(tmp_path)
    device = jax.devices()[0]
    k = store.key(["module"], device)
    assert store.key(["module"], device) == k
    assert store.key(["other module"], device) != k
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert store.key(["module"], device) != k


def test_the_store_keeps_under_its_size_dropping_the_entries_read_longest_ago(tmp_path):
    import os
    import time

    from elasjax.compilation.executables import Portable

    store = ProgramStore(tmp_path, max_mb=0.25)
    blob = Portable((0,), (b"x" * 100_000, None, None), (b"", None, None))
    store.put("old", blob)
    store.put("read", blob)
    past = time.time() - 100
    os.utime(tmp_path / "old.pkl", (past, past))
    os.utime(tmp_path / "read.pkl", (past - 1, past - 1))
    assert store.get("read") is not None  # read now: kept
    store.put("new", blob)
    assert sorted(p.stem for p in tmp_path.glob("*.pkl")) == ["new", "read"]


def test_a_bad_store_setting_is_refused_naming_the_field():
    from elasjax.config import ConfigError

    with pytest.raises(ConfigError, match="standby.programs_max_mb"):
        tiny_config("standby.programs_max_mb=0")
    assert ProgramStore.from_setting(None, 1.0) is None


def test_what_the_compile_worker_stores_the_training_process_loads(setup, tmp_path):
    """The worker child sizes its client by a JAX setting where the training process used
    `XLA_FLAGS`; neither is in the key, so each finds the other's entries (a second run of the
    demo compiled in its worker what its first run had stored: experiments/RESULTS.md)."""
    from elasjax.compilation.worker import CompileWorker

    cfg, t, a, _ = setup
    wcfg = tiny_config("faults=[]", f"standby.programs_dir={tmp_path}")
    w = CompileWorker(wcfg)
    try:
        w.compile(a, False)
    finally:
        w.close()
    assert len(list(tmp_path.glob("*.pkl"))) == 1
    store = ProgramStore(tmp_path)
    with CompileCounter() as cc:
        got = compile_plan(cfg, t.factory, a, t.devices, donate=False, store=store)
    assert got.origin == "stored" and cc.count == 0 and store.loaded == 1
