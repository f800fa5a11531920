"""CUDA tensors through the transport (issue 38), run where a CUDA device is visible (marked `cuda`; skipped
elsewhere with the reason). The same path runs on CPU with a fake copy engine in test_transport_device_staging.py;
these tests cover the CUDA lines (megatron_app/transport/device_engine.py): device-to-host copies into registered
shared-memory slots on a side stream, the producer-stream event, host-to-device on receive, the pinned staging of
links that lend no slots, and a rank killed in the middle of a send."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from transport_helpers.common import (
    ALL_DTYPES,
    job_id_fixture,  # noqa: F401  (provides the job_id fixture)
    job_segments,
    random_tensor,
    same_bits,
)

from megatron_app.transport import Direction, PeerDied, Transport, make_tag
from megatron_app.transport import device_engine

pytestmark = pytest.mark.cuda
FWD = Direction.FORWARD
SHAPES = [(), (0,), (3, 0, 2), (1,), (7, 5), (2, 3, 4, 5), (9000,), (1 << 20,)]


def on_device(tensor):
    return tensor.to("cuda")


@pytest.fixture(params=["small slots", "default slots", "cuda ipc"])
def pair(job_id, request):
    options = {"slot_bytes": 4096, "num_slots": 8} if request.param == "small slots" else {}
    options["cuda_ipc"] = request.param == "cuda ipc"
    sender = Transport(0, 2, job_id, timeout_s=60, **options)
    receiver = Transport(1, 2, job_id, timeout_s=60, **options)
    sender.kind = request.param
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.fixture
def tcp_pair(job_id):
    sender = Transport(0, 2, job_id, backends={1: "tcp"}, timeout_s=60)
    receiver = Transport(1, 2, job_id, backends={0: "tcp"}, timeout_s=60)
    sender.set_peer_addresses({1: receiver.local_address("tcp")})
    receiver.set_peer_addresses({0: sender.local_address("tcp")})
    yield sender, receiver
    sender.close()
    receiver.close()


def round_trip_every_dtype(sender, receiver):
    tag = 0
    for dtype in ALL_DTYPES:
        for shape in SHAPES:
            tensor = on_device(random_tensor(torch.Generator().manual_seed(tag), dtype, shape))
            sender.send(1, make_tag(FWD, tag), tensor)
            received = receiver.recv(0, make_tag(FWD, tag), dtype=dtype, device="cuda")
            assert received.is_cuda and same_bits(received.cpu(), tensor.cpu()), (dtype, shape)
            tag += 1
    sender.wait_sends(timeout=60)


def test_every_dtype_and_shape_device_to_device(pair):
    sender, receiver = pair
    round_trip_every_dtype(sender, receiver)
    if sender.kind == "cuda ipc":  # empty tensors are staged
        assert sender.device_path_of(1) in ("cuda ipc + slots, registered", "slots, registered + cuda ipc")
    else:
        assert sender.device_path_of(1) == "slots, registered"


def test_every_dtype_and_shape_through_unregistered_slots(job_id, monkeypatch):
    monkeypatch.setattr(device_engine.CudaCopyEngine, "register", staticmethod(lambda address, nbytes: "forced"))
    sender = Transport(0, 2, job_id, timeout_s=60, slot_bytes=4096, num_slots=8)
    receiver = Transport(1, 2, job_id, timeout_s=60, slot_bytes=4096, num_slots=8)
    try:
        round_trip_every_dtype(sender, receiver)
        assert sender.device_path_of(1) == "slots, not registered"
    finally:
        sender.close()
        receiver.close()


def test_ipc_falls_back_to_the_staged_path_where_it_cannot_work(job_id, monkeypatch, caplog):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read per send; the allocator
    sender = Transport(0, 2, job_id, timeout_s=60, cuda_ipc=True)            # itself was set up before
    receiver = Transport(1, 2, job_id, timeout_s=60, cuda_ipc=True)
    try:
        tensor = torch.randn(1000, device="cuda")
        sender.send(1, make_tag(FWD, 0), tensor)
        assert torch.equal(receiver.recv(0, make_tag(FWD, 0), device="cuda"), tensor)
        assert sender.device_path_of(1) == "slots, registered"
        assert any("expandable segments" in record.getMessage() for record in caplog.records)
    finally:
        sender.close()
        receiver.close()


def test_ipc_with_a_receiver_behind_stages_the_rest_in_order(job_id):
    sender = Transport(0, 2, job_id, timeout_s=60, cuda_ipc=True)
    receiver = Transport(1, 2, job_id, timeout_s=60, cuda_ipc=True)
    try:
        tensors = [torch.full((100_000,), float(index), device="cuda") for index in range(10)]
        for index, tensor in enumerate(tensors):
            sender.send(1, make_tag(FWD, index), tensor)
        sender.wait_sends(timeout=60)
        assert sender.device_path_of(1) == "cuda ipc + slots, registered"
        for index, tensor in enumerate(tensors):
            assert torch.equal(receiver.recv(0, make_tag(FWD, index), device="cuda"), tensor), index
    finally:
        sender.close()
        receiver.close()


def test_every_dtype_and_shape_over_tcp_through_pinned_staging(tcp_pair):
    sender, receiver = tcp_pair
    round_trip_every_dtype(sender, receiver)
    assert sender.device_path_of(1) == "pinned staging"


def test_non_contiguous_and_special_views(pair):
    sender, receiver = pair
    base = torch.randn(300, 500, device="cuda")
    complex_base = torch.randn(1000, dtype=torch.complex64, device="cuda")
    views = [base.t(), base[::3, 1::7], torch.tensor([1.0, 2.0], device="cuda").expand(3, 2),
             complex_base.conj(), -complex_base, base[:, :0], base.t()[5]]
    for index, view in enumerate(views):
        sender.send(1, make_tag(FWD, index), view)
    for index, view in enumerate(views):
        received = receiver.recv(0, make_tag(FWD, index), device="cuda")
        assert torch.equal(received, view.resolve_conj().resolve_neg()), index


def test_the_send_waits_for_the_producers_stream_not_the_host(pair):
    """A tensor still being written by a kernel on a side stream when send() returns arrives complete."""
    sender, receiver = pair
    producer = torch.cuda.Stream()
    expected = []
    with torch.cuda.stream(producer):
        for index in range(4):
            a = torch.randn(2048, 2048, device="cuda")
            product = a @ a @ a  # long enough to still run when send() returns
            product += index
            sender.send(1, make_tag(FWD, index), product)
            expected.append(product)
    for index in range(4):
        received = receiver.recv(0, make_tag(FWD, index), device="cuda")
        torch.cuda.synchronize()
        assert torch.equal(received, expected[index]), index
    sender.wait_sends(timeout=60)


def test_large_messages_both_ways(pair):
    sender, receiver = pair
    big = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
    sender.send(1, make_tag(FWD, 0), big)
    receiver.send(0, make_tag(FWD, 1), big.flip(0))
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0), device="cuda"), big)
    assert torch.equal(sender.recv(1, make_tag(FWD, 1), device="cuda"), big.flip(0))
    sender.wait_sends(timeout=60)
    receiver.wait_sends(timeout=60)


SENDER = textwrap.dedent("""
    import sys, torch
    from megatron_app.transport import Transport, Direction, make_tag
    t = Transport(0, 2, sys.argv[1], timeout_s=60, cuda_ipc=sys.argv[2] == "ipc")
    big = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
    t.send(1, make_tag(Direction.FORWARD, 0), big).wait()
    print("sending", flush=True)
    index = 1
    while True:
        t.send(1, make_tag(Direction.FORWARD, index), big)
        index += 1
""")


@pytest.mark.parametrize("path", ["staged", "ipc"])
def test_a_rank_killed_mid_send_leaves_no_segment_and_the_peer_reads_peer_died(job_id, path):
    receiver = Transport(1, 2, job_id, timeout_s=60, cuda_ipc=path == "ipc")
    sender = subprocess.Popen([sys.executable, "-c", SENDER, job_id, path], stdout=subprocess.PIPE, text=True)
    try:
        assert torch.equal(receiver.recv(0, make_tag(FWD, 0), device="cuda"),
                           torch.ones(64 << 20, dtype=torch.uint8, device="cuda"))
        assert sender.stdout.readline().strip() == "sending"
        time.sleep(0.5)  # in the middle of a stream of 64 MiB sends
        os.kill(sender.pid, signal.SIGKILL)
        sender.wait(timeout=30)
        with pytest.raises(PeerDied) as raised:
            for index in range(1, 10_000):
                receiver.recv(0, make_tag(FWD, index), device="cuda")
        assert len(str(raised.value).splitlines()) == 1 and "died" in str(raised.value)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
        receiver.close()
    assert job_segments(job_id) == []  # the job_id fixture checks again after cleanup


@pytest.mark.parametrize("arena_mib", [0, 1, 256])
def test_receives_through_the_page_locked_arena_and_around_it(job_id, monkeypatch, arena_mib):
    """256 MiB: every message lands in the arena and is copied to the device asynchronously; 1 MiB: the larger
    ones take the chunked path; 0: no arena. (Receives straight from the slots, which take messages not arrived
    when they are asked for, are off: this is the path of messages that arrived first.)"""
    monkeypatch.setenv("MEGATRON_APP_CUDA_RECEIVE_ARENA_MIB", str(arena_mib))
    monkeypatch.setenv("MEGATRON_APP_CUDA_RECEIVE_FROM_SLOTS", "0")
    sender = Transport(0, 2, job_id, timeout_s=60)
    receiver = Transport(1, 2, job_id, timeout_s=60)
    try:
        tensors = [torch.randn(n, device="cuda") for n in (10, 100_000, 1_000_000, 3, 0, 200_000)] * 3
        for index, tensor in enumerate(tensors):
            sender.send(1, make_tag(FWD, index), tensor)
        received = [receiver.recv(0, make_tag(FWD, index), device="cuda") for index in range(len(tensors))]
        for index, (got, tensor) in enumerate(zip(received, tensors)):
            assert torch.equal(got, tensor), index
        assert (receiver._arena is False) == (arena_mib == 0)
        if arena_mib:
            assert receiver._arena.is_pinned()
    finally:
        sender.close()
        receiver.close()


# ---- receives straight from the registered slots (device_staging.receive_through_slots) --------------------------
@pytest.mark.parametrize("event_wait", ["spin", "block"])
def test_every_dtype_and_shape_received_straight_from_registered_slots(job_id, event_wait):
    from transport_helpers.claims import receive_claimed

    sender = Transport(0, 2, job_id, timeout_s=60, copy_engine=device_engine.CudaCopyEngine(event_wait=event_wait))
    receiver = Transport(1, 2, job_id, timeout_s=60,
                         copy_engine=device_engine.CudaCopyEngine(event_wait=event_wait))
    try:
        tensors = [on_device(random_tensor(torch.Generator().manual_seed(index), dtype, shape))
                   for index, (dtype, shape) in enumerate((d, s) for d in ALL_DTYPES for s in SHAPES)]
        received = receive_claimed(sender, receiver, tensors, device="cuda")
        for index, (got, tensor) in enumerate(zip(received, tensors)):
            assert got.is_cuda and same_bits(got.cpu(), tensor.cpu()), (index, tensor.dtype, tuple(tensor.shape))
        assert receiver._receive_regions.registered(0)  # the receiver's own slots, page-locked for the device
        assert receiver._arena is None  # nothing went through the arena
    finally:
        sender.close()
        receiver.close()


def test_a_large_message_streams_through_the_registered_slots_while_the_receiver_computes(job_id):
    """64 MiB through 16 slots of 1 MiB: the receiver's copies run on their own stream, the result is complete
    when recv returns, and the caller's stream (busy with a matmul) may use it at once."""
    from transport_helpers.claims import receive_claimed

    sender = Transport(0, 2, job_id, timeout_s=60)
    receiver = Transport(1, 2, job_id, timeout_s=60)
    try:
        big = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
        busy = torch.randn(4096, 4096, device="cuda")
        busy = busy @ busy  # queued on the current stream while the message arrives
        got, = receive_claimed(sender, receiver, [big], device="cuda")
        assert torch.equal(got, big) and torch.isfinite(busy).any()
        assert receiver._receive_regions.registered(0)
    finally:
        sender.close()
        receiver.close()


STALLING_SENDER = textwrap.dedent("""
    import sys, time, torch
    from megatron_app.transport import Transport, Direction, make_tag
    from megatron_app.transport.device_engine import CudaCopyEngine

    class Stalls(CudaCopyEngine):
        copies = 0
        def to_host(self, destination, source):
            Stalls.copies += 1
            if Stalls.copies == 9:
                print("stalled", flush=True)
                time.sleep(120)
            return super().to_host(destination, source)

    t = Transport(0, 2, sys.argv[1], timeout_s=60, copy_engine=Stalls())
    big = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    t.send(1, make_tag(Direction.FORWARD, 0), big)
    time.sleep(120)
""")


def test_a_sender_killed_inside_a_message_taken_from_the_slots_reads_peer_died(job_id):
    import threading

    from transport_helpers.claims import ClaimSignal

    receiver = Transport(1, 2, job_id, timeout_s=60)
    claim = receiver._core = ClaimSignal(receiver._core)
    sender = subprocess.Popen([sys.executable, "-c", STALLING_SENDER, job_id], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    said = []

    def start_then_kill():
        said.append(sender.stdout.readline().strip())
        claim.claimed.wait(60)
        sender.stdin.write("go\n")
        sender.stdin.flush()
        said.append(sender.stdout.readline().strip())
        os.kill(sender.pid, signal.SIGKILL)

    killer = threading.Thread(target=start_then_kill)
    killer.start()
    try:
        with pytest.raises(PeerDied) as raised:
            receiver.recv(0, make_tag(FWD, 0), device="cuda")
        text = str(raised.value)
        assert said == ["ready", "stalled"] and len(text.splitlines()) == 1 and "died" in text, (said, text)
        # The link is closed, the next receive says so at once.
        with pytest.raises(PeerDied):
            receiver.recv(0, make_tag(FWD, 1), device="cuda", timeout=10)
    finally:
        killer.join(60)
        if sender.poll() is None:
            sender.kill()
        sender.wait(timeout=30)
        receiver.close()
    assert job_segments(job_id) == []


# ---- CUDA IPC: the slot lent to the receiver ----------------------------------------------------------------------
def test_an_ipc_slot_is_lent_and_given_back_when_its_tensor_dies(job_id):
    sender = Transport(0, 2, job_id, timeout_s=60, cuda_ipc=True)
    receiver = Transport(1, 2, job_id, timeout_s=60, cuda_ipc=True)
    try:
        for index in range(12):  # 3 times round the 4 slots: each comes back once its tensor is dropped
            tensor = torch.full((1 << 20,), float(index), device="cuda")
            sender.send(1, make_tag(FWD, index), tensor)
            got = receiver.recv(0, make_tag(FWD, index), device="cuda")
            assert torch.equal(got, tensor), index
            got.add_(1)  # the receiver's to write while it holds it
            torch.cuda.synchronize()
            del got
            receiver.poll()  # the acknowledgement goes out with the next call
            deadline = time.monotonic() + 30
            while not any(tag >> 60 == 0xF for _, tag in sender.poll()):
                assert time.monotonic() < deadline, "the lent slot was never given back"
                time.sleep(0.001)
        sender.wait_sends(timeout=60)
        assert receiver._ipc_receiver.lent == 12 and sender.device_path_of(1) == "cuda ipc"
    finally:
        sender.close()
        receiver.close()


def test_a_lent_ipc_slot_keeps_its_bytes_while_held_and_later_messages_go_staged(job_id):
    sender = Transport(0, 2, job_id, timeout_s=60, cuda_ipc=True)
    receiver = Transport(1, 2, job_id, timeout_s=60, cuda_ipc=True)
    try:
        held = []
        for index in range(7):
            sender.send(1, make_tag(FWD, index), torch.full((300_000,), float(index), device="cuda"))
            held.append(receiver.recv(0, make_tag(FWD, index), device="cuda"))
        sender.wait_sends(timeout=60)
        assert receiver._ipc_receiver.lent == 4 and sender.device_path_of(1) == "cuda ipc + slots, registered"
        for index, tensor in enumerate(held):
            assert torch.equal(tensor, torch.full((300_000,), float(index), device="cuda")), index
    finally:
        sender.close()
        receiver.close()


def test_a_device_sends_transfer_span_starts_when_its_producer_is_done(pair):
    """The send's own transfer (what the executor traces as its `send` span): posted while its producer's kernels
    still run, it starts when they are done, on the device's clock."""
    sender, receiver = pair
    a = torch.randn(4096, 4096, device="cuda")
    gain = torch.randn(4096, 4096, device="cuda") / 32.0
    torch.cuda.synchronize()
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began.record()
    for _ in range(20):
        # tens of milliseconds queued before the send; tanh of a gain-2 product keeps the values finite and
        # non-zero (a @ a / 64 overflowed to NaN on an H200, and NaN never compares equal)
        a = torch.tanh(a @ gain)
    ended.record()
    posted = time.monotonic()
    handle = sender.send(1, make_tag(FWD, 0), a[:256].contiguous())
    handle.wait(timeout=60)
    seen = time.monotonic()
    producer_s = began.elapsed_time(ended) / 1e3
    start, end = handle.transfer_span()
    assert posted <= start <= end <= seen + 1e-3, (posted, start, end, seen)
    assert end - start < (seen - posted) - 0.5 * producer_s, (end - start, seen - posted, producer_s)
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0), device="cuda"), a[:256])


def test_the_rendezvous_names_this_gpu_and_its_peer_access():
    """What each rank publishes for the IPC fallback: its current GPU's UUID once CUDA is in use, and peer access as
    torch reports it between two visible GPUs (a GPU and itself need none: never checked)."""
    from megatron_app.transport.backend_choice import cuda_peer_access, gpu_identity

    torch.zeros(1, device="cuda")
    mine = gpu_identity()
    assert mine == str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    if torch.cuda.device_count() > 1:
        other = str(torch.cuda.get_device_properties(1).uuid)
        assert cuda_peer_access(str(torch.cuda.get_device_properties(0).uuid), other) == \
            torch.cuda.can_device_access_peer(0, 1)
    assert cuda_peer_access(mine, "GPU-not-on-this-host") is None


PROBE_RANK = textwrap.dedent("""
    import datetime, json, sys
    import torch, torch.distributed as dist
    from megatron_app.transport import ipc_probe
    rank, port, refuse = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    torch.zeros(1, device="cuda")
    if refuse:   # as a rank that cannot map its peer's memory (a GPU hidden from it)
        def read(blob, nbytes):
            raise RuntimeError("refused by the test")
        ipc_probe.CudaProbeDevice.read = staticmethod(read)
    result = ipc_probe.probe_ipc(store, "probe", rank, [1 - rank], {}, 60)
    # the store lives in rank 0: it stays until rank 1's last use of it (a set, acknowledged before rank 0 sees it)
    if rank == 0:
        store.wait(["probe/test_done"])
    else:
        store.set("probe/test_done", "1")
    print(json.dumps(result))
""")


@pytest.mark.parametrize("rank_1_refuses", [False, True])
def test_the_ipc_probe_maps_a_peer_processs_memory_and_reads_its_bytes(rank_1_refuses):
    """Two processes on this GPU run the rendezvous's probe (ipc_probe.py) for real: each opens the other's exported
    buffer and reads its pattern back; a rank that cannot turns IPC off towards it, with the reason."""
    import json
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", PROBE_RANK, str(rank), str(port),
                               "1" if rank == 1 and rank_1_refuses else "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err[-2000:] for _, err in outputs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert results[1] == {}
    expected = ({"1": "rank 1 could not read rank 0's device memory by CUDA IPC (RuntimeError: refused by the test)"}
                if rank_1_refuses else {})
    assert results[0] == expected
