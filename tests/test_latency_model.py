"""megatron_app.bench.transport.latency_model: the fixed + per-byte fit quoted in BENCHMARKS.md."""

import math

import pytest

from megatron_app.bench.transport.latency_model import fit_latency_model

SIZES = [4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def test_recovers_the_fixed_cost_and_rate_of_exact_data():
    times = [6.0 + size / 10.0e9 * 1e6 for size in SIZES]  # 6 us + n / (10 GB/s)
    model = fit_latency_model(SIZES, times)
    assert model.fixed_us == pytest.approx(6.0, rel=1e-6)
    assert model.gbs == pytest.approx(10.0, rel=1e-6)
    assert model.worst_relative_error == pytest.approx(0.0, abs=1e-9)
    assert model.predict_us(1 << 20) == pytest.approx(6.0 + (1 << 20) / 1e4)


def test_small_sizes_decide_the_fixed_cost_despite_large_ones():
    # +-10% noise on the largest sizes must not swamp a 6 us fixed cost (an unweighted fit would).
    times = [6.0 + size / 10.0e9 * 1e6 for size in SIZES]
    times[-1] *= 1.10
    times[-2] *= 0.90
    model = fit_latency_model(SIZES, times)
    assert 5.0 < model.fixed_us < 7.0
    assert 8.0 < model.gbs < 12.0
    assert model.worst_relative_error < 0.15


def test_a_flat_curve_has_no_per_byte_cost():
    model = fit_latency_model([4096, 8192, 16384], [10.0, 10.0, 10.0])
    assert math.isinf(model.gbs) and model.fixed_us == pytest.approx(10.0)
    assert "no per-byte cost" in model.describe()


@pytest.mark.parametrize("sizes, times, message", [
    ([4096], [5.0], "two different sizes"),
    ([4096, 4096], [5.0, 6.0], "two different sizes"),
    ([4096, 8192], [5.0, 0.0], "positive"),
    ([4096, 8192], [5.0, float("nan")], "positive"),
])
def test_rejects_data_it_cannot_fit(sizes, times, message):
    with pytest.raises(ValueError, match=message):
        fit_latency_model(sizes, times)
