"""What a lost packet becomes: zeros, stale (last value delivered at that place), rescale (1/(1-p) survivors)."""

import pytest
import torch

from megatron_app.lossy import make_loss_config
from megatron_app.lossy.tensors import TensorLoss

PACKET = 64  # bytes: 16 float32 per packet


def packets_lost(received: torch.Tensor, per_packet: int = 16) -> torch.Tensor:
    return (received.view(-1, per_packet) == 0).all(dim=1)


def test_zeros_fill_clears_lost_packets_and_keeps_the_rest_bit_exact():
    sent = torch.arange(1, 16 * 200 + 1, dtype=torch.float32)
    received = TensorLoss(make_loss_config("bernoulli", loss_rate=0.3, packet_bytes=PACKET), [1])(sent)
    assert torch.equal(sent, torch.arange(1, 16 * 200 + 1, dtype=torch.float32))  # the input is not modified
    lost = packets_lost(received)
    assert 0 < int(lost.sum()) < 200
    kept = ~lost
    assert torch.equal(received.view(200, 16)[kept], sent.view(200, 16)[kept])


def test_stale_fill_reuses_the_last_value_delivered_at_that_place():
    loss = TensorLoss(make_loss_config("bernoulli", loss_rate=0.4, packet_bytes=PACKET, fill="stale"), [2])
    first = loss(torch.full((16 * 100,), 1.0), family=7)
    assert packets_lost(first).any()  # nothing delivered before: lost packets are zeros
    second = loss(torch.full((16 * 100,), 2.0), family=7)
    by_packet = second.view(100, 16)
    lost_now = (by_packet != 2.0).all(dim=1)
    assert lost_now.any()
    # a packet lost now shows what the first message delivered there (1.0, or 0 where that one was lost too)
    assert torch.equal(by_packet[lost_now], first.view(100, 16)[lost_now])
    # another family has its own history
    other = loss(torch.full((16 * 100,), 3.0), family=8)
    assert set(other.unique().tolist()) <= {0.0, 3.0}


def test_stale_fill_with_a_new_size_falls_back_to_zeros():
    loss = TensorLoss(make_loss_config("bernoulli", loss_rate=0.5, packet_bytes=PACKET, fill="stale"), [3])
    loss(torch.full((16 * 50,), 1.0), family=1)
    grown = loss(torch.full((16 * 60,), 2.0), family=1)
    assert set(grown.unique().tolist()) == {0.0, 2.0}


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.float64, 1e-12),
                                              (torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
def test_rescale_fill_scales_survivors_by_one_over_one_minus_p(dtype, tolerance):
    p = 0.2
    loss = TensorLoss(make_loss_config("bernoulli", loss_rate=p, packet_bytes=64), [4])
    loss = TensorLoss(loss.config.replace(fill="rescale"), [4])
    per_packet = 64 // torch.empty((), dtype=dtype).element_size()
    sent = torch.full((per_packet * 500,), 1.5, dtype=dtype)
    received = loss(sent).view(500, per_packet).double()
    kept = (received != 0).all(dim=1)
    assert 0 < int((~kept).sum()) < 500
    assert torch.allclose(received[kept], torch.full_like(received[kept], 1.5 / (1 - p)), rtol=tolerance)


def test_rescale_fill_is_unbiased_in_expectation():
    p, n = 0.1, 200_000
    config = make_loss_config("bernoulli", loss_rate=p, packet_bytes=4, fill="rescale")
    received = TensorLoss(config, [5])(torch.ones(n))
    sigma = (p / (1 - p) / n) ** 0.5  # std of the mean of x/(1-p) Bernoulli-kept ones
    assert abs(received.mean().item() - 1.0) < 3 * sigma


def test_a_packet_boundary_inside_an_element_loses_the_whole_element():
    # 6-byte packets over float32: every element a lost packet touches is lost as a whole, never half-written
    sent = torch.full((3000,), 1.25)
    received = TensorLoss(make_loss_config("bernoulli", loss_rate=0.3, packet_bytes=6), [6])(sent)
    assert set(received.unique().tolist()) == {0.0, 1.25}


def test_integer_payloads_are_zeroed_not_rescaled():
    config = make_loss_config("bernoulli", loss_rate=0.3, packet_bytes=8, fill="rescale")
    received = TensorLoss(config, [7])(torch.full((1000,), 5, dtype=torch.int64))
    assert set(received.unique().tolist()) == {0, 5}


def test_zero_loss_rate_delivers_everything_unchanged_and_counts_packets():
    sent = torch.randn(10_000)
    loss = TensorLoss(make_loss_config("bernoulli", loss_rate=0.0), [8])
    assert torch.equal(loss(sent), sent)
    assert loss.stats()["packets"] == -(-sent.nbytes // 4096) and loss.stats()["lost"] == 0
