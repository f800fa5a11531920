"""The receive slots a transport opens when its caller names none: MEGATRON_APP_SLOT_MIB and MEGATRON_APP_SLOTS
(transport.slot_geometry.default_slot_geometry), read by the runtime's transport and by the launchers' /dev/shm
estimate alike."""

import pytest
import torch
from transport_helpers.common import job_id_fixture, same_bits  # noqa: F401  (provides the job_id fixture)

from megatron_app.transport import Direction, Transport, make_tag
from megatron_app.transport.slot_geometry import default_slot_geometry

FWD = Direction.FORWARD


def test_the_defaults_and_the_environment():
    assert default_slot_geometry({}) == (1 << 20, 16)
    assert default_slot_geometry({"MEGATRON_APP_SLOT_MIB": "8", "MEGATRON_APP_SLOTS": "4"}) == (8 << 20, 4)
    assert default_slot_geometry({"MEGATRON_APP_SLOT_MIB": " 2 "}) == (2 << 20, 16)
    for name, value in (("MEGATRON_APP_SLOT_MIB", "x"), ("MEGATRON_APP_SLOT_MIB", "0"), ("MEGATRON_APP_SLOTS", "1"),
                        ("MEGATRON_APP_SLOTS", "2.5")):
        with pytest.raises(ValueError, match=f"{name}='{value}' must be a whole number from"):
            default_slot_geometry({name: value})


def test_the_shared_memory_estimate_follows_the_environment(monkeypatch):
    from megatron_app.train.shm_budget import estimate

    default = estimate(2, 1, 1, ranks_per_node=2)
    monkeypatch.setenv("MEGATRON_APP_SLOT_MIB", "8")
    monkeypatch.setenv("MEGATRON_APP_SLOTS", "4")
    larger = estimate(2, 1, 1, ranks_per_node=2)
    assert larger.per_rank > default.per_rank >= 16 << 20
    assert larger.per_rank >= 32 << 20 and larger.needed == 2 * larger.per_rank


def test_peers_of_either_geometry_exchange_bit_exact_tensors(job_id, monkeypatch):
    """A receiver with 8 MiB slots and a sender with the default 1 MiB ones (and the reverse): the sender writes in
    its receiver's geometry, read from the receiver's segment."""
    monkeypatch.setenv("MEGATRON_APP_SLOT_MIB", "8")
    monkeypatch.setenv("MEGATRON_APP_SLOTS", "4")
    big_slots = Transport(1, 2, job_id, timeout_s=30)
    monkeypatch.delenv("MEGATRON_APP_SLOT_MIB")
    monkeypatch.delenv("MEGATRON_APP_SLOTS")
    default = Transport(0, 2, job_id, timeout_s=30)
    try:
        for size in (17, 3 << 20, (20 << 20) + 5):      # within a slot, between the two sizes, several 8 MiB slots
            tensor = torch.randint(0, 255, (size,), dtype=torch.uint8)
            default.send(1, make_tag(FWD, size), tensor)
            assert same_bits(big_slots.recv(0, make_tag(FWD, size), timeout=30), tensor)
            big_slots.send(0, make_tag(FWD, size), tensor)
            assert same_bits(default.recv(1, make_tag(FWD, size), timeout=30), tensor)
        default.wait_sends(timeout=30)
        big_slots.wait_sends(timeout=30)
    finally:
        default.close()
        big_slots.close()
