"""Invariants of the cluster simulator (elasjax.sim): pure numpy, no JAX devices needed."""

import dataclasses

import numpy as np
import pytest

from elasjax.config import ConfigError
from elasjax.config import HardwareConfig
from elasjax.models.costmodel import bubble_fraction, pipeline_step_cost, ring_allreduce_s
from elasjax.core.partition import minimax_partition
from elasjax.sim import settings as simconfig
from elasjax.sim.cluster import Layout, greedy_spread_reference, make_group, spread_microbatches
from elasjax.sim.dvfs import PowerModel, balance, stage_time
from elasjax.sim.hardware import ascend910
from elasjax.sim.hetplan import plan_heterogeneous
from elasjax.sim.run import post_change_study
from elasjax.sim.scenario import Scenario
from elasjax.sim.spares import simulate_policy
from elasjax.sim.strategies import STRATEGIES, failure_free, ideal_tokens_per_s
from elasjax.sim.timeline import simulate
from elasjax.sim.traces import TraceEvent, TraceParams, make_trace
from elasjax.sim.workload import GptDims

DIMS = GptDims(n_layers=10, d_model=256, n_heads=8, d_mlp=1024, vocab_size=1000, seq_len=128)
PRESERVING = ("elaswave", "elaswave_no_dvfs", "recycle", "oobleck", "elasjax_spmd",
              "checkpoint_restart")


def make_scenario(data=4, stage=3, tensor=2, host=4, micro=6, **kw) -> Scenario:
    dev = dataclasses.replace(ascend910(), devices_per_host=host)
    power = PowerModel(dev.power_w, dev.static_fraction, dev.f_min, dev.f_max)
    return Scenario(Layout(data, stage, tensor, host), DIMS, dev, 1, micro, power, **kw)


def analytic_step(sc: Scenario) -> float:
    """The failure-free step computed from first principles, independently of sim.cluster."""
    w = sc.workload()
    S, D = sc.layout.stage, sc.layout.data
    part = minimax_partition(w.cost(), S, layer_mem=w.layer_mem(D, S), stage_mem_cap=sc.mem_cap())
    owner = np.repeat(np.arange(S), part.sizes)
    times = np.bincount(owner, weights=w.cost()) + (w.p2p_s if S > 1 else 0.0)
    grads = np.bincount(owner, weights=np.asarray(w.params, float) * 2 / sc.layout.tensor)
    hw = HardwareConfig(link_bw=sc.device.inter_host_bw, link_latency_s=sc.device.link_latency_s)
    sync = max(ring_allreduce_s(g, D, hw) for g in grads)
    return pipeline_step_cost(times, sc.microbatches, dp_sync_s=sync).total_s


def random_failures(sc, k, seed):
    return np.random.default_rng(seed).choice(sc.layout.n_devices, k, replace=False)


def test_pipeline_step_cost_matches_textbook_1f1b():
    assert pipeline_step_cost([2.0] * 4, 8).pipeline_s == pytest.approx((8 + 4 - 1) * 2.0)
    c = pipeline_step_cost([1.0, 3.0, 2.0], 5, dp_sync_s=0.5)
    assert c.pipeline_s == pytest.approx(6.0 + 4 * 3.0) and c.total_s == pytest.approx(18.5)
    assert pipeline_step_cost([1.0, 2.0], 0).pipeline_s == 0.0
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    with pytest.raises(ValueError):
        bubble_fraction(0, 1)


@pytest.mark.parametrize("stage, tensor", [(3, 2), (1, 2), (5, 1)])
def test_failure_free_run_equals_analytic_step_time(stage, tensor):
    sc = make_scenario(stage=stage, tensor=tensor)
    expected = analytic_step(sc)
    assert failure_free(sc).step_s == pytest.approx(expected, rel=1e-12)
    for name in ("elaswave_no_dvfs", "recycle", "torchft", "oobleck", "elasjax_spmd",
                 "checkpoint_restart"):
        out = STRATEGIES[name](sc, [])
        assert out.step_s == pytest.approx(expected, rel=1e-12), name
        assert out.global_batch == sc.global_batch and out.recovery_s == 0.0
    # DVFS never makes the failure-free plan slower.
    assert STRATEGIES["elaswave"](sc, []).step_s <= expected * (1 + 1e-12)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_global_batch_preserved_where_claimed(k):
    sc = make_scenario()
    for seed in range(5):
        failed = random_failures(sc, k, seed)
        for name in PRESERVING:
            out = STRATEGIES[name](sc, failed)
            assert out.batch_preserved and out.global_batch == sc.global_batch, name
            assert out.samples_per_step == sc.global_batch, name
        plan = plan_heterogeneous(sc, sc.layout.broken(failed), reroute=False)
        assert sum(g.count * g.micro for g in plan.groups) * sc.micro_batch == sc.global_batch
        ft = STRATEGIES["torchft"](sc, failed)
        if not ft.note:  # TorchFT-like drops the broken replicas: the batch shrinks
            assert ft.global_batch < sc.global_batch and not ft.batch_preserved


def test_throughput_never_exceeds_ideal():
    sc = make_scenario()
    for k in (0, 1, 3, 6):
        failed = random_failures(sc, k, k)
        for name, fn in STRATEGIES.items():
            out = fn(sc, failed)
            bound = ideal_tokens_per_s(sc, failed, dvfs=out.dvfs_used)
            assert out.tokens_per_s <= bound * (1 + 1e-12), (name, k)
            assert out.tokens_per_s <= ideal_tokens_per_s(sc, failed, dvfs=True) * (1 + 1e-12)


def test_spread_is_min_max_and_matches_greedy():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        fill = rng.uniform(0, 5, n)
        tau = rng.uniform(0.1, 2, n)
        counts = rng.integers(0, 4, n)
        if counts.sum() == 0:
            counts[0] = 1
        total = int(rng.integers(0, 40))
        out = spread_microbatches(fill, tau, counts, total)
        assert sum(k * m for _, k, m in out) == total
        assert sum(k for _, k, _ in out) == counts.sum()
        make = max([fill[g] + m * tau[g] for g, k, m in out if m > 0] or [0.0])
        flat_f = np.repeat(fill, counts)
        flat_t = np.repeat(tau, counts)
        ref = greedy_spread_reference(list(flat_f), list(flat_t), total)
        ref_make = max([flat_f[p] + m * flat_t[p] for p, m in enumerate(ref) if m > 0] or [0.0])
        assert make == pytest.approx(ref_make, rel=1e-9)


def test_dvfs_model_and_policy():
    p = PowerModel(300.0, 0.3, 0.6, 1.2)
    assert p.power(1.0) == pytest.approx(300.0) and p.power(0.0) == pytest.approx(90.0)
    assert stage_time(2.0, 1.0, 2.0) == pytest.approx(2.0)
    sc = make_scenario(stage=3)
    w = sc.workload()
    uneven = dataclasses.replace(make_group(w, [6, 3, 3], 2), micro=8)
    nominal = uneven.pipe_s()
    (g,), used = balance([uneven], sc.layout.tensor, p)
    assert used and g.pipe_s() < nominal
    watts = 2 * sc.layout.tensor * float(np.sum(p.power(np.asarray(g.freq))))
    assert watts <= 2 * 3 * sc.layout.tensor * p.p_nominal_w * (1 + 1e-9)
    assert min(g.freq) >= p.f_min and max(g.freq) <= p.f_max
    with pytest.raises(ValueError):
        PowerModel(300.0, 0.3, 1.1, 1.2)


def test_recycle_needs_a_peer_and_elaswave_repartitions():
    sc = make_scenario()
    stage0 = [(0 * sc.layout.data + d) * sc.layout.tensor for d in range(sc.layout.data)]
    rc = STRATEGIES["recycle"](sc, stage0)
    assert "checkpoint-restart" in rc.note
    one = STRATEGIES["elaswave_no_dvfs"](sc, [stage0[0]])
    assert one.plan.startswith(("repartition", "reroute")) and one.batch_preserved
    plan = plan_heterogeneous(sc, sc.layout.broken([stage0[0]]), dvfs=False, reroute=False)
    assert sorted({g.n_stages for g in plan.groups}) == [2, 3]
    assert plan.moved_bytes >= plan.blocking_bytes_max * sc.layout.tensor > 0


def test_planner_budget_zero_returns_first_candidate():
    sc = make_scenario()
    broken = sc.layout.broken(random_failures(sc, 3, 1))
    plan = plan_heterogeneous(sc, broken, dvfs=False, budget_s=0.0)
    assert plan.evaluated == 1 and plan.choice == "repartition"


def test_trace_is_seeded_and_host_failures_take_the_host():
    p = TraceParams(n_devices=64, devices_per_host=8, hours=2000.0, mtbf_hours=5000.0,
                    host_fraction=1.0, repair_hours=10.0, seed=3)
    a, b = make_trace(p), make_trace(p)
    assert a == b and len(a) > 0
    assert make_trace(dataclasses.replace(p, seed=4)) != a
    down: set[int] = set()
    for ev in a:
        if ev.kind == "fail":
            host = ev.devices[0] // 8
            expect = {d for d in range(host * 8, host * 8 + 8) if d not in down}
            assert ev.host_level and set(ev.devices) == expect
            down |= set(ev.devices)
        else:
            down -= set(ev.devices)
    times = [e.time_s for e in a]
    assert times == sorted(times)


def test_identical_seed_identical_output():
    sc = make_scenario()
    trace = make_trace(TraceParams(sc.layout.n_devices, 4, 500.0, 2000.0, 0.2, 8.0, seed=7))
    ref = failure_free(sc).tokens_per_s
    for name in ("elaswave", "checkpoint_restart", "torchft"):
        a = simulate(sc, name, STRATEGIES[name], trace, 500.0, 50.0, ref)
        b = simulate(make_scenario(), name, STRATEGIES[name], trace, 500.0, 50.0, ref)
        assert a == b
        # elaswave may boost clocks (DVFS) above nominal, up to f_max, so its goodput may pass
        # 1.0 by that much at most; the others never pass the failure-free rate
        bound = sc.device.f_max if name == "elaswave" else 1.0
        assert all(g <= bound + 1e-9 for g in a.goodput), (name, max(a.goodput))
    cfg = simconfig.from_dict({"model": dataclasses.asdict(DIMS), "layout": {
        "devices": 24, "stage": 3, "tensor": 2}, "batch": {"microbatches": 6},
        "post_change": {"failures": [1, 2], "draws": 3}})
    assert post_change_study(cfg) == post_change_study(cfg)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="unknown config key 'layout.pipes'"):
        simconfig.from_dict({"layout": {"pipes": 3}})
    with pytest.raises(ConfigError, match="layout.tensor"):
        simconfig.from_dict({"layout": {"tensor": 3}})
    with pytest.raises(ConfigError, match="'strategies\\[0\\]'"):
        simconfig.from_dict({"strategies": ["magic"]})
    with pytest.raises(ConfigError, match="hardware.preset"):
        simconfig.from_dict({"hardware": {"preset": "tpu"}})
    cfg = simconfig.from_dict({"hardware": {"preset": "h100_sxm", "mfu": 0.5}})
    assert cfg.hardware.build().mfu == 0.5


def test_cli_sim_smoke(tmp_path, capsys):
    from elasjax import cli

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        "run: [post_change, trace]\nmodel: {n_layers: 10, d_model: 256, n_heads: 8, "
        "d_mlp: 1024, vocab_size: 1000, seq_len: 128}\nlayout: {devices: 24, stage: 3, "
        "tensor: 2}\nbatch: {microbatches: 6}\npost_change: {failures: [1], draws: 2}\n"
        "trace: {scales: [24, 48], hours: 200, mtbf_hours: 2000, bin_hours: 50}\n"
    )
    rc = cli.main(["sim", str(cfg), "--set", "post_change.draws=3", "--out",
                   str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert rc == 0 and "(simulated)" in text and "SIMULATED" in text
    assert (tmp_path / "out" / "tables.md").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the test extra does not install the plotting extra
        assert "plots skipped: matplotlib is not installed" in text
    else:
        assert (tmp_path / "out" / "goodput.png").exists()
    assert cli.main(["sim", str(cfg), "--set", "layout.tensor=3"]) == 2


# -- growing back: shrink only / rejoin / hot spares (elasjax.sim.spares) -------------------------


def _policy(sc, policy, trace, hours=10.0, **kw):
    ref = failure_free(sc).tokens_per_s
    return simulate_policy(sc, policy, trace, hours, 1.0, ref, **kw)


def test_spares_keep_the_plan_while_shrink_only_drops_and_rejoin_returns():
    """Host 1 fails at 1 h; it is repaired at 3 h. Shrink only stays on the smaller plan,
    rejoin is back at the failure-free rate after the repair, one hot spare host keeps the plan's
    size (after its swap stall) the whole time; with the spare's idle devices counted, its
    goodput per total device is the per-active one times n / (n + spare devices)."""
    sc = make_scenario()  # 24 devices, hosts of 4
    h = 3600.0
    host = (4, 5, 6, 7)
    trace = (TraceEvent(1 * h, "fail", host, True), TraceEvent(3 * h, "repair", host))
    shrink, rejoin = _policy(sc, "shrink", trace), _policy(sc, "rejoin", trace)
    spares = _policy(sc, "spares", trace, spare_hosts=1, swap_s=60.0)
    assert shrink.goodput[0] == rejoin.goodput[0] == spares.goodput[0] == pytest.approx(1.0)
    ff = failure_free(sc).tokens_per_s
    smaller = STRATEGIES["elaswave_no_dvfs"](sc, list(host)).tokens_per_s / ff
    assert smaller < 0.9
    assert shrink.goodput[2:] == pytest.approx((smaller,) * 8)
    assert rejoin.goodput[2] == pytest.approx(smaller)
    assert rejoin.goodput[4:] == pytest.approx((1.0,) * 6)
    step = failure_free(sc).step_s
    assert spares.goodput[1] == pytest.approx(1.0 - (60.0 + 0.5 * step) / h)
    assert spares.goodput[2:] == pytest.approx((1.0,) * 8) and spares.swaps == 1
    assert spares.mean_filled == 1.0 and shrink.mean_filled < 1.0
    assert spares.total_devices == 28
    assert spares.goodput_per_total_device == pytest.approx(spares.mean_goodput * 24 / 28)
    assert shrink.goodput_per_total_device == shrink.mean_goodput  # nothing idle
    # a failure-free run with two idle spare hosts: full per active device, 24/32 per total
    idle = _policy(sc, "spares", (), spare_hosts=2)
    assert idle.mean_goodput == pytest.approx(1.0)
    assert idle.goodput_per_total_device == pytest.approx(24 / 32)


def test_an_empty_pool_falls_back_to_shrinking_and_a_repaired_host_refills_it():
    """The only spare host (devices 24..27) fails while idle; a job failure then finds the pool
    empty and shrinks; when the spare is repaired it is swapped into the short job at once."""
    sc = make_scenario()
    h = 3600.0
    host = (4, 5, 6, 7)
    trace = (TraceEvent(0.5 * h, "fail", (25,)), TraceEvent(1 * h, "fail", host, True),
             TraceEvent(4 * h, "repair", (25,)), TraceEvent(8 * h, "repair", host))
    sp = _policy(sc, "spares", trace, spare_hosts=1, swap_s=60.0)
    ff = failure_free(sc).tokens_per_s
    smaller = STRATEGIES["elaswave_no_dvfs"](sc, list(host)).tokens_per_s / ff
    assert sp.fallbacks == 1 and sp.swaps == 1
    assert sp.goodput[2:4] == pytest.approx((smaller,) * 2)
    assert sp.goodput[5:] == pytest.approx((1.0,) * 5)
    # the spare host's events do not exist for the policies without spares
    assert _policy(sc, "rejoin", trace).goodput == _policy(sc, "rejoin", trace[1:2] + trace[3:]
                                                           ).goodput


def test_rejoin_policy_matches_the_trace_replay():
    sc = make_scenario()
    trace = make_trace(TraceParams(sc.layout.n_devices, 4, 500.0, 2000.0, 0.2, 8.0, seed=7))
    assert sum(e.kind == "fail" for e in trace) >= 3
    ref = failure_free(sc).tokens_per_s
    a = simulate(sc, "elaswave_no_dvfs", STRATEGIES["elaswave_no_dvfs"], trace, 500.0, 50.0, ref)
    b = simulate_policy(sc, "rejoin", trace, 500.0, 50.0, ref)
    assert b.goodput == pytest.approx(a.goodput, rel=1e-12) and b.lost_work_s > 0
    assert (b.downtime_s, b.transitions) == pytest.approx((a.downtime_s, a.transitions))
    with pytest.raises(ValueError, match="allowed values: shrink, rejoin, spares"):
        simulate_policy(sc, "hoard", trace, 500.0, 50.0, ref)


def test_growth_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"'growth.spare_fraction' = -0.1; allowed values: 0 <= "):
        simconfig.from_dict({"growth": {"spare_fraction": -0.1}})
    with pytest.raises(ConfigError, match=r"'growth.policies\[0\]' = 'hoard' is not allowed; "
                                          r"allowed values: 'shrink', 'rejoin', 'spares'"):
        simconfig.from_dict({"growth": {"policies": ["hoard"]}})
    with pytest.raises(ConfigError, match=r"'growth.strategies' = \['checkpoint_restart'\]: name "
                                          r"at least one elastic strategy.*allowed values: "
                                          r"elaswave, "):
        simconfig.from_dict({"growth": {"strategies": ["checkpoint_restart"]}})
    with pytest.raises(ConfigError, match=r"'run' includes 'growth'.*trace.scales"):
        simconfig.from_dict({"run": ["growth"]})
