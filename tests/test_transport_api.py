"""Tags and argument validation of megatron_app.transport: every bad input gives one clear exception."""

import math
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transport_helpers.common import job_id_fixture  # noqa: F401  (provides the job_id fixture)

from megatron_app.transport import (
    Direction,
    PeerDied,
    Transport,
    TransportClosed,
    TransportTimeout,
    describe_tag,
    make_tag,
    split_tag,
)


@given(
    direction=st.sampled_from(list(Direction)),
    microbatch=st.integers(0, 2**32 - 1),
    iteration=st.integers(0, 2**28 - 1),
)
def test_split_tag_inverts_make_tag(direction, microbatch, iteration):
    tag = make_tag(direction, microbatch, iteration)
    assert 0 <= tag < 2**64
    assert split_tag(tag) == (direction, microbatch, iteration)


def test_tags_are_distinct_per_field():
    tags = {make_tag(d, m, i) for d in Direction for m in (0, 1, 2**32 - 1) for i in (0, 1, 2**28 - 1)}
    assert len(tags) == len(Direction) * 9


def test_describe_tag_names_the_fields():
    assert describe_tag(make_tag(Direction.BACKWARD, 7, 3)) == "tag BACKWARD vmb=7 iter=3"
    assert describe_tag(5) == "tag 0x0000000000000005"


@pytest.mark.parametrize(
    "args, message",
    [
        ((Direction.FORWARD, 2**32, 0), "virtual_microbatch 4294967296 does not fit"),
        ((Direction.FORWARD, 0, 2**28), "iteration 268435456 does not fit"),
        ((Direction.FORWARD, -1, 0), "virtual_microbatch must be >= 0"),
        ((9, 0, 0), "unknown direction 9"),
    ],
)
def test_make_tag_rejects_out_of_range_fields(args, message):
    with pytest.raises(ValueError, match=message):
        make_tag(*args)


def test_make_tag_rejects_non_int_fields():
    with pytest.raises(TypeError, match="virtual_microbatch must be an int, got float"):
        make_tag(Direction.FORWARD, 1.5)


def test_split_tag_rejects_foreign_tags():
    with pytest.raises(ValueError, match="was not made by make_tag"):
        split_tag(12345)
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        split_tag(2**64)


@pytest.mark.parametrize("bad_job", ["", "has space", "a/b", "dot.ted", "ünïcode", "x" * 65])
def test_invalid_job_id(bad_job):
    with pytest.raises(ValueError, match="invalid job_id"):
        Transport(0, 2, bad_job)


def test_job_id_must_be_a_string():
    with pytest.raises(TypeError, match="job_id must be a str"):
        Transport(0, 2, 42)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"rank": 2, "world_size": 2}, ValueError, "rank 2 is out of range for world_size 2"),
        ({"rank": -1, "world_size": 2}, ValueError, "rank -1 is out of range"),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size must be >= 1"),
        ({"rank": True, "world_size": 2}, TypeError, "rank must be an int, got bool"),
        ({"peers": [5]}, ValueError, "peer 5 is out of range for world_size 4"),
        ({"peers": [0]}, ValueError, "rank 0 cannot be its own peer"),
        ({"peers": [1, 1]}, ValueError, "peer 1 listed twice"),
        ({"slot_bytes": 1000}, ValueError, "slot_bytes must be a multiple of 4096"),
        ({"slot_bytes": 0}, ValueError, "slot_bytes must be >= 1"),
        ({"num_slots": 1}, ValueError, "num_slots must be between 2 and 2\\*\\*20"),
        ({"max_message_bytes": 0}, ValueError, "max_message_bytes must be >= 1"),
        ({"send_workers": 0}, ValueError, "send_workers must be between 1 and 64"),
        ({"timeout_s": 0}, ValueError, "timeout_s must be a positive number"),
        ({"timeout_s": math.nan}, ValueError, "timeout_s must be a positive number"),
        ({"timeout_s": "10"}, TypeError, "timeout_s must be a number"),
    ],
)
def test_invalid_constructor_arguments(job_id, kwargs, error, message):
    arguments = {"rank": 0, "world_size": 4, **kwargs}
    with pytest.raises(error, match=message):
        Transport(job_id=job_id, **arguments)


@pytest.fixture
def lonely(job_id):
    """Rank 0 of 3 whose peers never start; enough for argument checks that fail before any waiting."""
    transport = Transport(0, 3, job_id, peers=[1], max_message_bytes=1000, timeout_s=0.3)
    yield transport
    transport.close()


@pytest.mark.parametrize(
    "peer, message",
    [
        (0, "rank 0 cannot send to itself"),
        (3, "peer 3 is out of range for world_size 3"),
        (-1, "peer -1 is out of range"),
        (2, r"rank 2 is not among the peers \[1\] of rank 0"),
    ],
)
def test_send_to_unknown_peer(lonely, peer, message):
    with pytest.raises(ValueError, match=message):
        lonely.send(peer, 1, torch.zeros(2))


@pytest.mark.parametrize("peer, message", [(0, "cannot receive from itself"), (2, "not among the peers")])
def test_receive_from_unknown_peer(lonely, peer, message):
    with pytest.raises(ValueError, match=message):
        lonely.try_recv(peer, 1)
    with pytest.raises(ValueError, match=message):
        lonely.recv(peer, 1, timeout=0)
    with pytest.raises(ValueError, match=message):
        lonely.wait_any([(1, 1), (peer, 1)], timeout=0)


def test_bad_tags(lonely):
    with pytest.raises(ValueError, match="tag must be >= 0"):
        lonely.send(1, -1, torch.zeros(1))
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        lonely.try_recv(1, 2**64)
    with pytest.raises(TypeError, match="tag must be an int, got str"):
        lonely.recv(1, "x")


def test_tensor_too_big_names_both_sizes(lonely):
    with pytest.raises(ValueError, match="message of 4000 bytes exceeds max_message_bytes=1000"):
        lonely.send(1, 1, torch.zeros(1000))


def test_unsendable_objects(lonely):
    with pytest.raises(TypeError, match="can only send torch.Tensor, got list"):
        lonely.send(1, 1, [1, 2])
    with pytest.raises(ValueError, match="can only send dense tensors"):
        lonely.send(1, 1, torch.zeros(3, 3).to_sparse())
    with pytest.raises(ValueError, match="cannot send a tensor on device meta"):
        lonely.send(1, 1, torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="at most 32 are supported"):
        lonely.send(1, 1, torch.zeros([1] * 33))


def test_bad_wait_arguments(lonely):
    with pytest.raises(ValueError, match="wait_any needs at least one"):
        lonely.wait_any([])
    with pytest.raises(TypeError, match=r"keys must be \(peer, tag\) pairs"):
        lonely.wait_any([1])
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        lonely.recv(1, 1, timeout=-1)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        lonely.try_recv(1, 1, dtype="float32")


def test_peer_that_never_starts_times_out_naming_peer_and_tag(lonely):
    tag = make_tag(Direction.FORWARD, 5)
    with pytest.raises(TransportTimeout, match=r"rank 0 timed out after 0.2 s waiting for tag FORWARD vmb=5 iter=0 "
                                               r"from peer rank 1"):
        lonely.recv(1, tag, timeout=0.2)
    handle = lonely.send(1, tag, torch.zeros(4))
    with pytest.raises(TransportTimeout, match=r"waiting for peer rank 1 to start \(rank 0 was sending tag FORWARD "
                                               r"vmb=5 iter=0\)"):
        handle.wait(timeout=5)
    assert isinstance(TransportTimeout("x"), TimeoutError)
    assert issubclass(PeerDied, RuntimeError) and issubclass(TransportClosed, RuntimeError)


def test_failed_send_is_reported_by_the_next_call(lonely):
    lonely.send(1, 7, torch.zeros(4))  # the handle is dropped: the failure must still surface
    time.sleep(1.0)  # the send gives up after timeout_s=0.3 s
    with pytest.raises(TransportTimeout, match="waiting for peer rank 1 to start"):
        lonely.poll()
    assert lonely.poll() == []  # reported once; the transport stays usable


def test_closed_transport_rejects_every_call(job_id):
    transport = Transport(0, 2, job_id)
    transport.close()
    transport.close()  # idempotent
    assert transport.closed
    calls = [
        lambda: transport.send(1, 1, torch.zeros(1)),
        lambda: transport.poll(),
        lambda: transport.try_recv(1, 1),
        lambda: transport.recv(1, 1),
        lambda: transport.wait_any([(1, 1)]),
        lambda: transport.wait_sends(),
    ]
    for call in calls:
        with pytest.raises(TransportClosed, match="transport of rank 0 is closed"):
            call()


def test_single_rank_job_has_no_peers(job_id):
    with Transport(0, 1, job_id) as transport:
        assert transport.peers == ()
        assert transport.poll() == []
        with pytest.raises(ValueError, match="cannot send to itself"):
            transport.send(0, 1, torch.zeros(1))
