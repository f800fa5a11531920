"""Byte-level fuzzing of every wire format the transport parses: TCP hello and frame headers (parsers and a live
link), RDMA endpoint info, control frames and slot chunks (with their CRC), shared-memory segment and ring headers
(a Python "peer" scribbles into a real receiver's segment) and the tensor codec. Every hostile input must end in
one clear error for its link: no crash, no hang, no access outside a buffer (tools/run_tests.sh reruns this file
under ASan+UBSan), no allocation sized by an unchecked length.

Short and seeded here (derandomize=True). The long run sets MEGATRON_APP_FUZZ_EXAMPLES (parser tests run that many
inputs, live-link tests a tenth of it):
    MEGATRON_APP_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/test_wire_fuzz.py -q
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import socket
import struct
import time
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_app.transport import _shm_tensor_rdma as core
from megatron_app.transport import PeerDied, Transport, TransportClosed, TransportTimeout
from megatron_app.transport import codec
from megatron_app.transport.dtypes import CODE_TO_DTYPE

wire = core._wire
proto = core._rdma_protocol

LONG_EXAMPLES = int(os.environ.get("MEGATRON_APP_FUZZ_EXAMPLES", "0"))


def fuzz(short: int, *, live: bool = False):
    """Seeded hypothesis settings: `short` inputs in the test command, MEGATRON_APP_FUZZ_EXAMPLES in a long run."""
    examples = short if not LONG_EXAMPLES else max(short, LONG_EXAMPLES // 10 if live else LONG_EXAMPLES)
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def mutated(valid: bytes):
    """`valid` with some bytes overwritten, some u64 fields set to extreme values, or cut/extended."""
    extremes = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1]
    edit = st.one_of(
        st.tuples(st.just("byte"), st.integers(0, len(valid) - 1), st.integers(0, 255)),
        st.tuples(st.just("u64"), st.integers(0, len(valid) // 8 - 1), st.sampled_from(extremes)),
        st.tuples(st.just("u32"), st.integers(0, len(valid) // 4 - 1), st.sampled_from(extremes[:5])),
    )

    def apply(edits):
        data = bytearray(valid)
        for kind, where, value in edits:
            if kind == "byte":
                data[where] = value
            elif kind == "u64":
                data[8 * where:8 * where + 8] = (value % 2**64).to_bytes(8, "little")
            else:
                data[4 * where:4 * where + 4] = (value % 2**32).to_bytes(4, "little")
        return bytes(data)

    return st.lists(edit, min_size=1, max_size=6).map(apply)


def hostile(valid: bytes):
    """Random bytes of the right size, or a valid encoding with a few fields broken."""
    return st.one_of(st.binary(min_size=len(valid), max_size=len(valid)), mutated(valid))


# ---- the message header every backend carries ----------------------------------------------------------------

MESSAGE = struct.Struct("<QQII32q")
MAX_MESSAGE = 1 << 20


def message_header(tag=7, nbytes=16, dtype=9, shape=(4,)):
    return MESSAGE.pack(tag, nbytes, dtype, len(shape), *shape, *([0] * (32 - len(shape))))


def message_problem(header: bytes, max_message_bytes: int) -> bool:
    """The rules the receivers apply (message_header_problem in message.cpp), for the oracle."""
    _tag, nbytes, _dtype, ndim, *shape = MESSAGE.unpack(header)
    return ndim > 32 or any(extent < 0 for extent in shape[:ndim]) or nbytes > max_message_bytes


# ---- TCP hello and frame headers ------------------------------------------------------------------------------

TCP_MAGIC, TCP_VERSION = 0x5450414D, 1
JOB = "fuzzjob"


def tcp_hello(rank=1, job_id=JOB, magic=TCP_MAGIC, version=TCP_VERSION):
    return struct.pack("<IIiI", magic, version, rank, 0) + job_id.encode().ljust(64, b"\0")


def tcp_frame(kind=1, header=None):
    return struct.pack("<II", TCP_MAGIC, kind) + (header if header is not None else message_header())


def test_layouts_match_the_core():
    assert wire.TCP_HELLO_BYTES == len(tcp_hello())
    assert wire.TCP_FRAME_BYTES == len(tcp_frame())
    assert wire.SHM_LAYOUT["message_shape"] == 24 and wire.SHM_LAYOUT["chunk_bytes"] == MESSAGE.size + 16


@fuzz(1000)
@given(hostile(tcp_hello()))
def test_tcp_hello_fuzz(data):
    problem = wire.tcp_hello_problem(data, JOB, [1, 2])
    magic, version, rank, _ = struct.unpack_from("<IIiI", data)
    job = data[16:80].split(b"\0", 1)[0]
    accepted = magic == TCP_MAGIC and version == TCP_VERSION and job == JOB.encode() and rank in (1, 2)
    assert (problem == "") == accepted, problem


@pytest.mark.parametrize("size", [0, 1, len(tcp_hello()) - 1, len(tcp_hello()) + 1])
def test_tcp_hello_of_the_wrong_size_is_refused(size):
    with pytest.raises(ValueError, match="hello of"):
        wire.tcp_hello_problem(b"\0" * size, JOB, [1])


@fuzz(1000)
@given(st.one_of(hostile(tcp_frame()), hostile(tcp_frame(kind=2, header=bytes(MESSAGE.size)))))
def test_tcp_frame_header_fuzz(data):
    problem = wire.tcp_frame_problem(data, MAX_MESSAGE)
    magic, kind = struct.unpack_from("<II", data)
    accepted = magic == TCP_MAGIC and (kind == 2 or (kind == 1 and not message_problem(data[8:], MAX_MESSAGE)))
    assert (problem == "") == accepted, problem
    assert "\n" not in problem


def test_tcp_frame_with_a_negative_extent_is_refused():
    """Regression: a frame's shape was not checked in C++; a negative extent reached the Python codec."""
    assert "negative extent -3" in wire.tcp_frame_problem(tcp_frame(header=message_header(shape=(2, -3))), 1 << 20)


# ---- the tensor codec -----------------------------------------------------------------------------------------

@fuzz(500)
@given(code=st.one_of(st.sampled_from(sorted(CODE_TO_DTYPE)), st.integers(0, 2**32 - 1)),
       shape=st.lists(st.one_of(st.integers(-3, 9), st.integers(-2**63, 2**63 - 1)), max_size=6),
       nbytes=st.one_of(st.integers(0, 64), st.sampled_from([2**31, 2**62, 2**64 - 1])))
def test_codec_decode_fuzz(code, shape, nbytes):
    payload = bytearray(min(nbytes, 64))
    try:
        tensor = codec.decode(code, tuple(shape), nbytes, payload)
    except ValueError as error:
        assert "\n" not in str(error)
        return
    assert tensor.numel() * tensor.element_size() == nbytes <= len(payload)
    assert list(tensor.shape) == shape


def test_codec_refuses_an_empty_message_with_a_huge_shape():
    """Regression: nbytes=0 with a shape of 2**40 elements went to torch.empty, an allocation sized by the peer."""
    with pytest.raises(ValueError, match="does not describe its 0 bytes"):
        codec.decode(9, (1 << 20, 1 << 20), 0, bytearray())


# ---- RDMA endpoint info, control frames and slot chunks -------------------------------------------------------

def endpoint_info(**changes):
    fields = dict(role="receiver", rank=3, job_id="job42", qp_num=0x1234, psn=0xABCDE, lid=7, mtu=5, link_layer=1,
                  gid=bytes(range(16)), ring_address=0x7F0000001000, ring_rkey=0x55, slot_count=16,
                  slot_bytes=1 << 20)
    fields.update(changes)
    return proto.encode_endpoint_info(fields)


def with_crc(data: bytes) -> bytes:
    """Re-seals a mutated endpoint info, so the fuzzer gets past the checksum to the field checks."""
    return data[:-4] + zlib.crc32(data[:-4]).to_bytes(4, "little")


@fuzz(1000)
@given(st.one_of(hostile(endpoint_info()), hostile(endpoint_info()).map(with_crc),
                 hostile(endpoint_info(role="sender")).map(with_crc), st.binary(max_size=200)))
def test_rdma_endpoint_info_fuzz(data):
    try:
        fields = proto.decode_endpoint_info(data)
    except ValueError as error:
        assert "\n" not in str(error)
        return
    # Accepted only with a valid checksum and fields our encoder can write (bytes after the job id's NUL and the
    # reserved byte are ignored).
    assert int.from_bytes(data[-4:], "little") == zlib.crc32(data[:-4])
    assert proto.decode_endpoint_info(proto.encode_endpoint_info(fields)) == fields


@fuzz(300)
@given(st.one_of(hostile(proto.encode_control(proto.BYE)), st.binary(max_size=16)))
def test_rdma_control_frame_fuzz(data):
    try:
        assert proto.decode_control(data) == proto.BYE
    except ValueError:
        return
    assert data == proto.encode_control(proto.BYE)


RDMA_SLOT = 4096


def rdma_slots():
    payload = bytes(range(256)) * 40  # three slots' worth
    return proto.write_chunks(payload, 5, 9, [len(payload) // 4], RDMA_SLOT, 0, 0)


@fuzz(400)
@given(st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.data()), min_size=1, max_size=4))
def test_rdma_chunk_assembly_fuzz(edits):
    """The assembler either rebuilds the message, or stops at the first bad chunk with one ValueError."""
    valid = rdma_slots()
    slots = [bytearray(slot) for slot in valid]
    header_bytes = proto.CHUNK_HEADER_BYTES
    for index, cut, data in edits:
        if cut:
            slots[index] = slots[index][:data.draw(st.integers(0, len(slots[index])))]
        else:
            slots[index] = bytearray(data.draw(mutated(valid[index][:header_bytes]))) + valid[index][header_bytes:]
    assembler = proto.MessageAssembler(RDMA_SLOT, MAX_MESSAGE)
    finished = []
    for sequence, slot in enumerate(slots):
        try:
            result = assembler.accept(bytes(slot), sequence)
        except ValueError as error:
            assert "\n" not in str(error)
            return
        if result is not None:
            finished.append(result)
    for tag, _dtype, shape, payload in finished:
        assert len(payload) >= 0 and all(extent >= 0 for extent in shape)


# ---- shared memory: segment header validation (what a producer attaching to a peer's segment trusts) -----------

def segment_header(num_rings=2, slots=4, slot_bytes=4096):
    """A header as SegmentView::initialize writes it, with the geometry SegmentGeometry::compute gives."""
    layout = wire.SHM_LAYOUT
    rings_offset = (layout["header_bytes"] + 63) // 64 * 64
    chunks_offset = rings_offset + num_rings * layout["ring_bytes"]
    data_offset = (chunks_offset + num_rings * slots * layout["chunk_bytes"] + 4095) // 4096 * 4096
    total = data_offset + num_rings * slots * ((slot_bytes + 4095) // 4096 * 4096)
    header = bytearray(layout["header_bytes"])
    struct.pack_into("<QIiiiQ", header, 0, 0x31766D68735F6D61, 1, 0, 2, os.getpid(), 0)
    wrap = 2**64  # as the C++ computes it
    struct.pack_into("<IIQQQQQ", header, layout["num_rings"], num_rings, slots, slot_bytes, rings_offset % wrap,
                     chunks_offset % wrap, data_offset % wrap, total % wrap)
    return bytes(header), total % wrap


def test_segment_header_builder_matches_the_core():
    header, total = segment_header()
    assert wire.validate_segment_header(header, total) == (2, 4, 4096)
    assert wire.validate_segment_header(header, total - 1) is None


@fuzz(1000)
@given(hostile(segment_header()[0]), st.sampled_from([segment_header()[1], 2**64 - 1]))
def test_segment_header_fuzz(data, size):
    geometry = wire.validate_segment_header(data, size)
    if geometry is None:
        return
    num_rings, slots, slot_bytes = geometry
    rebuilt, total = segment_header(num_rings, slots, slot_bytes)
    layout = wire.SHM_LAYOUT
    fields = slice(layout["num_rings"], layout["total_bytes"] + 8)
    assert data[fields] == rebuilt[fields] and total <= size


def test_segment_header_whose_geometry_overflows_is_refused():
    """Regression: 2**32 slots of 2**32 bytes need 2**64 bytes of slot data, which wrapped around to 0: the header
    claimed a segment of 1.3 TB that the geometry's own arithmetic could not describe."""
    header, total = segment_header(num_rings=2**16, slots=2**16, slot_bytes=2**32)
    assert total < 2**41  # wrapped
    assert wire.validate_segment_header(header, 2**64 - 1) is None


# ---- shared memory: a peer that scribbles into a live receiver's segment --------------------------------------

SHM_SLOT_BYTES, SHM_SLOTS = 4096, 4
PROBE_TAG = 2**40 + 1  # never written by the fuzzer's chunks


def unique_job(prefix):
    return f"{prefix}{os.getpid()}x{time.monotonic_ns() % 10**10}"


class ScribbledSegment:
    """Rank 1's real receive segment; this process plays rank 0, its producer, and writes whatever it likes."""

    def __init__(self):
        self.job = unique_job("fz")
        self.receiver = Transport(1, 2, self.job, backends={0: "shm"}, slot_bytes=SHM_SLOT_BYTES,
                                  num_slots=SHM_SLOTS, max_message_bytes=MAX_MESSAGE, timeout_s=5)
        path = f"/dev/shm/mapp_{self.job}_r1"
        with open(path, "r+b") as file:
            self.memory = mmap.mmap(file.fileno(), os.fstat(file.fileno()).st_size)
        layout = wire.SHM_LAYOUT
        self.layout = layout
        self.rings_offset, self.chunks_offset, self.data_offset = struct.unpack_from(
            "<QQQ", self.memory, layout["rings_offset"])

    def write_chunk(self, slot, header: bytes, offset, length, data=b""):
        at = self.chunks_offset + slot * self.layout["chunk_bytes"]
        self.memory[at:at + MESSAGE.size] = header
        struct.pack_into("<QQ", self.memory, at + MESSAGE.size, offset % 2**64, length % 2**64)
        start = self.data_offset + slot * SHM_SLOT_BYTES
        self.memory[start:start + len(data)] = data

    def publish(self, head):
        struct.pack_into("<Q", self.memory, self.rings_offset + self.layout["ring_head"], head % 2**64)

    def outcome(self):
        """'failed' (one PeerDied naming the corruption) or 'alive'; the receiver is given 0.3 s to notice."""
        try:
            self.receiver.recv(0, PROBE_TAG, timeout=0.3)
        except PeerDied as error:
            text = str(error)
            assert "into the shared memory of rank 1" in text and "\n" not in text, text
            return "failed"
        except TransportTimeout:
            return "alive"
        raise AssertionError("the probe tag arrived")

    def close(self):
        self.memory.close()
        self.receiver.close()


@pytest.fixture
def segment():
    scribbled = ScribbledSegment()
    yield scribbled
    scribbled.close()


def chunk_is_valid(header: bytes, offset, length):
    _tag, nbytes, *_ = MESSAGE.unpack(header)
    return (not message_problem(header, MAX_MESSAGE) and offset == 0 and length <= SHM_SLOT_BYTES
            and length <= nbytes and (length > 0 or nbytes == 0))


@fuzz(40, live=True)
@given(header=hostile(message_header(nbytes=16, shape=(4,))),
       offset=st.one_of(st.just(0), st.integers(0, 2**64 - 1)),
       length=st.one_of(st.just(16), st.integers(0, 2 * SHM_SLOT_BYTES), st.integers(0, 2**64 - 1)))
def test_shm_chunk_header_scribble_fuzz(header, offset, length):
    scribbled = ScribbledSegment()
    try:
        scribbled.write_chunk(0, header, offset, length, b"x" * min(length, SHM_SLOT_BYTES))
        scribbled.publish(1)
        valid = chunk_is_valid(header, offset, length)
        assert scribbled.outcome() == ("alive" if valid else "failed")
        tag, nbytes, *_ = MESSAGE.unpack(header)
        if valid and length == nbytes:
            assert (0, tag) in scribbled.receiver.poll()
            try:
                scribbled.receiver.try_recv(0, tag)
            except ValueError as error:  # the codec refuses a shape that does not describe the bytes
                assert "malformed message" in str(error) or "unknown dtype code" in str(error)
    finally:
        scribbled.close()


@fuzz(40, live=True)
@given(head=st.one_of(st.integers(0, 2 * SHM_SLOTS), st.integers(0, 2**64 - 1)))
def test_shm_ring_head_scribble_fuzz(head):
    """Zeroed slots read as empty messages of tag 0, so a head within the ring is a (strange) valid producer."""
    scribbled = ScribbledSegment()
    try:
        scribbled.publish(head)
        slots_per_ring = SHM_SLOTS  # one ring gets every slot
        assert scribbled.outcome() == ("alive" if head <= slots_per_ring else "failed")
    finally:
        scribbled.close()


def test_shm_chunk_beyond_its_slot_fails_the_link_even_if_the_header_claims_bigger_slots(segment):
    """Regression: the receiver read slot_bytes (and the ring geometry) from the shared header on every chunk, so a
    producer that enlarged slot_bytes made it copy past the slot, up to past the mapping."""
    struct.pack_into("<Q", segment.memory, wire.SHM_LAYOUT["slot_bytes"], 1 << 40)
    segment.write_chunk(0, message_header(nbytes=1 << 20, shape=(1 << 18,)), 0, 1 << 20)
    segment.publish(1)
    assert segment.outcome() == "failed"


def test_shm_ring_head_far_ahead_fails_the_link_at_once(segment):
    """Regression: a head of 2**63 had the receiver walk 2**63 slots of garbage (a hang that held its lock)."""
    segment.publish(2**63)
    started = time.monotonic()
    assert segment.outcome() == "failed"
    assert time.monotonic() - started < 1


def test_shm_chunk_of_an_oversized_message_is_refused_before_allocating(segment):
    """Regression: a chunk announcing a 2**60-byte message made the receiver ask its pool for 2**60 bytes."""
    segment.write_chunk(0, message_header(nbytes=2**60, shape=(2**58,)), 0, 16, b"y" * 16)
    segment.publish(1)
    assert segment.outcome() == "failed"


def test_shm_scribbled_chunk_leaves_valid_messages_before_it(segment):
    segment.write_chunk(0, message_header(tag=11, nbytes=16, shape=(4,)), 0, 16, b"z" * 16)
    segment.write_chunk(1, message_header(tag=12, nbytes=16, shape=(4,)), 8, 8)  # starts mid-message
    segment.publish(2)
    assert segment.outcome() == "failed"
    assert segment.receiver.try_recv(0, 11).numel() == 4


# ---- TCP: hostile bytes on an admitted link -------------------------------------------------------------------

ADMISSION = struct.Struct("<II32s")
DOMAIN = b"megatron_app admission v1\0"
SECRET = bytes(range(32))


def admitted_socket(address, job_id):
    """A connection that proves the job's secret (as a real peer does) and claims rank 1."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    challenge = b""
    while len(challenge) < ADMISSION.size:
        chunk = sock.recv(ADMISSION.size - len(challenge))
        assert chunk
        challenge += chunk
    magic, version, nonce = ADMISSION.unpack(challenge)
    mac = hmac.new(SECRET, DOMAIN + job_id.encode() + b"\0" + nonce, hashlib.sha256).digest()
    sock.sendall(struct.pack("<II", magic, version) + mac + tcp_hello(1, job_id))
    return sock


@fuzz(30, live=True)
@given(frame=st.one_of(hostile(tcp_frame()), st.binary(max_size=400)),
       payload=st.one_of(st.just(b""), st.binary(max_size=64)))
def test_tcp_stream_fuzz(frame, payload):
    """Whatever an admitted peer writes and then hangs up on, the receiver reports its link once, clearly."""
    job_id = unique_job("tf")
    receiver = Transport(0, 2, job_id, backends={1: "tcp"}, timeout_s=5, max_message_bytes=MAX_MESSAGE,
                         admission_secret=SECRET)
    try:
        sock = admitted_socket(receiver.local_address("tcp"), job_id)
        sock.sendall(frame + payload)
        sock.close()
        with pytest.raises((PeerDied, TransportClosed)) as error:
            receiver.recv(1, PROBE_TAG, timeout=3)
        assert "\n" not in str(error.value)
        for peer, tag in receiver.poll():  # whatever arrived whole decodes or is refused in one line
            try:
                receiver.try_recv(peer, tag)
            except ValueError as refusal:
                assert "malformed message" in str(refusal) or "unknown dtype code" in str(refusal)
    finally:
        receiver.close()
