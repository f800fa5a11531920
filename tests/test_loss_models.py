"""The C++ loss models through their bindings: observed rates against theory (3 sigma), determinism per stream,
netem's Gilbert-Elliott parameters and the burst-length form, replayed patterns."""

import math

import pytest
import torch

from megatron_app.lossy import LossConfigError, gilbert_from_burst, make_loss_config
from megatron_app.lossy.tensors import TensorLoss
from megatron_app.transport._core import core

FLOAT32 = int(core.ElementKind.FLOAT32)


def lost_mask(config, packets: int, stream=(1, 2, 3)) -> torch.Tensor:
    """Which of `packets` one-element packets the model loses (True = lost), via the zeros fill."""
    config = config.replace(packet_bytes=4, fill="zeros")
    data = torch.ones(packets, dtype=torch.float32)
    TensorLoss(config, list(stream))(data, inplace=True)
    return data == 0


def bursts_of(lost: torch.Tensor) -> list:
    """Lengths of the runs of consecutive lost packets (a run cut by the end is left out)."""
    runs, current = [], 0
    for value in lost.tolist():
        if value:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs


def test_bernoulli_rate_within_three_sigma():
    p, n = 0.05, 400_000
    lost = lost_mask(make_loss_config("bernoulli", loss_rate=p), n)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(lost.float().mean().item() - p) < 3 * sigma


def test_bernoulli_statistics_count_packets_and_bursts():
    config = make_loss_config("bernoulli", loss_rate=0.3, packet_bytes=64)
    stream = TensorLoss(config, [7])
    data = torch.ones(64 * 1000 // 4, dtype=torch.float32)  # 1000 packets of 16 floats
    stream(data, inplace=True)
    stats = stream.stats()
    lost_packets = (data.view(1000, 16) == 0).all(dim=1)
    assert stats["packets"] == 1000
    assert stats["lost"] == int(lost_packets.sum())
    finished = bursts_of(lost_packets)
    expected = {length: finished.count(length) for length in set(finished)}
    assert stats["bursts"] == expected
    assert stats["open_burst"] == (len(lost_packets) - int(torch.nonzero(~lost_packets).max()) - 1)


def _chain_variance_factor(p: float, r: float) -> float:
    """(1 + lambda) / (1 - lambda) of a two-state chain, lambda = 1 - p - r: inflates the variance of a mean."""
    lam = 1 - p - r
    return (1 + lam) / (1 - lam)


def test_gilbert_elliott_rate_and_burst_length_within_three_sigma():
    p, r, n = 0.02, 0.25, 400_000
    lost = lost_mask(make_loss_config(f"gilbert-elliott:{p},{r},1,0"), n)
    stationary = p / (p + r)
    rate_sigma = math.sqrt(stationary * (1 - stationary) * _chain_variance_factor(p, r) / n)
    assert abs(lost.float().mean().item() - stationary) < 3 * rate_sigma
    runs = bursts_of(lost)
    mean_burst, burst_variance = 1 / r, (1 - r) / r**2  # bad-state sojourns are geometric
    assert abs(sum(runs) / len(runs) - mean_burst) < 3 * math.sqrt(burst_variance / len(runs))


def test_gilbert_elliott_general_model_stationary_rate_within_three_sigma():
    p, r, bad_loss, good_loss, n = 0.05, 0.3, 0.8, 0.02, 400_000
    config = make_loss_config(f"gilbert-elliott:{p},{r},{bad_loss},{good_loss}")
    lost = lost_mask(config, n)
    bad = p / (p + r)
    stationary = (1 - bad) * good_loss + bad * bad_loss
    assert config.stationary_loss_rate() == pytest.approx(stationary)
    # Var of the mean: per-packet noise given the state + the state chain's correlated part.
    noise = (1 - bad) * good_loss * (1 - good_loss) + bad * bad_loss * (1 - bad_loss)
    chain = (bad_loss - good_loss) ** 2 * bad * (1 - bad) * _chain_variance_factor(p, r)
    assert abs(lost.float().mean().item() - stationary) < 3 * math.sqrt((noise + chain) / n)


def test_burst_length_form_matches_its_rate_and_burst_length():
    rate, burst = 0.05, 4.0
    p, r, bad_loss, good_loss = gilbert_from_burst(rate, burst)
    assert (bad_loss, good_loss) == (1.0, 0.0)
    assert p / (p + r) == pytest.approx(rate) and 1 / r == pytest.approx(burst)
    n = 400_000
    lost = lost_mask(make_loss_config("gilbert-elliott", loss_rate=rate, burst_length=burst), n)
    sigma = math.sqrt(rate * (1 - rate) * _chain_variance_factor(p, r) / n)
    assert abs(lost.float().mean().item() - rate) < 3 * sigma
    runs = bursts_of(lost)
    assert abs(sum(runs) / len(runs) - burst) < 3 * math.sqrt((1 - r) / r**2 / len(runs))


def test_netem_defaults_for_omitted_gilbert_parameters():
    assert make_loss_config("gilbert-elliott:0.1").gilbert == pytest.approx((0.1, 0.9, 1.0, 0.0))
    assert make_loss_config("gilbert-elliott:0.1,0.5").gilbert == pytest.approx((0.1, 0.5, 1.0, 0.0))


def test_same_seed_and_stream_repeat_other_streams_and_seeds_differ():
    config = make_loss_config("gilbert-elliott", loss_rate=0.1, burst_length=3, seed=5)
    first = lost_mask(config, 20_000, stream=(0, 1, 1))
    assert torch.equal(first, lost_mask(config, 20_000, stream=(0, 1, 1)))
    other_link = lost_mask(config, 20_000, stream=(1, 2, 1))
    other_direction = lost_mask(config, 20_000, stream=(0, 1, 2))
    other_seed = lost_mask(config.replace(seed=6), 20_000, stream=(0, 1, 1))
    for other in (other_link, other_direction, other_seed):
        assert not torch.equal(first, other)
        # independent streams agree on a lost packet about rate^2 of the time, not rate
        assert (first & other).float().mean().item() < 0.05


def test_replay_repeats_the_recorded_pattern(tmp_path):
    pattern = tmp_path / "pattern.txt"
    pattern.write_text("# recorded\n0110 0\n1\n")
    config = make_loss_config(f"replay:{pattern}")
    assert config.stationary_loss_rate() == pytest.approx(3 / 6)
    lost = lost_mask(config, 14)
    assert lost.int().tolist() == [0, 1, 1, 0, 0, 1] * 2 + [0, 1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model="bernoulli", loss_rate=1.5), r"--loss-rate must be a probability in \[0, 1\]"),
        (dict(model="bernoulli", loss_rate=-0.1), r"--loss-rate must be a probability in \[0, 1\]"),
        (dict(model="bernoulli"), "needs --loss-rate"),
        (dict(model="gilbert-elliott", loss_rate=0.1, burst_length=-2), "--burst-length must not be negative"),
        (dict(model="gilbert-elliott", loss_rate=0.1, burst_length=0.5), "--burst-length must be >= 1"),
        (dict(model="gilbert-elliott", loss_rate=0.6, burst_length=1), "impossible in the Gilbert model"),
        (dict(model="gilbert-elliott", loss_rate=0.1), "needs --burst-length"),
        (dict(model="gilbert-elliott:0.1,1.2"), r"r \(bad->good\) must be a probability"),
        (dict(model="gilbert-elliott:x"), "must be numbers"),
        (dict(model="bernoulli", loss_rate=0.1, burst_length=2), "applies to gilbert-elliott only"),
        (dict(model="netem"), "unknown --loss-model 'netem'"),
        (dict(model="replay:/nonexistent/pattern"), "cannot read loss pattern file"),
        (dict(model="bernoulli", loss_rate=0.1, fill="ones"), "unknown --loss-fill 'ones'"),
        (dict(model="bernoulli", loss_rate=0.1, loss_on="forward,sideways"), "--loss-on takes a comma list"),
        (dict(model="bernoulli", loss_rate=0.1, packet_bytes=0), "--loss-packet-bytes must be a positive integer"),
        (dict(model="none", loss_rate=0.1), "need a --loss-model"),
    ],
)
def test_bad_parameters_get_one_clear_error(kwargs, message):
    with pytest.raises(LossConfigError, match=message):
        make_loss_config(**kwargs)


def test_replay_pattern_rejects_other_characters(tmp_path):
    pattern = tmp_path / "bad.txt"
    pattern.write_text("0101\n01x1\n")
    with pytest.raises(LossConfigError, match=r"bad.txt:2: unexpected 'x'"):
        make_loss_config(f"replay:{pattern}")


def test_core_rejects_a_probability_outside_zero_one():
    spec = core.LossModelSpec()
    spec.kind = core.LossModelKind.BERNOULLI
    spec.loss_rate = 1.01
    with pytest.raises(ValueError, match=r"loss rate must be a probability in \[0, 1\]"):
        core.LossChannel(spec)
