"""The optional JAX calibration of per-layer compute (elasjax.sim.calibrate) and its cache."""

import math

from elasjax.sim.calibrate import fit, load_or_measure
from elasjax.sim.workload import GptDims

TINY = GptDims(n_layers=0, d_model=32, n_heads=2, d_mlp=64, vocab_size=64, seq_len=16)


def test_fit_recovers_a_line():
    cal = fit(TINY, 2, (1, 3), (0.5, 1.1))
    assert math.isclose(cal.per_layer_s, 0.3) and math.isclose(cal.base_s, 0.2)
    assert math.isclose(cal.predict(5), 1.7)
    assert "calibrated on this machine's CPU" in cal.describe()


def test_measure_and_cache_roundtrip(tmp_path):
    cache = tmp_path / "cal.json"
    cal, cached = load_or_measure(cache, TINY, 2, layers=(1, 2), reps=2)
    assert not cached and len(cal.step_s) == 2 and all(t > 0 for t in cal.step_s)
    again, cached = load_or_measure(cache, TINY, 2, layers=(1, 2), reps=2)
    assert cached and again == cal
