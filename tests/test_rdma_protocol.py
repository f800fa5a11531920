"""The RDMA backend's device-independent logic (csrc/shm_tensor_rdma/rdma/rdma_{wire,chunk,flow,qp_state,settings}),
through the test-only submodule _rdma_protocol, plus how the build and the backend choice behave on this host.
Tests that need an RDMA device skip with the reason (no kernel RDMA support on these machines)."""

import collections
import random
import zlib

import pytest

from megatron_app.transport import _shm_tensor_rdma as core

proto = core._rdma_protocol

VERBS_HEADER = "/usr/include/infiniband/verbs.h"


def _info(**changes):
    fields = dict(role="receiver", rank=3, job_id="job42", qp_num=0x1234, psn=0xABCDE, lid=7, mtu=5, link_layer=1,
                  gid=bytes(range(16)), ring_address=0x7F0000001000, ring_rkey=0x55, slot_count=16,
                  slot_bytes=1 << 20)
    fields.update(changes)
    return fields


# ---- bootstrap wire format -----------------------------------------------------------------------------------

def test_endpoint_info_round_trips_random_fields():
    rng = random.Random(1)
    for _ in range(200):
        info = _info(role=rng.choice(["sender", "receiver"]), rank=rng.randrange(0, 1 << 31),
                     job_id="".join(rng.choice("abc-_0123") for _ in range(rng.randrange(0, 64))),
                     qp_num=rng.randrange(1 << 24), psn=rng.randrange(1 << 24), lid=rng.randrange(1 << 16),
                     mtu=rng.randint(1, 5), link_layer=rng.choice([1, 2]), gid=rng.randbytes(16),
                     ring_address=rng.randrange(1, 1 << 64), ring_rkey=rng.randrange(1 << 32),
                     slot_count=rng.randrange(1, 1 << 32), slot_bytes=rng.randrange(1, 1 << 64))
        encoded = proto.encode_endpoint_info(info)
        assert len(encoded) == proto.endpoint_info_bytes()
        assert proto.decode_endpoint_info(encoded) == info


def test_endpoint_info_ends_with_the_zlib_crc32_of_the_rest():
    encoded = proto.encode_endpoint_info(_info())
    assert int.from_bytes(encoded[-4:], "little") == zlib.crc32(encoded[:-4])
    assert proto.crc32(b"123456789") == 0xCBF43926


def test_every_flipped_byte_is_rejected_with_a_reason():
    encoded = bytearray(proto.encode_endpoint_info(_info()))
    for position in range(len(encoded)):
        corrupt = bytearray(encoded)
        corrupt[position] ^= 0x40
        with pytest.raises(ValueError) as error:
            proto.decode_endpoint_info(bytes(corrupt))
        assert any(word in str(error.value) for word in ("magic", "version", "checksum")), (position, error.value)


@pytest.mark.parametrize("size_change", [-1, 1, -100])
def test_truncated_or_padded_info_is_rejected(size_change):
    encoded = proto.encode_endpoint_info(_info())
    bad = encoded[:size_change] if size_change < 0 else encoded + b"\0" * size_change
    with pytest.raises(ValueError, match=rf"endpoint info of {len(bad)} bytes, expected {len(encoded)}"):
        proto.decode_endpoint_info(bad)


def test_other_version_is_named():
    encoded = bytearray(proto.encode_endpoint_info(_info()))
    encoded[4] = 9  # version, little-endian u16 after the magic
    with pytest.raises(ValueError, match="rdma protocol version 9 != ours"):
        proto.decode_endpoint_info(bytes(encoded))


@pytest.mark.parametrize("changes, fragment", [
    (dict(qp_num=1 << 24), "qp_num 16777216 over 24 bits"),
    (dict(psn=1 << 24), "psn 16777216 over 24 bits"),
    (dict(mtu=0), "path mtu code 0 not in 1..5"),
    (dict(link_layer=3), "link layer code 3"),
    (dict(slot_count=0), "slot count is 0"),
    (dict(ring_address=0), "receiver announced no slot ring"),
    (dict(job_id="j" * 64), "longer than 63 characters"),
])
def test_out_of_range_fields_are_refused_at_encoding(changes, fragment):
    with pytest.raises(ValueError, match=fragment):
        proto.encode_endpoint_info(_info(**changes))


def test_a_sender_needs_no_ring():
    sender = _info(role="sender", ring_address=0, ring_rkey=0, slot_bytes=0)
    assert proto.decode_endpoint_info(proto.encode_endpoint_info(sender)) == sender


def test_endpoint_peer_check_names_the_mismatch():
    sender = _info(role="sender")
    assert proto.check_endpoint_peer(sender, "sender", "job42", [1, 3]) == ""
    assert proto.check_endpoint_peer(sender, "sender", "other", [3]) == "rank 3 belongs to job 'job42'"
    assert "connected as a sender where a receiver was expected" in proto.check_endpoint_peer(
        sender, "receiver", "job42", [3])
    assert proto.check_endpoint_peer(sender, "sender", "job42", [1, 2]) == "rank 3 is not an rdma peer of this rank"


def test_control_frame_round_trip_and_rejects():
    bye = proto.encode_control(proto.BYE)
    assert len(bye) == proto.CONTROL_BYTES
    assert proto.decode_control(bye) == proto.BYE
    with pytest.raises(ValueError, match="bad magic"):
        proto.decode_control(b"\0" * proto.CONTROL_BYTES)
    with pytest.raises(ValueError, match="unknown control frame kind 7"):
        proto.decode_control(bye[:4] + (7).to_bytes(4, "little"))
    with pytest.raises(ValueError, match="control frame of 3 bytes"):
        proto.decode_control(bye[:3])


# ---- chunks --------------------------------------------------------------------------------------------------

def test_slot_geometry():
    header = proto.CHUNK_HEADER_BYTES
    assert proto.slot_payload_bytes(4096) == 4096 - header
    with pytest.raises(ValueError, match="cannot hold"):
        proto.slot_payload_bytes(header)
    assert proto.chunk_count(0, 100) == 1
    assert proto.chunk_count(100, 100) == 1
    assert proto.chunk_count(101, 100) == 2


def _assemble(assembler, slots, first_sequence):
    results = [assembler.accept(slot, first_sequence + i) for i, slot in enumerate(slots)]
    assert all(result is None for result in results[:-1])
    assert results[-1] is not None
    return results[-1]


def test_chunking_round_trips_random_sizes():
    rng = random.Random(7)
    for slot_bytes in (proto.CHUNK_HEADER_BYTES + 1, 512, 4096):
        capacity = proto.slot_payload_bytes(slot_bytes)
        sizes = [0, 1, capacity - 1, capacity, capacity + 1] + [rng.randrange(0, 6 * capacity) for _ in range(30)]
        assembler = proto.MessageAssembler(slot_bytes, 1 << 30)
        sequence = 0
        for index, size in enumerate(sizes):
            payload = rng.randbytes(size)
            shape = [size // 2, 2] if size % 2 == 0 else [size]
            slots = proto.write_chunks(payload, index + 100, 3, shape, slot_bytes, sequence, index)
            assert len(slots) == proto.chunk_count(size, capacity)
            assert all(len(slot) <= slot_bytes for slot in slots)
            tag, dtype_code, got_shape, got = _assemble(assembler, slots, sequence)
            assert (tag, dtype_code, got_shape, got) == (index + 100, 3, shape, payload)
            assert not assembler.mid_message
            sequence += len(slots)


def test_read_chunk_validates_what_arrived():
    slot_bytes = 1024
    slots = proto.write_chunks(bytes(2000), 5, 1, [2000], slot_bytes, 40, 0)
    fields = proto.read_chunk(slots[1], 41, slot_bytes, 1 << 20)
    assert (fields["sequence"], fields["offset"], fields["length"], fields["nbytes"]) == (
        41, proto.slot_payload_bytes(slot_bytes), proto.slot_payload_bytes(slot_bytes), 2000)
    with pytest.raises(ValueError, match="carries sequence 41"):
        proto.read_chunk(slots[1], 42, slot_bytes, 1 << 20)
    with pytest.raises(ValueError, match="bad magic"):
        proto.read_chunk(b"\xff" + slots[0][1:], 40, slot_bytes, 1 << 20)
    with pytest.raises(ValueError, match="arrived with"):
        proto.read_chunk(slots[0][:-1], 40, slot_bytes, 1 << 20)
    with pytest.raises(ValueError, match="less than its header"):
        proto.read_chunk(slots[0][:10], 40, slot_bytes, 1 << 20)
    with pytest.raises(ValueError, match="over max_message_bytes=1000"):
        proto.read_chunk(slots[0], 40, slot_bytes, 1000)
    with pytest.raises(ValueError, match="claims bytes"):  # a sender with bigger slots than ours
        proto.read_chunk(proto.write_chunks(bytes(2000), 5, 1, [2000], 4096, 0, 0)[0], 0, slot_bytes, 1 << 20)


def test_assembler_rejects_gaps_and_foreign_chunks():
    slot_bytes = 512
    first = proto.write_chunks(bytes(range(256)) * 4, 1, 1, [1024], slot_bytes, 0, 0)
    assert len(first) >= 3
    skipping = proto.MessageAssembler(slot_bytes, 1 << 20)
    skipping.accept(first[0], 0)
    with pytest.raises(ValueError, match="carries sequence 2"):
        skipping.accept(first[2], 1)  # chunk 1 went missing
    other = proto.write_chunks(bytes(1024), 2, 1, [1024], slot_bytes, 1, 1)
    mixing = proto.MessageAssembler(slot_bytes, 1 << 20)
    mixing.accept(first[0], 0)
    with pytest.raises(ValueError, match="does not continue"):
        mixing.accept(other[0], 1)
    late = proto.MessageAssembler(slot_bytes, 1 << 20)
    with pytest.raises(ValueError, match="but message 0 starts next"):
        late.accept(proto.write_chunks(b"x", 1, 1, [1], slot_bytes, 0, 1)[0], 0)


# ---- flow control --------------------------------------------------------------------------------------------

def test_widen_sequence_across_the_32_bit_wrap():
    assert proto.widen_sequence(5, 9) == 9
    assert proto.widen_sequence((1 << 32) - 2, 1) == (1 << 32) + 1
    assert proto.widen_sequence(3 << 32, 0) == 3 << 32


def test_send_window_needs_both_credit_and_local_completion():
    window = proto.SendWindow(2)
    assert [window.claim(), window.claim()] == [0, 1]
    assert not window.can_claim()
    with pytest.raises(RuntimeError, match="no free rdma slot"):
        window.claim()
    window.on_credit(1)  # the receiver released chunk 0 ...
    assert not window.can_claim()  # ... but the staging slot's write has not completed
    window.on_write_completed()
    assert window.can_claim() and window.claim() == 2 and window.slot_of(2) == 0
    with pytest.raises(ValueError, match="credit for 4 chunks, but only 3 were sent"):
        window.on_credit(4)
    window.on_write_completed()
    window.on_write_completed()
    assert window.writes_done
    with pytest.raises(RuntimeError, match="never posted"):
        window.on_write_completed()


def test_slot_releases_credit_only_the_contiguous_prefix():
    releases = proto.SlotReleases(4)
    assert [releases.on_arrival(i) for i in range(4)] == [0, 1, 2, 3]
    releases.release(2)
    releases.release(1)
    assert releases.released_prefix == 0
    with pytest.raises(ValueError, match="overwrote slot 0 while chunk 0 was still unreleased"):
        releases.on_arrival(4)
    releases.release(0)
    assert releases.released_prefix == 3
    with pytest.raises(ValueError, match="not held"):
        releases.release(1)
    with pytest.raises(ValueError, match="arrived where chunk 4 was next"):
        releases.on_arrival(5)
    assert releases.on_arrival(4) == 4


def test_credit_return_batches_flushes_when_idle_and_caps_in_flight():
    credits = proto.CreditReturn(batch=3, max_in_flight=1)
    assert credits.due(2, False) is None
    assert credits.due(2, True) == 2
    assert credits.in_flight == 1
    assert credits.due(9, True) is None  # one unacknowledged credit message already
    credits.on_send_completed()
    assert credits.due(4, False) is None  # 2 pending < batch
    assert credits.due(5, False) == 5
    with pytest.raises(ValueError, match="went back"):
        credits.due(4, True)
    credits.on_send_completed()
    with pytest.raises(RuntimeError, match="never posted"):
        credits.on_send_completed()


def _simulate_link(seed, messages=50, make_window=proto.SendWindow):
    """Sender, network and receiver of one link driven by a seeded RNG: random message sizes, delays, completion
    times, release orders and speeds. The property: a chunk never lands in a remote slot whose previous chunk the
    receiver has not released, and every message arrives intact and in order (no stall)."""
    rng = random.Random(seed)
    slot_count = rng.randint(1, 8)
    slot_bytes = rng.choice([proto.CHUNK_HEADER_BYTES + 8, 400, 1024])
    window = make_window(slot_count)
    releases = proto.SlotReleases(slot_count)
    credits = proto.CreditReturn(batch=rng.randint(1, slot_count), max_in_flight=rng.randint(1, slot_count))
    assembler = proto.MessageAssembler(slot_bytes, 1 << 20)
    ring = [None] * slot_count           # per remote slot: (sequence, bytes) of the chunk it holds, until released
    wire = collections.deque()           # writes posted, not landed yet (one RC queue pair: in order)
    landed = collections.deque()         # landed, completion not processed by the receiver yet
    held = []                            # processed (copied out) but not released yet: released in random order
    unacked_writes = 0                   # posted writes whose local completion the sender has not seen
    credit_wire = collections.deque()    # credit messages on their way back
    sent = [rng.randbytes(rng.randrange(0, 3 * slot_bytes)) for _ in range(messages)]
    received = []
    chunks = collections.deque()
    for index, payload in enumerate(sent):
        chunks.extend((index, chunk) for chunk in range(proto.chunk_count(len(payload),
                                                                            proto.slot_payload_bytes(slot_bytes))))
    message_slots = {}

    def flush(idle):
        credit = credits.due(releases.released_prefix, idle)
        if credit is not None:
            credit_wire.append(credit & 0xFFFFFFFF)  # the 32-bit immediate

    for step in range(100000):
        if len(received) == messages:
            assert window.credited <= window.claimed
            return step
        action = rng.random()
        if action < 0.25 and chunks and window.can_claim():  # sender posts the next chunk
            index, chunk = chunks.popleft()
            sequence = window.claim()
            if index not in message_slots:  # encode the whole message once its first chunk's sequence is known
                message_slots[index] = proto.write_chunks(sent[index], index, 0, [len(sent[index])], slot_bytes,
                                                          sequence, index)
            wire.append((sequence, message_slots[index][chunk]))
            unacked_writes += 1
        elif action < 0.4 and wire:  # the write lands in the receiver's slot
            sequence, data = wire.popleft()
            slot = sequence % slot_count
            assert ring[slot] is None, f"seed {seed}: chunk {sequence} landed on unreleased chunk {ring[slot][0]}"
            ring[slot] = (sequence, data)
            landed.append(sequence)
        elif action < 0.5 and unacked_writes:
            window.on_write_completed()
            unacked_writes -= 1
        elif action < 0.65 and landed:  # receiver handles the oldest completion: copies the chunk out
            sequence = releases.on_arrival(landed.popleft() & 0xFFFFFFFF)
            done = assembler.accept(ring[releases.slot_of(sequence)][1], sequence)
            if done is not None:
                received.append(done[3])
            held.append(sequence)
        elif action < 0.8 and held:  # ... and releases some chunk, any order, at any speed
            sequence = held.pop(rng.randrange(len(held)))
            ring[releases.slot_of(sequence)] = None
            releases.release(sequence)
            flush(idle=False)
        elif action < 0.9 and credit_wire:
            window.on_credit(credit_wire.popleft())
            credits.on_send_completed()
        elif not landed:  # the receiver's loop ran out of work: owed credits go back now
            flush(idle=True)
    assert received == sent[:len(received)]
    raise AssertionError(f"seed {seed}: link stalled after {len(received)} of {messages} messages")


def test_flow_control_never_overwrites_an_unreleased_slot():
    for seed in range(60):
        _simulate_link(seed)


class _CreditBlindWindow:
    """A broken sender: it waits for its own write completions but never for the receiver's credits."""

    def __init__(self, slot_count):
        self.slots, self.claimed, self.completed, self.credited = slot_count, 0, 0, 0

    def can_claim(self):
        return self.claimed - self.completed < self.slots

    def claim(self):
        self.claimed += 1
        return self.claimed - 1

    def slot_of(self, sequence):
        return sequence % self.slots

    def on_write_completed(self):
        self.completed += 1

    def on_credit(self, low_bits):
        self.credited = proto.widen_sequence(self.credited, low_bits)


def test_the_simulation_catches_a_sender_that_ignores_credits():
    failures = 0
    for seed in range(20):
        try:
            _simulate_link(seed, make_window=_CreditBlindWindow)
        except AssertionError as error:
            assert "landed on unreleased chunk" in str(error)
            failures += 1
    assert failures > 10


def test_simulated_messages_arrive_intact_and_in_order():
    rng = random.Random(99)
    slot_bytes = 600
    window, releases = proto.SendWindow(3), proto.SlotReleases(3)
    assembler = proto.MessageAssembler(slot_bytes, 1 << 20)
    payloads = [rng.randbytes(rng.randrange(0, 2000)) for _ in range(20)]
    got = []
    for index, payload in enumerate(payloads):
        first = window.claimed
        for offset, chunk in enumerate(proto.write_chunks(payload, index, 0, [len(payload)], slot_bytes, first, index)):
            sequence = window.claim()
            assert sequence == first + offset
            window.on_write_completed()
            releases.on_arrival(sequence)
            done = assembler.accept(chunk, sequence)
            releases.release(sequence)
            window.on_credit(releases.released_prefix)
            if done is not None:
                got.append(done[3])
    assert got == payloads


# ---- queue pair states ---------------------------------------------------------------------------------------

def test_queue_pair_goes_up_in_order_only():
    machine = proto.QpStateMachine()
    assert machine.state == "RESET" and not machine.ready
    with pytest.raises(RuntimeError, match="illegal queue pair transition RESET -> RTR"):
        machine.advance("RTR")
    for state in ("INIT", "RTR", "RTS"):
        machine.advance(state)
    assert machine.ready
    with pytest.raises(RuntimeError, match="illegal queue pair transition RTS -> INIT"):
        machine.advance("INIT")
    machine.advance("ERROR")
    assert not machine.ready
    with pytest.raises(RuntimeError, match="ERROR -> ERROR"):
        machine.advance("ERROR")
    machine.advance("CLOSED")
    with pytest.raises(RuntimeError, match="CLOSED -> RESET"):
        machine.advance("RESET")
    with pytest.raises(ValueError, match="unknown queue pair state 'RTX'"):
        machine.advance("RTX")


def test_transition_table():
    states = ["RESET", "INIT", "RTR", "RTS", "ERROR", "CLOSED"]
    allowed = {(a, b) for a in states for b in states if proto.QpStateMachine.allowed(a, b)}
    up = {("RESET", "INIT"), ("INIT", "RTR"), ("RTR", "RTS")}
    down = {(a, "ERROR") for a in states[:4]} | {(a, "CLOSED") for a in states[:5]}
    assert allowed == up | down


# ---- settings and the choice of port and GID -----------------------------------------------------------------

def test_settings_from_the_environment():
    assert proto.parse_settings({}) == dict(device="", port=0, gid_index=-1, slot_bytes=1 << 20, slot_count=16)
    parsed = proto.parse_settings({"MEGATRON_APP_RDMA_DEVICE": "mlx5_1:2", "MEGATRON_APP_RDMA_GID_INDEX": "3",
                                   "MEGATRON_APP_RDMA_SLOT_BYTES": "65536", "MEGATRON_APP_RDMA_SLOTS": "32"})
    assert parsed == dict(device="mlx5_1", port=2, gid_index=3, slot_bytes=65536, slot_count=32)


@pytest.mark.parametrize("name, value, fragment", [
    ("MEGATRON_APP_RDMA_SLOTS", "1", "MEGATRON_APP_RDMA_SLOTS='1' must be a whole number from 2 to 4096"),
    ("MEGATRON_APP_RDMA_SLOT_BYTES", "1k", "MEGATRON_APP_RDMA_SLOT_BYTES='1k' must be a whole number"),
    ("MEGATRON_APP_RDMA_GID_INDEX", "-1", "MEGATRON_APP_RDMA_GID_INDEX='-1'"),
    ("MEGATRON_APP_RDMA_DEVICE", "mlx5_0:x", "port='x'"),
    ("MEGATRON_APP_RDMA_DEVICE", ":1", "names no device"),
])
def test_bad_settings_are_named(name, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        proto.parse_settings({name: value})


IPV4_MAPPED = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 2])
LINK_LOCAL = b"\xfe\x80" + bytes(6) + bytes(range(8))


def _port(device="mlx5_0", port=1, active=True, link_layer=proto.LINK_LAYER_ETHERNET, gids=()):
    return dict(device=device, port=port, active=active, link_layer=link_layer, gids=list(gids))


def test_gid_choice_prefers_roce_v2_with_an_ipv4_address():
    roce = _port(gids=[(0, 1, LINK_LOCAL), (1, 2, LINK_LOCAL), (2, 1, IPV4_MAPPED), (3, 2, IPV4_MAPPED)])
    assert proto.choose_gid_index(roce, -1) == 3
    assert proto.choose_gid_index(_port(gids=[(0, 1, LINK_LOCAL), (1, 2, LINK_LOCAL)]), -1) == 1
    assert proto.choose_gid_index(_port(gids=[(0, 1, LINK_LOCAL)]), -1) == 0
    assert proto.choose_gid_index(roce, 2) == 2
    with pytest.raises(ValueError, match="MEGATRON_APP_RDMA_GID_INDEX=9 is not a valid GID of mlx5_0 port 1"):
        proto.choose_gid_index(roce, 9)
    with pytest.raises(ValueError, match="has no RoCE GID"):
        proto.choose_gid_index(_port(gids=[(0, 2, bytes(16))]), -1)
    infiniband = _port(link_layer=proto.LINK_LAYER_INFINIBAND, gids=[(0, 0, LINK_LOCAL)])
    assert proto.choose_gid_index(infiniband, -1) == -1  # routed by LID


def test_port_choice():
    ib = proto.LINK_LAYER_INFINIBAND
    ports = [_port("mlx5_0", 1, active=False, link_layer=ib), _port("mlx5_1", 1, link_layer=ib),
             _port("mlx5_10", 1, gids=[(3, 2, IPV4_MAPPED)])]
    assert proto.choose_port(ports, "", 0, -1) == ("mlx5_1", 1)
    assert proto.choose_port(ports, "mlx5_10", 0, -1) == ("mlx5_10", 1)
    with pytest.raises(ValueError, match=r"MEGATRON_APP_RDMA_DEVICE=mlx5_3 not found \(devices: mlx5_0, mlx5_1, mlx5_10\)"):
        proto.choose_port(ports, "mlx5_3", 0, -1)
    with pytest.raises(ValueError, match=r"no usable RDMA port: mlx5_0 port 1 \(InfiniBand, not active\)"):
        proto.choose_port(ports, "mlx5_0", 0, -1)
    with pytest.raises(ValueError, match="mlx5_1 has no port 2"):
        proto.choose_port(ports, "mlx5_1", 2, -1)
    with pytest.raises(ValueError, match="^no RDMA devices$"):
        proto.choose_port([], "", 0, -1)
