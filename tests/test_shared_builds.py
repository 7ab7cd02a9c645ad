"""Compiling once per job (`elasjax.compilation.shared`): who compiles, who loads, and what a
process does when the compile it waits for will never come. The key-value store is a dict here;
the same protocol under `elasjax launch`, with real processes, is in tests/test_multiprocess.py
(`test_sigkill_one_of_four_processes_matches_the_single_process_run`)."""

import pickle
import threading
from types import SimpleNamespace

import pytest
from jax.errors import JaxRuntimeError

from elasjax.compilation.shared import SharedBuilds


class Store:
    """The coordination service's key-value calls that `SharedBuilds` makes."""

    def __init__(self):
        self.d: dict = {}
        self.cv = threading.Condition()

    def key_value_set(self, k, v, allow_overwrite=False):
        with self.cv:
            if k in self.d and not allow_overwrite:
                raise JaxRuntimeError(f"ALREADY_EXISTS: key {k} already exists.")
            self.d[k] = v
            self.cv.notify_all()

    key_value_set_bytes = key_value_set

    def key_value_try_get(self, k):
        with self.cv:
            if k not in self.d:
                raise JaxRuntimeError(f"NOT_FOUND: {k}")
            return self.d[k]

    key_value_try_get_bytes = key_value_try_get

    def blocking_key_value_get_bytes(self, k, ms):
        with self.cv:
            if not self.cv.wait_for(lambda: k in self.d, ms / 1000):
                raise JaxRuntimeError(f"DEADLINE_EXCEEDED: {k}")
            return self.d[k]


def _exe(who, portable_ok=True):
    return SimpleNamespace(who=who, portable_ok=portable_ok, compile_s=1.5, origin="compiled",
                           portable=lambda: ("payload", who))


def _builds(store, me, gone=lambda p: False):
    return SharedBuilds(store, me, gone, log=lambda m: None)


def _load(portable, compile_s):
    return SimpleNamespace(loaded=portable, compile_s=compile_s, origin="?")


def test_the_first_process_compiles_and_the_others_load_its_program():
    store = Store()
    a, b = _builds(store, 0), _builds(store, 1)
    mine = a.build("k", "plan", lambda: _exe(0), _load)
    assert mine.who == 0 and a.published == 1
    theirs = b.build("k", "plan", lambda: pytest.fail("compiled twice"), _load)
    assert theirs.loaded == ("payload", 0) and theirs.origin == "shared" and b.loaded == 1


def test_a_waiter_loads_the_program_once_its_holder_publishes_it():
    """The waiter's `waited_s` are the seconds from its wait's start to the program's
    publication, on a clock the test moves (a wall-clock threshold here failed whenever the
    waiter started late on a loaded machine); each wait is bounded generously."""
    store = Store()
    now = [0.0]
    a = _builds(store, 0)
    b = SharedBuilds(store, 1, lambda p: False, log=lambda m: None, clock=lambda: now[0])
    release, waiting = threading.Event(), threading.Event()

    def slow():
        assert release.wait(60)
        return _exe(0)

    def blocking_get(k, ms, get=store.blocking_key_value_get_bytes):  # only the waiter's
        waiting.set()
        return get(k, ms)

    store.blocking_key_value_get_bytes = blocking_get
    t = threading.Thread(target=a.build, args=("k", "plan", slow, _load))
    t.start()
    with store.cv:
        assert store.cv.wait_for(lambda: "elasjax/build/k/lease/0" in store.d, 60)
    got = []
    w = threading.Thread(target=lambda: got.append(b.build(
        "k", "plan", lambda: pytest.fail("compiled while the holder was alive"), _load)))
    w.start()
    assert waiting.wait(60)  # it waits for the holder's program
    now[0] = 0.5  # the holder's compile took 0.5 s of the waiter's wait
    release.set()
    t.join(60)
    w.join(60)
    (exe,) = got
    assert exe.loaded == ("payload", 0) and b.waited_s == 0.5 and b.loaded == 1


def test_a_holder_that_dies_before_publishing_hands_the_lease_on():
    store = Store()
    store.key_value_set("elasjax/build/k/lease/0", "2")  # process 2 took it, then died
    b = _builds(store, 1, gone=lambda p: p == 2)
    got = b.build("k", "plan", lambda: _exe(1), _load)
    assert got.who == 1 and store.d["elasjax/build/k/lease/1"] == "1" and b.published == 1
    # and a third process loads what the next generation's holder published
    c = _builds(store, 3, gone=lambda p: p == 2)
    assert c.build("k", "plan", lambda: pytest.fail("compiled twice"), _load).loaded == ("payload", 1)


def test_a_program_that_cannot_be_serialized_is_compiled_by_each_process():
    store = Store()
    a, b = _builds(store, 0), _builds(store, 1)
    assert a.build("k", "plan", lambda: _exe(0, portable_ok=False), _load).who == 0
    assert b.build("k", "plan", lambda: _exe(1), _load).who == 1 and b.compiled_alone == 1


def test_a_holder_whose_compile_raises_lets_the_others_compile_and_raises_itself():
    store = Store()
    a, b = _builds(store, 0), _builds(store, 1)

    def boom():
        raise ValueError("no memory")

    with pytest.raises(ValueError, match="no memory"):
        a.build("k", "plan", boom, _load)
    assert b.build("k", "plan", lambda: _exe(1), _load).who == 1 and b.compiled_alone == 1


def test_a_waiter_stops_waiting_when_its_run_ends():
    store = Store()
    store.key_value_set("elasjax/build/k/lease/0", "0")  # alive, never publishes
    b = _builds(store, 1)
    threading.Timer(0.3, b.close).start()
    with pytest.raises(RuntimeError, match="run is ending"):
        b.build("k", "plan", lambda: _exe(1), _load)


def test_the_key_is_the_same_for_equal_inputs_and_differs_otherwise():
    """Processes load their config each on its own: equal configs name the same program."""
    from conftest import tiny_config

    from elasjax.compilation.executables import ExecutableCache
    from elasjax.plan.planner import Topology, initial_plan

    cfg = tiny_config()
    plan = initial_plan(Topology(tuple(range(8)), 2), cfg)
    key = SharedBuilds.key(cfg, ExecutableCache.key(cfg, plan, False))
    again = tiny_config()
    assert SharedBuilds.key(again, ExecutableCache.key(again, plan, False)) == key
    assert SharedBuilds.key(cfg, ExecutableCache.key(cfg, plan, True)) != key
    other = tiny_config("model.d_mlp=128")
    assert SharedBuilds.key(other, ExecutableCache.key(other, plan, False)) != key


def test_where_a_program_stands_is_read_without_waiting():
    store = Store()
    a, b = _builds(store, 0, gone=lambda p: p == 2), _builds(store, 1, gone=lambda p: p == 2)
    assert a.state("k") == b.state("k") == "free"
    store.key_value_set("elasjax/build/k/lease/0", "0")  # process 0 compiles it
    assert a.state("k") == "free" and b.state("k") == "claimed"
    store.key_value_set_bytes("elasjax/build/k/exe", pickle.dumps((("payload", 0), 1.5)))
    assert a.state("k") == b.state("k") == "published"
    store.key_value_set("elasjax/build/j/lease/0", "2")  # its holder died before publishing
    assert b.state("j") == "free"
    store.key_value_set("elasjax/build/j/lease/1", "0")  # the next generation's holder lives
    assert b.state("j") == "claimed"


def _plan(name, ids):
    return SimpleNamespace(name=name, device_ids=tuple(ids))


def _standby_order(last: str, by_program: bool) -> list[str]:
    """`ExecutableSource.standby_order` of five plans (one published, one another process is
    compiling, this process's own death's, two it takes part in, the second named `last`)."""
    from elasjax.compilation.source import ExecutableSource

    states = {"pub": "published", "busy": "claimed"}
    src = SimpleNamespace(shared=SimpleNamespace(state=lambda key: states.get(key, "free")),
                          _shared_key=lambda p: p.name, _by_program=lambda p: by_program)
    plans = [_plan("busy", [0, 1]), _plan("own death", [100, 101]), _plan("a", [0, 1]),
             _plan(last, [2, 3]), _plan("pub", [0, 1])]
    return [p.name for p in ExecutableSource.standby_order(src, plans)]


def test_processes_start_their_standby_on_different_plans_and_leave_their_own_death_last():
    """`ExecutableSource.standby_order` (this test process is process 0 and holds devices 0-7):
    what another process published comes first (a load), then what nobody builds, the plans
    this process takes part in before its own death's, and last what another live process is
    compiling now."""
    assert _standby_order("b", by_program=False) == ["pub", "a", "b", "own death", "busy"]


def test_where_builds_are_named_by_program_the_standby_takes_them_in_the_queues_order():
    """Named by program, a compile serves every device set, the process's own death's too: what
    nobody builds is taken in the queue's order (the plans of one more failure first, then
    those of a second: `standby.depth`), not the process's own plans first."""
    assert _standby_order("second failure", by_program=True) == [
        "pub", "own death", "a", "second failure", "busy"]


def test_the_standby_takes_its_compiles_in_the_order_it_is_given():
    from elasjax.compilation.standby import StandbyCompiler

    built = []
    sb = StandbyCompiler(lambda plan: built.append(plan) or plan,
                         order=lambda plans: sorted(plans, reverse=True))
    try:
        sb.submit(["p1", "p2", "p3", "p4"])  # queued at once: the thread sees all four
        assert sb.wait_all(timeout=10)
    finally:
        sb.close()
    assert built == ["p4", "p3", "p2", "p1"]


def test_the_standby_orders_its_queue_outside_its_lock():
    """`order` may read the job's key-value store (`ExecutableSource.standby_order`): another
    thread (a recovery's `expedite`) takes the standby's lock meanwhile without waiting."""
    import threading

    from elasjax.compilation.standby import StandbyCompiler

    got_lock = []

    def order(plans):
        def take():
            got = sb._cv.acquire(timeout=5)
            if got:
                sb._cv.release()
            got_lock.append(got)
        t = threading.Thread(target=take)
        t.start()
        t.join()
        return sorted(plans)

    sb = StandbyCompiler(lambda plan: plan, order=order)
    try:
        sb.submit(["p1", "p2"])
        assert sb.wait_all(timeout=20)
    finally:
        sb.close()
    assert got_lock and all(got_lock), got_lock


def test_one_shared_build_serves_every_device_set_of_a_program_where_programs_rebind():
    """`ExecutableSource._shared_key`: with `standby.rebind` on a backend whose programs load
    onto other devices, the plans after losing device 0 and device 7 (one program on two device
    sets) share one name in the job's builds, so one process compiles it and every other loads
    it by position; without rebinding each plan is its own."""
    import jax
    from conftest import tiny_config

    from elasjax.compilation.source import ExecutableSource
    from elasjax.plan.planner import Topology, initial_plan, replan

    devices = {d.id: d for d in jax.devices()}
    for rebind, same in ((True, True), (False, False)):
        cfg = tiny_config(f"standby.rebind={str(rebind).lower()}")
        topo = Topology(tuple(range(8)), 2)
        start = initial_plan(topo, cfg)
        a = replan(list(range(1, 8)), topo, cfg, start, start)
        b = replan(list(range(7)), topo, cfg, start, start)
        assert a.shape_key == b.shape_key and a.device_ids != b.device_ids
        src = SimpleNamespace(cfg=cfg, devices=devices, donate=False, _shared_keys={},
                              shared=SimpleNamespace(key=SharedBuilds.key),
                              factory=SimpleNamespace(tx_key=None))
        src._by_program = lambda p, src=src: ExecutableSource._by_program(src, p)
        src._program = lambda p, src=src: ExecutableSource._program(src, p)
        keys = [ExecutableSource._shared_key(src, p) for p in (a, b)]
        assert (keys[0] == keys[1]) is same, (rebind, keys)


def test_a_compile_worker_builds_for_a_launch_job_only_where_it_shares_its_compiles():
    """`worker.unavailable`: under launch the worker's programs reach the other processes
    through the shared builds; without them a worker is not used there."""
    from conftest import tiny_config

    from elasjax.compilation.worker import unavailable

    cfg = tiny_config()
    assert unavailable(cfg, False, multi_process=True, shared=True) is None
    assert "share_compiles" in unavailable(cfg, False, multi_process=True, shared=False)
    assert unavailable(cfg, False, multi_process=False) is None
