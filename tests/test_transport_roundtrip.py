"""Round trips between two transports in one process: bit-exact tensors of every dtype and shape, chunking,
ordering, wait_any/poll/try_recv semantics and the receive-side dtype check."""

import gc
import random

import pytest
import torch
from transport_helpers.common import (
    ALL_DTYPES,
    job_id_fixture,  # noqa: F401  (provides the job_id fixture)
    message_for,
    random_tensor,
    same_bits,
)

from megatron_app.transport import Direction, Transport, make_tag

FWD = Direction.FORWARD


@pytest.fixture
def pair(job_id):
    """Ranks 0 and 1 of one job, with small slots so that most messages span several chunks."""
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7, 5), (2, 3, 4, 5), (9000,)], ids=str)
def test_every_dtype_and_shape_round_trips_bit_exactly(pair, dtype, shape):
    sender, receiver = pair
    tensor = random_tensor(torch.Generator().manual_seed(len(shape)), dtype, shape)
    sender.send(1, make_tag(FWD, 0), tensor)
    received = receiver.recv(0, make_tag(FWD, 0), dtype=dtype)
    assert received.dtype == dtype and received.shape == tensor.shape
    assert same_bits(received, tensor)


def test_random_stream_round_trips_in_order(pair):
    sender, receiver = pair
    for index in range(150):
        sender.send(1, make_tag(FWD, index), message_for(seed=11, index=index))
    for index in range(150):
        assert same_bits(receiver.recv(0, make_tag(FWD, index)), message_for(seed=11, index=index)), index
    sender.wait_sends(timeout=10)


def test_non_contiguous_and_special_views_are_sent_as_their_values(pair):
    sender, receiver = pair
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    complex_base = torch.randn(5, dtype=torch.complex64)
    views = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "conjugated": complex_base.conj(),
        "negated": complex_base.conj().imag,
        "requires_grad": base.clone().requires_grad_(True) * 2,
    }
    for index, view in enumerate(views.values()):
        sender.send(1, make_tag(FWD, index), view)
    for index, (name, view) in enumerate(views.items()):
        received = receiver.recv(0, make_tag(FWD, index))
        assert received.is_contiguous(), name
        assert not received.requires_grad and not received.is_conj(), name
        assert torch.equal(received, view.detach().resolve_conj().resolve_neg()), name


def test_out_of_order_receives_and_duplicate_tags(pair):
    sender, receiver = pair
    tensors = [torch.full((100 * (i + 1),), float(i)) for i in range(12)]
    for index, tensor in enumerate(tensors):
        sender.send(1, make_tag(FWD, index), tensor)
    order = list(range(12))
    random.Random(3).shuffle(order)
    for index in order:
        assert torch.equal(receiver.recv(0, make_tag(FWD, index)), tensors[index])
    # Same tag twice: delivered first-in, first-out.
    sender.send(1, 99, torch.tensor([1]))
    sender.send(1, 99, torch.tensor([2]))
    assert receiver.recv(0, 99).item() == 1
    assert receiver.recv(0, 99).item() == 2


def test_poll_wait_any_and_try_recv(pair):
    sender, receiver = pair
    wanted = [(0, make_tag(FWD, i)) for i in range(4)]
    assert receiver.poll() == []
    assert receiver.try_recv(0, make_tag(FWD, 2)) is None
    sender.send(1, make_tag(FWD, 2), torch.ones(50_000))  # 200 KB: 49 chunks of 4 KiB
    assert receiver.wait_any(wanted, timeout=10) == (0, make_tag(FWD, 2))
    assert receiver.poll() == [(0, make_tag(FWD, 2))]
    assert receiver.wait_any(wanted, timeout=10) == (0, make_tag(FWD, 2))  # wait_any does not take
    sender.send(1, make_tag(FWD, 0), torch.zeros(3))
    sender.wait_sends(timeout=10)
    receiver.wait_any([(0, make_tag(FWD, 0))], timeout=10)
    assert receiver.poll() == [(0, make_tag(FWD, 2)), (0, make_tag(FWD, 0))]  # arrival order
    assert torch.equal(receiver.try_recv(0, make_tag(FWD, 2)), torch.ones(50_000))
    assert receiver.poll() == [(0, make_tag(FWD, 0))]
    assert torch.equal(receiver.try_recv(0, make_tag(FWD, 0)), torch.zeros(3))
    assert receiver.poll() == []


def test_wrong_dtype_request_names_both_and_keeps_the_message(pair):
    sender, receiver = pair
    sender.send(1, 5, torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"requested dtype torch.float32 but the message from peer rank 0 "
                                         r"\(tag 0x0000000000000005\) carries torch.bfloat16"):
        receiver.recv(0, 5, dtype=torch.float32, timeout=10)
    with pytest.raises(ValueError, match="carries torch.bfloat16"):
        receiver.try_recv(0, 5, dtype=torch.float16)
    assert torch.equal(receiver.recv(0, 5, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16))


def test_received_tensors_own_their_memory(pair):
    sender, receiver = pair
    sender.send(1, 1, torch.full((5000,), 1.0))
    first = receiver.recv(0, 1)
    first.add_(1)  # writable, and private to the receiver
    sender.send(1, 2, torch.full((5000,), 7.0))
    second = receiver.recv(0, 2)
    assert torch.equal(first, torch.full((5000,), 2.0)) and torch.equal(second, torch.full((5000,), 7.0))
    del first, second
    # Buffers are recycled once dropped; recycled memory must still carry the new message exactly.
    for index in range(3, 10):
        sender.send(1, index, torch.full((5000,), float(index)))
        assert torch.equal(receiver.recv(0, index), torch.full((5000,), float(index)))


def test_both_directions_at_once(pair):
    left, right = pair
    for index in range(20):
        left.send(1, make_tag(FWD, index), torch.full((3000,), float(index)))
        right.send(0, make_tag(Direction.BACKWARD, index), torch.full((3000,), -float(index)))
    for index in range(20):
        assert right.recv(0, make_tag(FWD, index))[0].item() == index
        assert left.recv(1, make_tag(Direction.BACKWARD, index))[0].item() == -index


def test_sent_tensor_may_be_dropped_by_the_caller(job_id):
    with Transport(0, 2, job_id) as sender, Transport(1, 2, job_id) as receiver:
        expected = torch.randn(3_000_000)  # 12 MB: done by a background worker
        handle = sender.send(1, 1, expected.clone())  # the only reference is the transport's
        assert torch.equal(receiver.recv(0, 1, timeout=20), expected)
        handle.wait(timeout=20)
        assert handle.done()


def test_receive_on_a_device(pair):
    sender, receiver = pair
    sender.send(1, 1, torch.arange(10))
    received = receiver.recv(0, 1, device="cpu")
    assert received.device.type == "cpu" and torch.equal(received, torch.arange(10))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_through_host_memory(pair):
    sender, receiver = pair
    tensor = torch.randn(1000, 3, device="cuda")
    sender.send(1, 1, tensor)
    received = receiver.recv(0, 1, device="cuda")
    assert received.device.type == "cuda" and torch.equal(received, tensor)


def test_received_tensors_outlive_the_transport(job_id):
    sender, receiver = Transport(0, 2, job_id), Transport(1, 2, job_id)
    sender.send(1, 1, torch.arange(100_000))
    received = receiver.recv(0, 1, timeout=10)
    sender.close()
    receiver.close()
    del sender, receiver
    gc.collect()
    assert torch.equal(received, torch.arange(100_000))


@pytest.mark.parametrize("nbytes", [256 * 1024 - 1, 1_000_003, 3 * (1 << 20) + 5], ids=str)
def test_large_odd_sized_messages_with_default_slots(job_id, nbytes):
    """Large chunks take the receive side's cache-bypassing copy; odd sizes exercise its tail."""
    with Transport(0, 2, job_id) as sender, Transport(1, 2, job_id) as receiver:
        tensor = random_tensor(torch.Generator().manual_seed(nbytes), torch.uint8, (nbytes,))
        sender.send(1, 1, tensor)
        assert same_bits(receiver.recv(0, 1, timeout=20), tensor)


def test_messages_split_between_caller_and_worker_keep_their_order(job_id):
    """A message's first chunks are copied on the caller's thread and the rest by the send worker; with a ring
    that fills up, later messages of the same tag must still arrive whole and in the order they were sent."""
    sizes = [1 << 20, 4096, 3 * (1 << 20) + 5, 4, 100_000, 0, 300_001, 4096]
    with Transport(0, 2, job_id, slot_bytes=256 * 1024, num_slots=4, timeout_s=30) as sender, \
            Transport(1, 2, job_id, slot_bytes=256 * 1024, num_slots=4, timeout_s=30) as receiver:
        tensors = [random_tensor(torch.Generator().manual_seed(index), torch.uint8, (nbytes,))
                   for index, nbytes in enumerate(sizes * 3)]
        for tensor in tensors:
            sender.send(1, 7, tensor)  # the receiver is not receiving yet: the ring fills after a few chunks
        for index, tensor in enumerate(tensors):
            assert same_bits(receiver.recv(0, 7, timeout=20), tensor), index
        sender.wait_sends(timeout=20)
