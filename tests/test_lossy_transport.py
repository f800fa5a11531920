"""Loss on pipeline traffic inside the transport: per link and direction, only payload changes (shapes and tags
always arrive), control traffic is never touched, statistics per link, python plug-ins on the receive path."""

import importlib

import pytest
import torch
from transport_helpers.common import job_id_fixture  # noqa: F401  (provides the job_id fixture)

from megatron_app.lossy import LossConfigError, adapt, load_plugin, make_loss_config, pipeline
from megatron_app.lossy.pipeline import PipelineLoss
from megatron_app.transport import Direction, Transport, make_tag


@pytest.fixture
def pair(job_id):
    sender = Transport(0, 2, job_id, timeout_s=20)
    receiver = Transport(1, 2, job_id, timeout_s=20)
    yield sender, receiver
    sender.close()
    receiver.close()


def exchange(sender, receiver, tensor, direction=Direction.FORWARD, vmb=0, iteration=0):
    tag = make_tag(direction, vmb, iteration)
    sender.send(1, tag, tensor).wait(timeout=20)
    return receiver.recv(0, tag, timeout=20)


def test_loss_applies_to_payload_only_and_counts_per_link(pair):
    sender, receiver = pair
    config = make_loss_config("bernoulli", loss_rate=0.25, packet_bytes=256, seed=3)
    loss = PipelineLoss(receiver, config)
    sent = torch.full((4, 1000), 2.0)  # 16000 bytes: 63 packets
    received = exchange(sender, loss.transport, sent)
    assert received.shape == sent.shape and received.dtype == sent.dtype
    values = set(received.unique().tolist())
    assert values == {0.0, 2.0}
    (stats,) = loss.stats()
    assert (stats.link, stats.direction, stats.source) == ("0->1", "forward", 0)
    assert stats.packets == 63
    lost_elements = int((received == 0).sum())
    # every packet but the last holds 64 floats; the last 32
    assert stats.lost * 64 - 32 <= lost_elements <= stats.lost * 64


def test_forward_only_leaves_gradients_and_control_messages_intact(pair):
    sender, receiver = pair
    config = make_loss_config("bernoulli", loss_rate=1.0, loss_on="forward", packet_bytes=64)
    loss = PipelineLoss(receiver, config)
    ones = torch.ones(1000)
    assert torch.count_nonzero(exchange(sender, loss.transport, ones, Direction.FORWARD)) == 0
    assert torch.equal(exchange(sender, loss.transport, ones, Direction.BACKWARD), ones)
    assert torch.equal(exchange(sender, loss.transport, ones, Direction.CONTROL), ones)
    assert [(s.direction, s.lost) for s in loss.stats()] == [("forward", 63)]  # 4000 bytes in 64-byte packets


def test_stale_fill_reuses_the_same_microbatch_of_the_previous_call(pair):
    sender, receiver = pair
    config = make_loss_config("bernoulli", loss_rate=0.5, packet_bytes=64, fill="stale", seed=1)
    loss = PipelineLoss(receiver, config)
    first = exchange(sender, loss.transport, torch.full((1600,), 1.0), vmb=3, iteration=0).clone()
    exchange(sender, loss.transport, torch.full((1600,), 9.0), vmb=4, iteration=0)  # another place
    second = exchange(sender, loss.transport, torch.full((1600,), 2.0), vmb=3, iteration=1)
    stale = second != 2.0
    assert stale.any()
    assert torch.equal(second[stale], first[stale])  # never 9.0: that was another microbatch


def test_zero_loss_rate_delivers_bit_exact(pair):
    sender, receiver = pair
    loss = PipelineLoss(receiver, make_loss_config("gilbert-elliott:0,1,1,0"))
    sent = torch.randn(3, 5000, dtype=torch.float64)
    assert torch.equal(exchange(sender, loss.transport, sent, Direction.BACKWARD), sent)
    assert loss.stats()[0].lost == 0


class DropEveryOtherPacket:
    """A research-code style plug-in: send() returns a per-packet mask (True = delivered)."""

    def send(self, tensor):
        return torch.arange(10) % 2 == 0


class HalveEverything:
    def apply(self, tensor):
        return tensor / 2


def test_python_plugin_runs_on_received_tensors(pair):
    sender, receiver = pair
    config = make_loss_config("none").replace(model="python", source="test")
    loss = PipelineLoss(receiver, config, plugin=adapt(DropEveryOtherPacket()))
    received = exchange(sender, loss.transport, torch.ones(100))
    assert received.view(10, 10).all(dim=1).tolist() == [True, False] * 5
    (stats,) = loss.stats()
    assert (stats.packets, stats.lost, stats.bursts) == (10, 5, {1: 4})


def test_plugin_returning_a_tensor_counts_changed_packets(pair):
    sender, receiver = pair
    config = make_loss_config("none", packet_bytes=40).replace(model="python", source="test")
    loss = PipelineLoss(receiver, config, plugin=adapt(HalveEverything()))
    received = exchange(sender, loss.transport, torch.full((100,), 4.0))
    assert torch.equal(received, torch.full((100,), 2.0))
    (stats,) = loss.stats()
    assert (stats.packets, stats.lost) == (10, 10)


def test_configured_loss_is_attached_to_new_transports(pair):
    sender, receiver = pair
    try:
        pipeline.configure(make_loss_config("bernoulli", loss_rate=1.0, packet_bytes=64))
        lossy = pipeline.attach_configured_loss(receiver)
        assert lossy is receiver  # built-in models live inside the transport
        assert torch.count_nonzero(exchange(sender, lossy, torch.ones(64))) == 0
        assert pipeline.current_pipeline_loss().stats()[0].lost == 4
    finally:
        pipeline.reset()
    assert pipeline.attach_configured_loss(receiver) is receiver


def test_plugin_adapter_picks_the_interface():
    class WithSend:
        def send(self, tensor):
            return torch.ones(tensor.numel(), dtype=torch.bool)

        def apply(self, tensor):
            raise AssertionError("send() comes first")

    class WithApply:
        def apply(self, tensor):
            return tensor

    assert adapt(WithSend()).interface == "send"
    assert adapt(WithApply()).interface == "apply"
    assert adapt(lambda tensor: tensor).interface == "__call__"
    with pytest.raises(LossConfigError, match="has none of send"):
        adapt(object())


def test_load_plugin_imports_and_instantiates(tmp_path, monkeypatch):
    (tmp_path / "my_lossy_net.py").write_text(
        "class Net:\n    def __call__(self, tensor):\n        return tensor * 0\nnot_a_model = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert load_plugin("my_lossy_net.Net").interface == "__call__"
    with pytest.raises(LossConfigError, match="has none of send"):
        load_plugin("my_lossy_net.not_a_model")
    with pytest.raises(LossConfigError, match="has no loss model 'Missing'"):
        load_plugin("my_lossy_net.Missing")
    with pytest.raises(LossConfigError, match="cannot import loss model module 'no_such_module_xyz'"):
        load_plugin("no_such_module_xyz.Net")
    with pytest.raises(LossConfigError, match="MODULE.OBJECT"):
        load_plugin("Net")
