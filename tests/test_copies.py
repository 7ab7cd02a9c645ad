"""`snapshot.copies: k`: k buddy copies of each unique shard on k different hosts, none the
holder's, so that any k hosts failing together leave one; on the pieces (`ElasticState`), in the
coverage they report, and in the loop."""

import itertools

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import elasjax
from elasjax import config
from elasjax.loop import trainer
from elasjax.config import ConfigError, SnapshotConfig
from elasjax.observe.metrics import read_jsonl
from elasjax.plan.planner import Topology
from elasjax.runtime.inprocess import InProcessRuntime
from elasjax.transfer.snapshot import SnapshotPool


def _state(tx):
    w = {
        "w1": jnp.linspace(-1, 1, 24 * 32, dtype=jnp.float32).reshape(24, 32),
        "w2": jnp.linspace(-2, 2, 32 * 12, dtype=jnp.float32).reshape(32, 12),
    }
    return {"params": w, "opt": tx.init(w), "step": jnp.asarray(7, jnp.int32)}


def _layout(mesh, state):
    """ZeRO-1 over data: the Adam moments partitioned over `data` on top of the model split."""
    rep = NamedSharding(mesh, P())
    p = {"w1": NamedSharding(mesh, P(None, "model")), "w2": NamedSharding(mesh, P("model", None))}
    opt = jax.tree.map(lambda _: rep, state["opt"])
    opt = (opt[0]._replace(mu=p, nu=p), *opt[1:])
    opt, left = elasjax.partition_over(opt, state["opt"], "data")
    assert left == []
    return {"params": p, "opt": opt, "step": rep}


def _advance(state):
    return {
        "params": jax.tree.map(lambda x: x * 1.5 + 0.25, state["params"]),
        "opt": jax.tree.map(lambda x: x + 1, state["opt"]),
        "step": state["step"] + 1,
    }


def _elastic(snapshot: SnapshotConfig) -> elasjax.ElasticState:
    """data 4 x model 2 on 8 devices, 4 hosts of 2 devices, step 0 committed."""
    state = _state(optax.adam(1e-2))
    mesh, _ = elasjax.plan_mesh(jax.devices(), {"data": -1, "model": 2})
    es = elasjax.ElasticState(state, lambda m: _layout(m, state), mesh, devices_per_host=2,
                              snapshot=snapshot)
    es.commit(es.state, 0)
    return es


TWO = SnapshotConfig(buddy=True, host=False, copies=2)


@pytest.mark.parametrize("copies", [1, 2])
def test_two_buddy_copies_survive_device_3_then_devices_0_and_6(copies):
    """The schedule of issue 34 with buddy copies only: device 3 fails, then devices 0 and 6
    together. One copy per shard loses the partition whose only copy was on device 0; two
    copies on two other hosts recover it, bitwise (the checksums of every leaf agree)."""
    es = _elastic(SnapshotConfig(buddy=True, host=False, copies=copies))
    step = jax.jit(_advance, out_shardings=es.shardings())
    es.commit(step(es.state), 1)
    es.simulate_failure([3])
    assert es.recover().verify["leaves"] == len(es.committed_checksums())
    new = jax.jit(_advance, out_shardings=es.shardings())(es.state)
    es.commit(new, 2)
    before = elasjax.state_checksums(new)
    es.simulate_failure([0, 6])
    if copies == 1:
        with pytest.raises(elasjax.UnrecoverableStateError,
                           match=r"state leaf 'opt/.+' slice \[.+\] has no live copy.*copies=2"):
            es.recover()
    else:
        rec = es.recover()
        assert rec.step == 2 and rec.rung == "buddy"
        assert rec.verify["digest_after"] == elasjax.transfer.checksum.digest(before)
        assert elasjax.state_checksums(es.state) == before
    es.close()


def test_copies_go_to_distinct_hosts_other_than_the_holders():
    for k in (1, 2, 3):
        es = _elastic(SnapshotConfig(buddy=True, host=False, copies=k))
        by_shard: dict = {}
        for r in es.pool.records:
            by_shard.setdefault((r.path, r.box, r.holder), []).append(r)
        assert by_shard
        topo = es.topology
        for (_, _, holder), recs in by_shard.items():
            hosts = [topo.host_of(r.buddy) for r in recs]
            assert sorted(r.copy for r in recs) == list(range(k))
            assert len(set(hosts)) == k and topo.host_of(holder) not in hosts
        one = sum(r.nbytes for r in es.pool.records if r.copy == 0)
        assert es.pool.bytes_per_step == k * one
        assert f"buddy copies x{k}" in es.pool.cost_line() and "estimate" in es.pool.cost_line()
        es.close()


def test_coverage_with_two_copies_matches_brute_force_and_survives_every_host_pair():
    """With copies=2 (buddy copies only) every single and double failure of the 8 devices is
    survived, host pairs included; each failure set is then run to confirm it."""
    cov = _elastic(TWO).coverage()
    assert cov.single_devices and cov.single_hosts and cov.device_pairs and cov.host_pairs
    assert cov.lost == {}
    assert str(cov).startswith("survives: every single device yes; every single host yes; "
                               "every device pair yes; every host pair yes (8 devices, 4 hosts)")
    one = _elastic(SnapshotConfig(buddy=True, host=False)).coverage()
    assert one.host_pairs is False and one.lost  # what the second copy adds
    sets = [(d,) for d in range(8)] + list(itertools.combinations(range(8), 2))
    sets += [(0, 1, 2, 3), (2, 3, 6, 7)]  # two whole hosts
    for fs in sets:
        es = _elastic(TWO)
        es.simulate_failure(fs)
        assert es.recover().verify["leaves"] == len(es.committed_checksums()), fs
        es.close()


def test_coverage_with_two_copies_names_triple_host_losses_it_does_not_survive():
    """Three hosts failing together can take a holder and both its copies: `coverage` is
    checked against running such a set (it is not among the pairs `coverage` enumerates, so
    the pool's own description of the failure decides)."""
    from elasjax.transfer.coverage import loses
    from elasjax.transfer.shards import describe_state

    es = _elastic(TWO)
    fs = (0, 1, 2, 3, 4, 5)  # hosts 0, 1, 2: host 0's shards had copies on hosts 1 and 2
    what = loses(describe_state(es.state), es.pool, es.topology, set(fs))
    assert what is not None and what.startswith("'opt/0/")
    es.simulate_failure(fs)
    with pytest.raises(elasjax.UnrecoverableStateError, match=r"state leaf 'opt/0/.+' slice \[") as e:
        es.recover()
    assert what.startswith(f"'{e.value.leaf}' "), (what, e.value)  # the leaf coverage named
    es.close()


@pytest.mark.parametrize("cfg, n_hosts, match", [
    (SnapshotConfig(copies=0), 4, r"'snapshot.copies' = 0; allowed values: an integer >= 1"),
    (SnapshotConfig(buddy=True, copies=4), 4,
     r"'snapshot.copies' = 4 .* allowed values here: 1 \.\. 3"),
    (SnapshotConfig(copies=2), 1,
     r"'snapshot.copies' = 2 .* 1 host\(s\); allowed values here: 1 \.\. 1"),
    (SnapshotConfig(buddy=False, host=True, copies=2), 4,
     r"'snapshot.copies' = 2 .* 'snapshot.buddy' is false; allowed values with buddy: false: "
     r"copies = 1"),
])
def test_copies_out_of_range_is_an_error_naming_the_field_and_range(cfg, n_hosts, match):
    topo = Topology(tuple(range(8)), 8 // n_hosts)
    with pytest.raises(ConfigError, match=match):
        SnapshotPool(cfg, topo, InProcessRuntime(topology=topo))


def test_copies_in_a_config_file_are_checked_and_resolved():
    with pytest.raises(ConfigError, match=r"'snapshot.copies' = 0; allowed values"):
        tiny_config("snapshot.copies=0")
    with pytest.raises(ConfigError, match=r"'snapshot.copies' = 2 asks for buddy copies"):
        tiny_config("snapshot.buddy=false", "snapshot.copies=2")
    cfg = tiny_config("snapshot.host=true", "snapshot.copies=2")  # copies > 1: buddy copies on
    assert cfg.snapshot.resolved(4, 8) == SnapshotConfig(buddy=True, host=True, copies=2)
    assert config.SnapshotConfig().resolved(4, 8).copies == 1


LOOP = ["train.steps=6", "parallel.tensor=1", "parallel.data=8", "zero.stage=1",
        "snapshot.buddy=true", "snapshot.host=false"]


@pytest.mark.slow
def test_the_loop_with_two_copies_survives_two_hosts_failing_together(exe_cache, tmp_path):
    """ZeRO-1 over data 8 (every device holds a partition no one else has), hosts 1 and 2 fail
    together at step 3. With one copy, host 1's partitions had theirs on host 2: the run stops
    with UnrecoverableStateError. With `snapshot.copies: 2` they also have one on host 3, and
    the run matches the fault-free one. The error explains itself: the holders, the copies,
    the failure that took them, the setting that would have kept the slice."""
    double = "faults=[{at_step: 3, hosts: [1, 2]}]"
    explained = (r"held by devices \[2, 3\] \(hosts \[1\]\); buddy copies on devices \[4, 5\]; "
                 r"no host copy; devices \[2, 3, 4, 5\] failed, taking all of them.*"
                 r"kept by snapshot.buddy=true, snapshot.copies=2")
    with pytest.raises(elasjax.UnrecoverableStateError, match=explained):
        trainer.run(tiny_config(*LOOP, double), exe_cache=exe_cache)
    ref = trainer.run(tiny_config(*LOOP, "snapshot.copies=2", "faults=[]"), exe_cache=exe_cache)
    s = trainer.run(tiny_config(*LOOP, "snapshot.copies=2", double), tmp_path,
                    exe_cache=exe_cache)
    (rec,) = s.recoveries
    assert rec.rung == "buddy" and rec.steps_lost == 0 and rec.verify["leaves"] > 0
    for step in range(6):
        assert abs(s.losses[step] - ref.losses[step]) <= 1e-5 * ref.losses[step], step
    start = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["type"] == "start"]
    assert start[0]["snapshot"]["copies"] == 2
    # what `elasjax plan --coverage` says of this plan agrees with the two runs
    hosts_1_2 = (2, 3, 4, 5)
    assert hosts_1_2 in _loop_coverage(tiny_config(*LOOP))[0].lost
    assert hosts_1_2 not in _loop_coverage(tiny_config(*LOOP, "snapshot.copies=2"))[0].lost


def _loop_coverage(cfg):
    from elasjax.plan.planner import initial_plan
    from elasjax.loop.recovery import plan_coverage

    topo = Topology(tuple(range(8)), cfg.parallel.devices_per_host)
    return plan_coverage(cfg, initial_plan(topo, cfg), topo, set(range(8)),
                         {d.id: d for d in jax.devices()})


def test_plan_coverage_prints_the_loop_plans_coverage(capsys):
    """`elasjax plan CONFIG --coverage`: the coverage of the start plan and of the plan after
    each failure of the schedule, in `Coverage`'s words, with the snapshot settings as the loop
    resolves them. The demo (tensor slices replicated over data replicas on other hosts) holds no
    unique shard; ZeRO-1 with one buddy copy loses a partition when its holder's host and its
    buddy's host fail together, and two copies survive every host pair."""
    from elasjax import cli

    assert cli.main(["plan", "configs/demo.yaml", "--coverage"]) == 0
    out = capsys.readouterr().out
    demo = config.load("configs/demo.yaml")
    cov, pool = _loop_coverage(demo)
    assert str(cov).splitlines()[0] in out and pool.cost_line(demo.hardware) in out
    assert "(snapshot: buddy true, host false, copies 1, automatic; 2 devices per host)" in out
    # the start plan and one coverage per failure of the schedule
    assert out.count("survives: every single device yes; every single host yes; every device "
                     "pair yes; every host pair yes") == 1 + len(demo.faults)
    assert "step 10: devices [3] fail (7 live)" in out and "step 20: hosts [0] fail (5 live)" in out

    zero = ["--set", "faults=[]", "--set", "snapshot.host=false"]
    for copies, pairs in [(1, "no"), (2, "yes")]:
        assert cli.main(["plan", "configs/demo_zero.yaml", "--coverage", *zero,
                         "--set", f"snapshot.copies={copies}"]) == 0
        out = capsys.readouterr().out
        assert f"every single host yes; every device pair {pairs}; every host pair {pairs}" in out
        assert f"buddy copies x{copies}" in out and "an estimate at hardware" in out
    assert cli.main(["plan", "configs/demo_zero.yaml", "--coverage", *zero,
                     "--set", "snapshot.copies=4"]) == 2
    assert "'snapshot.copies' = 4 needs 4 hosts" in capsys.readouterr().err
