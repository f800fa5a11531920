"""The device path of the transport (megatron_app/transport/device_staging.py) on CPU: a fake copy engine takes
host tensors down the path CUDA tensors take (leased shared-memory slots filled by the engine, committed once
their copies are done, on the stager's thread), so everything but the CUDA lines is tested here.
tests/test_transport_cuda.py runs the same path with the real engine where CUDA is available."""

import logging
import threading
import time

import pytest
import torch
from transport_helpers.common import (
    ALL_DTYPES,
    job_id_fixture,  # noqa: F401  (provides the job_id fixture)
    message_for,
    random_tensor,
    same_bits,
)
from transport_helpers.claims import ClaimSignal, receive_claimed
from transport_helpers.fake_engine import FakeCopyEngine, FakeCore, FakeIpcEngine

from megatron_app.transport import Direction, Transport, TransportClosed, make_tag
from megatron_app.transport.device_staging import region_fits_shm, send_through_slots

FWD = Direction.FORWARD


def staged_pair(job_id, engine, **options):
    options = {"slot_bytes": 4096, "num_slots": 8, "timeout_s": 20, **options}
    sender = Transport(0, 2, job_id, copy_engine=engine, **options)
    receiver = Transport(1, 2, job_id, **options)
    return sender, receiver


@pytest.fixture
def pair(job_id):
    engine = FakeCopyEngine(lag=2)
    sender, receiver = staged_pair(job_id, engine)
    yield sender, receiver, engine
    sender.close()
    receiver.close()


# ---- the chunk pipeline against a fake core ----------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 40_000])
@pytest.mark.parametrize("lag", [0, 1, 5])
def test_slots_are_committed_in_order_and_only_after_their_copies(nbytes, lag):
    core, engine = FakeCore(slots=2, slot_bytes=4096), FakeCopyEngine(lag=lag)
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    chunks = send_through_slots(core, engine, 1, 7, 2, (nbytes,), source)
    assert bytes(core.published) == bytes(source.tolist())  # a premature commit publishes the sentinel
    assert chunks == max(1, -(-nbytes // 4096)) and core.leased == [] and engine.in_flight == 0
    assert engine.max_in_flight <= 2


def test_the_pipeline_keeps_two_copies_in_flight_when_they_are_slow():
    core, engine = FakeCore(slots=4, slot_bytes=4096), FakeCopyEngine(lag=100)
    send_through_slots(core, engine, 1, 7, 2, (5 * 4096,), torch.zeros(5 * 4096, dtype=torch.uint8))
    assert engine.max_in_flight == 2
    assert core.events[:3] == ["reserve 0", "reserve 4096", "commit"]


def test_a_failed_lease_waits_for_copies_in_flight_before_raising():
    class FailingCore(FakeCore):
        def reserve_slot(self, peer, tag, code, shape, nbytes, offset):
            if offset >= 4096:
                raise TransportClosed("closed")
            return super().reserve_slot(peer, tag, code, shape, nbytes, offset)

    core, engine = FailingCore(slots=2), FakeCopyEngine(lag=100)
    with pytest.raises(TransportClosed):
        send_through_slots(core, engine, 1, 7, 2, (3 * 4096,), torch.ones(3 * 4096, dtype=torch.uint8))
    assert engine.in_flight == 0


# ---- through a real transport -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7, 5), (2, 3, 4, 5), (9000,)], ids=str)
def test_every_dtype_and_shape_goes_through_the_slots_bit_exactly(pair, dtype, shape):
    sender, receiver, engine = pair
    tensor = random_tensor(torch.Generator().manual_seed(len(shape)), dtype, shape)
    handle = sender.send(1, make_tag(FWD, 0), tensor)
    received = receiver.recv(0, make_tag(FWD, 0), dtype=dtype)
    handle.wait(timeout=10)
    assert handle.done() and same_bits(received, tensor)
    assert engine.copies >= (1 if tensor.numel() else 0)


def test_non_contiguous_views_are_sent_as_their_values(pair):
    sender, receiver, _ = pair
    base = torch.arange(24 * 500, dtype=torch.float32).reshape(40, 300)
    views = [base.t(), base[::3, 1::7], torch.tensor([1.0, 2.0]).expand(3, 2),
             torch.randn(5, dtype=torch.complex64).conj(), -torch.randn(4, dtype=torch.complex64).conj()]
    for index, view in enumerate(views):
        sender.send(1, make_tag(FWD, index), view)
    for index, view in enumerate(views):
        received = receiver.recv(0, make_tag(FWD, index))
        assert torch.equal(received, view.resolve_conj().resolve_neg()), index


def test_messages_larger_than_the_ring_stream_through_it(pair):
    sender, receiver, engine = pair
    tensor = torch.randn(300_000)  # 1.2 MB through 8 slots of 4 KiB (4 a ring)
    sender.send(1, make_tag(FWD, 0), tensor)
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), tensor)
    sender.wait_sends(timeout=10)
    assert engine.max_in_flight <= 2 and engine.followed == 1


def test_host_and_device_sends_to_one_peer_arrive_in_send_order(job_id):
    engine = FakeCopyEngine(lag=3)
    engine.handles = lambda tensor: tensor.dtype == torch.float64  # float64 stands for "on the device"
    sender, receiver = staged_pair(job_id, engine)
    try:
        messages = [message_for(seed=5, index=index, max_numel=3000) for index in range(60)]
        messages = [m.real.double() if i % 3 == 0 and m.is_complex() else m.double() if i % 3 == 0 else m
                    for i, m in enumerate(messages)]
        for index, message in enumerate(messages):
            sender.send(1, make_tag(FWD, index), message)
        sender.wait_sends(timeout=20)
        arrived = []
        while len(arrived) < len(messages):
            arrived += [key for key in receiver.poll() if key not in arrived]
        assert arrived == [(0, make_tag(FWD, index)) for index in range(len(messages))]
        for index, message in enumerate(messages):
            assert same_bits(receiver.recv(0, make_tag(FWD, index)), message), index
    finally:
        sender.close()
        receiver.close()


def test_slots_are_registered_once_and_unregistered_at_close(job_id):
    engine = FakeCopyEngine()
    sender, receiver = staged_pair(job_id, engine)
    for index in range(3):
        sender.send(1, make_tag(FWD, index), torch.randn(5000))
    sender.wait_sends(timeout=10)
    assert len(engine.registered) == 1 and engine.unregistered == []
    (address, nbytes), = engine.registered.items()
    assert nbytes >= 4 * 4096  # this rank's ring in the peer's segment: 4 slots
    sender.close()
    receiver.close()
    assert engine.unregistered == [address]


def test_a_failed_registration_falls_back_with_one_log_line(job_id, caplog):
    engine = FakeCopyEngine(register_problem="cudaHostRegister: out of memory")
    sender, receiver = staged_pair(job_id, engine)
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_app.transport.device_staging"):
            for index in range(3):
                sender.send(1, make_tag(FWD, index), torch.full((3000,), float(index)))
            for index in range(3):
                assert torch.equal(receiver.recv(0, make_tag(FWD, index)), torch.full((3000,), float(index)))
        lines = [r.getMessage() for r in caplog.records if "not registered" in r.getMessage()]
        assert len(lines) == 1 and "out of memory" in lines[0]
    finally:
        sender.close()
        receiver.close()
    assert engine.unregistered == []


def test_a_region_larger_than_dev_shm_is_not_registered():
    assert region_fits_shm(1 << 20) is None
    assert "exceed" in region_fits_shm(1 << 62)
    assert "cannot stat" in region_fits_shm(1, directory="/nonexistent-dir")


def test_a_send_to_a_closed_peer_fails_on_its_handle(job_id):
    engine = FakeCopyEngine()
    sender, receiver = staged_pair(job_id, engine)
    try:
        sender.send(1, make_tag(FWD, 0), torch.ones(10)).wait(timeout=10)
        receiver.close()
        handle = sender.send(1, make_tag(FWD, 1), torch.ones(10))
        with pytest.raises(TransportClosed):
            handle.wait(timeout=10)
    finally:
        sender.close()
        receiver.close()


def test_close_fails_queued_sends_and_stops_the_thread(job_id):
    class StuckEngine(FakeCopyEngine):
        """The first copy finishes only when the test says so."""
        release = threading.Event()

        def wait(self, token):
            self.release.wait(10)
            super().wait(token)

    engine = StuckEngine(lag=10**6)
    engine.ready = False  # producers still running: every send goes to the stager's queue
    sender, receiver = staged_pair(job_id, engine)
    try:
        handles = [sender.send(1, make_tag(FWD, i), torch.randn(20_000)) for i in range(3)]
        threading.Timer(0.3, engine.release.set).start()
        sender.close()  # the stager is inside the first message: it fails there, the others never start
        for handle in handles:
            with pytest.raises(TransportClosed):
                handle.wait(timeout=10)
        assert not sender._stager._thread.is_alive()
    finally:
        sender.close()
        receiver.close()


def test_host_tensors_still_take_the_cores_path(pair):
    sender, receiver, engine = pair
    engine.handles = lambda tensor: False
    sender.send(1, make_tag(FWD, 0), torch.arange(10))
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), torch.arange(10))
    assert engine.copies == 0 and sender._stager is None


def test_a_small_ready_send_runs_on_the_callers_thread_and_is_done_on_return(pair):
    sender, receiver, engine = pair
    handle = sender.send(1, make_tag(FWD, 0), torch.arange(100.0))
    assert handle.done() and engine.copy_threads == [threading.current_thread().name]
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), torch.arange(100.0))


def test_sends_whose_producer_runs_or_that_are_large_go_to_the_stager(pair, monkeypatch):
    import megatron_app.transport.device_staging as staging

    sender, receiver, engine = pair
    engine.ready = False
    sender.send(1, make_tag(FWD, 0), torch.arange(100.0)).wait(timeout=10)
    engine.ready = True
    monkeypatch.setattr(staging, "INLINE_SEND_BYTES", 1000)
    sender.send(1, make_tag(FWD, 1), torch.arange(1000.0)).wait(timeout=10)
    assert engine.copy_threads[0] == "megatron_app-stager" and set(engine.copy_threads[1:]) == {"megatron_app-stager"}
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), torch.arange(100.0))
    assert torch.equal(receiver.recv(0, make_tag(FWD, 1)), torch.arange(1000.0))


def test_a_small_send_behind_a_queued_one_keeps_its_place(pair, monkeypatch):
    import megatron_app.transport.device_staging as staging

    sender, receiver, engine = pair
    monkeypatch.setattr(staging, "INLINE_SEND_BYTES", 1000)
    engine.lag = 10**4  # the large message stays in the stager's hands for a while
    big, small = torch.randn(50_000), torch.arange(10.0)
    sender.send(1, make_tag(FWD, 0), big)
    sender.send(1, make_tag(FWD, 0), small)  # same key: arrival order is send order
    # Still busy after small's send: small was queued behind big (an inline send needs an idle stager). Under load the
    # big copy can finish before small is sent; then small goes inline, which is right too: only the order counts.
    queued_behind = sender._stager.busy_with(1)
    assert same_bits(receiver.recv(0, make_tag(FWD, 0)), big)
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), small)
    if queued_behind:
        assert threading.current_thread().name not in engine.copy_threads


def test_a_transport_with_device_traffic_polls_longer_before_it_sleeps(job_id):
    from megatron_app.transport.transport import DEVICE_WAIT_SPIN_US

    engine = FakeCopyEngine()
    sender, receiver = staged_pair(job_id, engine)
    try:
        assert sender._core.wait_spin_us == receiver._core.wait_spin_us == 50  # host tensors: the core's spin
        sender.send(1, make_tag(FWD, 0), torch.ones(10)).wait(timeout=10)
        assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), torch.ones(10))
        assert sender._core.wait_spin_us == DEVICE_WAIT_SPIN_US and receiver._core.wait_spin_us == 50
    finally:
        sender.close()
        receiver.close()


def test_the_device_wait_spin_can_be_set_for_a_host(job_id, monkeypatch):
    monkeypatch.setenv("MEGATRON_APP_DEVICE_WAIT_SPIN_US", "80")
    sender, receiver = staged_pair(job_id, FakeCopyEngine())
    try:
        sender.send(1, make_tag(FWD, 0), torch.ones(10)).wait(timeout=10)
        assert sender._core.wait_spin_us == 80
    finally:
        sender.close()
        receiver.close()


# ---- CUDA IPC's protocol (device_ipc.py) with a fake engine -------------------------------------------------------
@pytest.fixture
def ipc_pair(job_id):
    engine = FakeIpcEngine()
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine, cuda_ipc=True)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine,
                         cuda_ipc=True)
    yield sender, receiver, engine
    sender.close()
    receiver.close()


def wait_for_an_acknowledgement(sender, timeout_s=10.0):
    """Until an IPC acknowledgement has reached the sender's inbox (the receiver sends it when it takes a message;
    a sender that finds none yet stages the next message, which is right, but not what these tests look at)."""
    give_up_at = time.monotonic() + timeout_s
    while not any(tag >> 60 == 0xF for _, tag in sender.poll()):
        assert time.monotonic() < give_up_at, "no acknowledgement arrived"
        time.sleep(0.001)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_goes_through_ipc_slots_bit_exactly(ipc_pair, dtype):
    sender, receiver, engine = ipc_pair
    for index, shape in enumerate([(), (1,), (7, 5), (2, 3, 4, 5), (9000,)]):
        tensor = random_tensor(torch.Generator().manual_seed(index), dtype, shape)
        sender.send(1, make_tag(FWD, index), tensor)
        received = receiver.recv(0, make_tag(FWD, index), dtype=dtype)
        assert same_bits(received, tensor), shape
        wait_for_an_acknowledgement(sender)
    sender.wait_sends(timeout=10)
    assert sender.device_path_of(1) == "cuda ipc" and engine.takes == 5


def test_an_ipc_send_on_the_callers_thread_returns_before_its_copy_and_is_done_with_it(job_id):
    """The copy into an IPC slot runs after the receiver's last read of that slot, which its device may reach
    only much later: send() does not wait for it, the handle does."""
    from transport_helpers.fake_engine import FakeCopy

    class LateIpcCopies(FakeIpcEngine):
        def ipc_fill(self, destination, source, filled, consumed):
            self.in_flight += 1
            filled.record()
            return FakeCopy(destination, source, polls_left=3)

    engine = LateIpcCopies()
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine, cuda_ipc=True)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=FakeIpcEngine(),
                         cuda_ipc=True)
    try:
        tensor = torch.arange(100.0)
        handle = sender.send(1, make_tag(FWD, 0), tensor)
        assert engine.in_flight == 1 and not handle.done()  # returned with the copy pending
        handle.wait(timeout=10)
        assert engine.in_flight == 0 and handle.done()
        assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), tensor)
        wait_for_an_acknowledgement(sender)
        sender.send(1, make_tag(FWD, 1), tensor)
        sender.wait_sends(timeout=10)  # waits for the pending copy too
        assert engine.in_flight == 0 and sender.device_path_of(1) == "cuda ipc"
        assert torch.equal(receiver.recv(0, make_tag(FWD, 1)), tensor)
    finally:
        sender.close()
        receiver.close()


def test_ipc_sends_of_any_size_whose_producer_runs_go_on_the_callers_thread(ipc_pair, monkeypatch):
    import megatron_app.transport.device_staging as staging

    sender, receiver, engine = ipc_pair
    monkeypatch.setattr(staging, "INLINE_SEND_BYTES", 1000)
    engine.ready = False  # the device waits for the producer, not the host
    tensor = torch.randn(50_000)
    assert sender.send(1, make_tag(FWD, 0), tensor).done()
    assert same_bits(receiver.recv(0, make_tag(FWD, 0)), tensor)
    assert sender.device_path_of(1) == "cuda ipc" and engine.copy_threads == []


def test_ipc_slots_are_reused_once_acknowledged_and_grow_for_larger_messages(ipc_pair):
    sender, receiver, engine = ipc_pair
    for index in range(30):
        tensor = torch.full((1000 * (index + 1),), float(index))
        sender.send(1, make_tag(FWD, index), tensor).wait(timeout=10)
        assert torch.equal(receiver.recv(0, make_tag(FWD, index)), tensor)
        wait_for_an_acknowledgement(sender)
    assert sender.device_path_of(1) == "cuda ipc"
    assert engine.buffers_made <= 4 * 2  # 4 slots of >= 1 MiB; 120 KB messages never make one grow twice


def test_ipc_exports_are_forgotten_when_a_slot_grows_and_when_the_transports_close(job_id):
    """The registry of this process's own exports is held strongly (a weak one crashed on an H100): its owners
    forget what they exported, so a grown slot's old buffer and a closed transport's objects are not kept."""
    from transport_helpers import fake_engine

    before = set(fake_engine._EXPORTS)
    engine = FakeIpcEngine()
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine, cuda_ipc=True)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine,
                         cuda_ipc=True)
    try:
        for index, numel in enumerate((1000, 1 << 20)):   # the second outgrows the slot the first made
            tensor = torch.full((numel,), float(index))
            sender.send(1, make_tag(FWD, index), tensor).wait(timeout=10)
            assert torch.equal(receiver.recv(0, make_tag(FWD, index)), tensor)
            wait_for_an_acknowledgement(sender)
        assert sender.device_path_of(1) == "cuda ipc" and engine.buffers_made == 2
        mine = set(fake_engine._EXPORTS) - before
        # one buffer (the grown slot's new one: the old is forgotten), its filled event, the receiver's consumed one
        assert sorted(key[:5] for key in mine) == [b"buffe", b"event", b"event"], mine
    finally:
        sender.close()
        receiver.close()
    assert set(fake_engine._EXPORTS) - before == set()


def test_a_receiver_behind_gets_the_rest_staged_in_order(ipc_pair):
    sender, receiver, engine = ipc_pair
    messages = [torch.full((3000,), float(index)) for index in range(12)]
    for index, message in enumerate(messages):
        sender.send(1, make_tag(FWD, index), message)
    sender.wait_sends(timeout=10)  # nothing received yet: 4 slots await their acknowledgements
    assert sender.device_path_of(1) == "cuda ipc + slots, registered"
    assert [key for key in receiver.poll()][:12] == [(0, make_tag(FWD, index)) for index in range(12)]
    for index, message in enumerate(messages):
        assert torch.equal(receiver.recv(0, make_tag(FWD, index)), message)
    assert engine.takes == 4


def _staged_and_said_once(job_id, caplog, engine, reason: str, **sender_options) -> None:
    """Three device sends from rank 0 to rank 1 arrive through the slots, and `reason` is said once."""
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, copy_engine=engine, cuda_ipc=True,
                       **sender_options)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, copy_engine=engine, cuda_ipc=True)
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_app.transport.device_staging"):
            for index in range(3):
                sender.send(1, make_tag(FWD, index), torch.full((100,), float(index)))
                assert torch.equal(receiver.recv(0, make_tag(FWD, index)), torch.full((100,), float(index)))
        lines = [r.getMessage() for r in caplog.records if "IPC" in r.getMessage()]
        assert len(lines) == 1 and reason in lines[0], lines
        assert sender.device_path_of(1) == "slots, registered"
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("problem", ["ipc_problem", "export_problem"])
def test_where_ipc_cannot_work_the_link_is_staged_and_says_so_once(job_id, caplog, problem):
    _staged_and_said_once(job_id, caplog, FakeIpcEngine(**{problem: "not in this container"}), "not in this container")


def test_a_peer_known_to_be_out_of_ipcs_reach_is_staged_and_said_once(job_id, caplog):
    """The rendezvous saw the peer in another PID namespace (ipc_off): no IPC buffer is made for it, its device
    tensors go through the slots, and the reason is said at the first device send."""
    engine = FakeIpcEngine()
    why = "rank 1 runs in another PID namespace than rank 0"
    _staged_and_said_once(job_id, caplog, engine, why, ipc_off={1: why})
    assert engine.buffers_made == 0


def test_ipc_is_off_unless_asked(job_id, monkeypatch):
    monkeypatch.delenv("MEGATRON_APP_CUDA_IPC", raising=False)
    engine = FakeIpcEngine()
    sender, receiver = staged_pair(job_id, engine)
    try:
        sender.send(1, make_tag(FWD, 0), torch.ones(10))
        assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), torch.ones(10))
        assert sender.device_path_of(1) == "slots, registered" and engine.buffers_made == 0
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("payload", [b"", b"\x00" * 8, b"MIPC" + b"\xff" * 40])
def test_a_malformed_ipc_descriptor_is_refused(ipc_pair, payload):
    from megatron_app.transport.device_ipc import IPC_FLAG

    sender, receiver, _ = ipc_pair
    body = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    request = sender._core.send(1, make_tag(FWD, 0), 9 | IPC_FLAG, [2], body.data_ptr() if payload else 0,
                                len(payload))
    if request is not None:
        request.wait()
    with pytest.raises(ValueError, match="malformed IPC descriptor"):
        receiver.recv(0, make_tag(FWD, 0))


def test_a_message_over_the_limit_is_refused_at_send(job_id):
    engine = FakeCopyEngine()
    sender, receiver = staged_pair(job_id, engine, max_message_bytes=1000)
    try:
        with pytest.raises(ValueError, match="exceeds max_message_bytes=1000"):
            sender.send(1, make_tag(FWD, 0), torch.zeros(1001, dtype=torch.uint8))
        with pytest.raises(ValueError, match="not among the peers|out of range"):
            sender.send(5, make_tag(FWD, 0), torch.zeros(10))
    finally:
        sender.close()
        receiver.close()


# ---- receives onto the device: the page-locked arena (transport.py) --------------------------------------------
def arena_pair(job_id, monkeypatch, arena_mib, lag=1):
    """The arena is where messages that arrived before they were asked for wait: these tests send while the
    receiver waits, which would take them straight from the slots, so that path is off here."""
    monkeypatch.setenv("MEGATRON_APP_CUDA_RECEIVE_ARENA_MIB", str(arena_mib))
    monkeypatch.setenv("MEGATRON_APP_CUDA_RECEIVE_FROM_SLOTS", "0")
    engine = FakeCopyEngine(lag=lag)
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine)
    return sender, receiver, engine


def in_arena(engine, tensor):
    base = engine.arena.data_ptr()
    return base <= tensor.data_ptr() < base + engine.arena.numel()


def test_device_receives_come_from_the_arena_and_copy_asynchronously(job_id, monkeypatch):
    sender, receiver, engine = arena_pair(job_id, monkeypatch, arena_mib=1, lag=3)
    try:
        messages = [message_for(seed=3, index=index, max_numel=20_000) for index in range(40)]
        for index, message in enumerate(messages):
            sender.send(1, make_tag(FWD, index), message)
            received = receiver.recv(0, make_tag(FWD, index), device="cpu")  # "cpu" is the fake's device
            assert same_bits(received, message), index
        nonempty = sum(1 for message in messages[1:] if message.numel())
        assert engine.arena is not None and engine.async_receives >= nonempty // 2
        assert engine.async_receives + engine.chunked_receives >= nonempty
    finally:
        sender.close()
        receiver.close()
    assert engine.in_flight == 0  # close waited for the copies out of the arena


def test_messages_larger_than_the_arena_take_the_chunked_path(job_id, monkeypatch):
    sender, receiver, engine = arena_pair(job_id, monkeypatch, arena_mib=1)
    try:
        for index in range(3):
            tensor = torch.randn(400_000)  # 1.6 MB
            sender.send(1, make_tag(FWD, index), tensor)
            assert torch.equal(receiver.recv(0, make_tag(FWD, index), device="cpu"), tensor)
        assert engine.async_receives == 0 and engine.chunked_receives == 3
    finally:
        sender.close()
        receiver.close()


def test_back_to_back_messages_as_large_as_the_arena_all_land_in_it(job_id, monkeypatch):
    """The buffer of a message whose device copy is done goes back to the arena before the next receive waits:
    the core takes the next buffer when its first chunk arrives, before recv returns."""
    sender, receiver, engine = arena_pair(job_id, monkeypatch, arena_mib=1, lag=0)
    try:
        for index in range(5):
            tensor = torch.full((250_000,), float(index))  # 1,000,000 bytes: one at a time fits the arena
            timer = threading.Timer(0.05, sender.send, (1, make_tag(FWD, index), tensor))
            timer.start()  # sent while the receiver waits, so its own thread takes the buffer
            assert torch.equal(receiver.recv(0, make_tag(FWD, index), device="cpu"), tensor)
            timer.join()
        # The first arrives before the arena exists (made at the first device receive); every other lands in it.
        assert engine.chunked_receives == 1 and engine.async_receives == 4
    finally:
        sender.close()
        receiver.close()


def test_host_receives_never_hand_out_arena_memory(job_id, monkeypatch):
    sender, receiver, engine = arena_pair(job_id, monkeypatch, arena_mib=1)
    try:
        for index in range(4):
            tensor = torch.full((5000,), float(index))
            sender.send(1, make_tag(FWD, index), tensor)
            received = receiver.recv(0, make_tag(FWD, index), device="cpu" if index == 0 else None)
            assert torch.equal(received, tensor)
            if index:
                assert not in_arena(engine, received)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("value, problem", [("x", "a whole number of MiB"), ("-1", ">= 0 MiB")])
def test_a_bad_arena_size_is_one_clear_error(job_id, monkeypatch, value, problem):
    monkeypatch.setenv("MEGATRON_APP_CUDA_RECEIVE_ARENA_MIB", value)
    engine = FakeCopyEngine()
    sender = Transport(0, 2, job_id, timeout_s=20)
    # the arena's path (a blocking recv of a message not yet begun would take it from the slots, no arena)
    receiver = Transport(1, 2, job_id, timeout_s=20, copy_engine=engine, receive_from_slots=False)
    try:
        sender.send(1, make_tag(FWD, 0), torch.ones(3))
        with pytest.raises(ValueError, match=problem):
            receiver.recv(0, make_tag(FWD, 0), device="cpu")
    finally:
        sender.close()
        receiver.close()


def test_no_arena_when_its_size_is_zero(job_id, monkeypatch):
    sender, receiver, engine = arena_pair(job_id, monkeypatch, arena_mib=0)
    try:
        for index in range(3):
            sender.send(1, make_tag(FWD, index), torch.ones(100))
            assert torch.equal(receiver.recv(0, make_tag(FWD, index), device="cpu"), torch.ones(100))
        assert engine.arena is None and engine.chunked_receives == 3
    finally:
        sender.close()
        receiver.close()


# ---- a peer that died with its IPC exports unopened ----------------------------------------------------------------
IPC_SENDER = """
import sys, time, torch
sys.path.insert(0, sys.argv[2])
from transport_helpers.fake_engine import FakeIpcEngine
from megatron_app.transport import Direction, Transport, make_tag
t = Transport(0, 2, sys.argv[1], slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=FakeIpcEngine(),
              cuda_ipc=True)
for index in range(2):  # two IPC slots, each exported with its first message
    t.send(1, make_tag(Direction.FORWARD, index), torch.arange(100.0)).wait(timeout=20)
print("sent", flush=True)
time.sleep(60)
"""


class DeadExporterEngine(FakeIpcEngine):
    """Opening an export fails as CUDA's rebuild_cuda_tensor fails on the H200 once the exporter was killed."""

    @staticmethod
    def open_buffer(blob):
        raise torch.AcceleratorError("CUDA error: invalid resource handle\nCUDA kernel errors might be "
                                     "asynchronously reported at some other API call")


def test_an_ipc_export_of_a_peer_that_died_reads_peer_died_in_one_line(job_id):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from megatron_app.transport import PeerDied

    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=DeadExporterEngine(),
                         cuda_ipc=True)
    sender = subprocess.Popen([sys.executable, "-c", IPC_SENDER, job_id, str(Path(__file__).parent)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout.readline().strip() == "sent"
        with pytest.raises(torch.AcceleratorError):  # while the exporter lives, its error is not PeerDied
            receiver.recv(0, make_tag(FWD, 0))
        sender.send_signal(signal.SIGKILL)
        sender.wait(timeout=20)
        with pytest.raises(PeerDied) as raised:
            receiver.recv(0, make_tag(FWD, 1))
        text = str(raised.value)
        assert len(text.splitlines()) == 1 and "died" in text and "invalid resource handle" in text, text
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
        receiver.close()


# ---- receives straight from the slots (device_staging.receive_through_slots) ---------------------------------------
class FakeReceiveCore:
    """The core's claimed-receive calls over a ring of `slots` slots of `slot_bytes` carrying `payload`: a released
    slot is refilled at once with a sentinel (the sender reusing it), so a copy that reads its slot after the
    release brings the sentinel into the result."""

    SENTINEL = 0x5A

    def __init__(self, payload: bytes, slots: int = 2, slot_bytes: int = 4096, code=None, shape=None):
        from megatron_app.transport.dtypes import dtype_code

        self.payload = payload
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.code = dtype_code(torch.uint8) if code is None else code
        self.shape = list(shape if shape is not None else [len(payload)])
        self.memory = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
        self.next_offset = 0
        self.handed: list[int] = []      # slots handed out and not released, oldest first
        self.taken = 0                   # chunks handed out
        self.max_held_while_waiting = 0  # slots held when the next chunk was asked for
        self.cancelled = False
        self.events: list[str] = []
        self.timeouts: list = []

    def next_claimed_chunk(self, peer, timeout=None):
        self.timeouts.append(timeout)
        assert len(self.handed) < self.slots, "a chunk asked for with every slot held would never come"
        self.max_held_while_waiting = max(self.max_held_while_waiting, len(self.handed))
        slot = self.taken % self.slots
        length = min(self.slot_bytes, len(self.payload) - self.next_offset)
        start = slot * self.slot_bytes
        self.memory[start:start + length] = torch.frombuffer(
            bytearray(self.payload[self.next_offset:self.next_offset + length]), dtype=torch.uint8) \
            if length else self.memory[start:start]
        chunk = (self.code, self.shape, len(self.payload), self.next_offset, length, self.memory[start:].data_ptr())
        self.next_offset += length
        self.handed.append(slot)
        self.taken += 1
        self.events.append("take")
        return chunk

    def release_claimed_chunk(self, peer):
        slot = self.handed.pop(0)
        self.memory[slot * self.slot_bytes:(slot + 1) * self.slot_bytes] = self.SENTINEL
        self.events.append("release")
        return not self.handed and self.next_offset == len(self.payload)

    def cancel_claim(self, peer):
        self.cancelled = True


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 40_000])
@pytest.mark.parametrize("lag", [0, 1, 5])
def test_a_slot_is_given_back_only_after_the_copy_out_of_it(nbytes, lag):
    from megatron_app.transport.device_staging import receive_through_slots

    payload = bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(nbytes)).tolist())
    core, engine = FakeReceiveCore(payload, slots=2), FakeCopyEngine(lag=lag)
    received = receive_through_slots(core, engine, 0, "cpu", 10)
    assert received.dtype == torch.uint8 and bytes(received.tolist()) == payload  # a late copy reads the sentinel
    assert core.handed == [] and engine.in_flight == 0 and not core.cancelled
    assert core.taken == max(1, -(-nbytes // 4096)) and core.events.count("release") == core.taken
    assert core.max_held_while_waiting <= 1  # depth 2: one slot held while the next chunk crosses
    # The caller's timeout bounds the wait for the message; once it arrives, giving up would close the link.
    assert core.timeouts == [10] + [None] * (core.taken - 1)


def test_two_copies_out_of_the_slots_are_in_flight_when_they_are_slow():
    from megatron_app.transport.device_staging import receive_through_slots

    core, engine = FakeReceiveCore(bytes(range(256)) * 80, slots=4), FakeCopyEngine(lag=100)
    receive_through_slots(core, engine, 0, "cpu", 10)
    assert engine.max_in_flight == 2 and core.events[:3] == ["take", "take", "release"]


def test_a_failed_copy_out_of_a_slot_cancels_the_claim_after_the_copies_in_flight():
    from megatron_app.transport.device_staging import receive_through_slots

    class FailingCopies(FakeCopyEngine):
        def from_host(self, destination, source):
            if self.slot_receives == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().from_host(destination, source)

    core, engine = FakeReceiveCore(bytes(5 * 4096), slots=4), FailingCopies(lag=100)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        receive_through_slots(core, engine, 0, "cpu", 10)
    assert core.cancelled and engine.in_flight == 0


def test_a_shape_that_does_not_describe_the_bytes_is_refused():
    from megatron_app.transport.device_staging import receive_through_slots
    from megatron_app.transport.dtypes import dtype_code

    core = FakeReceiveCore(bytes(12), code=dtype_code(torch.float32), shape=[2])
    with pytest.raises(ValueError, match="malformed"):
        receive_through_slots(core, FakeCopyEngine(), 0, "cpu", 10)
    assert core.cancelled


@pytest.fixture
def slot_pair(job_id):
    sender_engine, receiver_engine = FakeCopyEngine(lag=2), FakeCopyEngine(lag=3)
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=sender_engine)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=receiver_engine)
    yield sender, receiver, receiver_engine
    sender.close()
    receiver.close()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_and_shape_is_received_straight_from_the_slots_bit_exactly(slot_pair, dtype):
    sender, receiver, engine = slot_pair
    shapes = [(), (0,), (3, 0, 2), (1,), (7, 5), (2, 3, 4, 5), (9000,)]
    tensors = [random_tensor(torch.Generator().manual_seed(index), dtype, shape) for index, shape in enumerate(shapes)]
    for index, (received, tensor) in enumerate(zip(receive_claimed(sender, receiver, tensors), tensors)):
        assert same_bits(received, tensor), shapes[index]
    assert engine.slot_receives >= sum(-(-t.numel() * t.element_size() // 4096) for t in tensors)
    assert engine.in_flight == 0 and engine.arena is None  # nothing went through the arena


def test_non_contiguous_views_are_received_straight_from_the_slots_as_their_values(slot_pair):
    sender, receiver, engine = slot_pair
    base = torch.arange(24 * 500, dtype=torch.float32).reshape(40, 300)
    views = [base.t(), base[::3, 1::7], torch.tensor([1.0, 2.0]).expand(3, 2),
             torch.randn(5, dtype=torch.complex64).conj(), -torch.randn(4, dtype=torch.complex64).conj()]
    for index, (received, view) in enumerate(zip(receive_claimed(sender, receiver, views), views)):
        assert torch.equal(received, view.resolve_conj().resolve_neg()), index
    assert engine.slot_receives > 0


def test_a_message_larger_than_the_ring_streams_through_the_slots_with_late_copies(job_id):
    sender_engine, receiver_engine = FakeCopyEngine(lag=1), FakeCopyEngine(lag=50)
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=sender_engine)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=receiver_engine)
    try:
        tensor = random_tensor(torch.Generator().manual_seed(3), torch.float64, (150_000,))  # 1.2 MB, 4 slots
        received, = receive_claimed(sender, receiver, [tensor])
        assert same_bits(received, tensor)  # a slot given back before its late copy would carry the next bytes
        assert receiver_engine.slot_receives >= 1_200_000 // 4096 and receiver_engine.max_in_flight == 2
        assert len(receiver_engine.registered) == 1  # this rank's ring for the peer, registered once
        # The ring drains the ordinary way again afterwards: a message that arrives before it is asked for.
        sender.send(1, make_tag(FWD, 99), torch.arange(10.0)).wait(timeout=20)
        assert torch.equal(receiver.recv(0, make_tag(FWD, 99), device="cpu"), torch.arange(10.0))
    finally:
        sender.close()
        receiver.close()
    (address, _), = receiver_engine.registered.items()
    assert receiver_engine.unregistered == [address]


def test_messages_ahead_of_a_claimed_one_arrive_the_ordinary_way(slot_pair):
    sender, receiver, engine = slot_pair
    signal = receiver._core = ClaimSignal(receiver._core)
    ahead = torch.randn(30_000)  # larger than the ring: it must be copied out for the claimed one to come

    def send_both():
        signal.claimed.wait(20)
        sender.send(1, make_tag(FWD, 0), ahead)
        sender.send(1, make_tag(FWD, 1), torch.arange(5000.0)).wait(timeout=20)

    thread = threading.Thread(target=send_both)
    thread.start()
    try:
        assert torch.equal(receiver.recv(0, make_tag(FWD, 1), device="cpu"), torch.arange(5000.0))
    finally:
        thread.join(30)
    assert same_bits(receiver.recv(0, make_tag(FWD, 0)), ahead)


def test_a_message_already_here_is_not_claimed(slot_pair):
    sender, receiver, engine = slot_pair
    sender.send(1, make_tag(FWD, 0), torch.arange(100.0)).wait(timeout=20)
    while (0, make_tag(FWD, 0)) not in receiver.poll():
        time.sleep(0.001)
    assert not receiver._core.claim_receive(0, make_tag(FWD, 0))
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0), device="cpu"), torch.arange(100.0))
    assert engine.slot_receives == 0


def test_a_claim_that_timed_out_before_its_message_leaves_the_link_usable(slot_pair):
    from megatron_app.transport import TransportTimeout

    sender, receiver, engine = slot_pair
    with pytest.raises(TransportTimeout):
        receiver.recv(0, make_tag(FWD, 0), timeout=0.05, device="cpu")
    sender.send(1, make_tag(FWD, 0), torch.arange(100.0)).wait(timeout=20)
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), torch.arange(100.0))  # the withdrawn claim let it pass


@pytest.mark.parametrize("how", ["environment", "argument"])
def test_receives_from_the_slots_can_be_turned_off(job_id, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv("MEGATRON_APP_CUDA_RECEIVE_FROM_SLOTS", "0")
    engine = FakeCopyEngine()
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine,
                         **({"receive_from_slots": False} if how == "argument" else {}))
    try:
        threading.Timer(0.1, lambda: sender.send(1, make_tag(FWD, 0), torch.arange(100.0))).start()
        assert torch.equal(receiver.recv(0, make_tag(FWD, 0), device="cpu"), torch.arange(100.0))
        assert engine.slot_receives == 0
    finally:
        time.sleep(0.2)
        sender.close()
        receiver.close()


STALLING_SENDER = """
import sys, time, torch
sys.path.insert(0, sys.argv[2])
from transport_helpers.fake_engine import FakeCopyEngine
from megatron_app.transport import Direction, Transport, make_tag

class Stalls(FakeCopyEngine):
    def wait(self, token):
        if self.copies > 6:
            print("stalled", flush=True)
            time.sleep(60)
        super().wait(token)

t = Transport(0, 2, sys.argv[1], slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=Stalls())
sys.stdin.readline()
t.send(1, make_tag(Direction.FORWARD, 0), torch.arange(40_000.0))
time.sleep(60)
"""


def test_a_sender_killed_mid_message_leaves_the_slot_receive_with_peer_died_in_one_line(job_id):
    import signal as signals
    import subprocess
    import sys
    from pathlib import Path

    from megatron_app.transport import PeerDied
    from transport_helpers.common import job_segments

    engine = FakeCopyEngine()
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine)
    claim = receiver._core = ClaimSignal(receiver._core)
    sender = subprocess.Popen([sys.executable, "-c", STALLING_SENDER, job_id, str(Path(__file__).parent)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stalled = []

    def start_then_kill():
        claim.claimed.wait(20)
        sender.stdin.write("go\n")
        sender.stdin.flush()
        stalled.append(sender.stdout.readline().strip())
        sender.send_signal(signals.SIGKILL)

    killer = threading.Thread(target=start_then_kill)
    killer.start()
    try:
        with pytest.raises(PeerDied) as raised:
            receiver.recv(0, make_tag(FWD, 0), device="cpu")
        text = str(raised.value)
        assert stalled == ["stalled"] and len(text.splitlines()) == 1 and "died" in text, text
        assert engine.slot_receives >= 1 and engine.in_flight == 0  # it was inside the message, copies finished
    finally:
        killer.join(30)
        if sender.poll() is None:
            sender.kill()
        sender.wait(timeout=20)
        receiver.close()
    assert job_segments(job_id) == []


def test_the_event_wait_mode_is_chosen_by_name_or_environment(monkeypatch):
    from megatron_app.transport.device_engine import EVENT_WAIT_ENV, CudaCopyEngine, event_wait_mode

    monkeypatch.delenv(EVENT_WAIT_ENV, raising=False)
    assert event_wait_mode() == "spin" and CudaCopyEngine().event_wait == "spin"
    assert CudaCopyEngine(event_wait="block").event_wait == "block"
    monkeypatch.setenv(EVENT_WAIT_ENV, "block")
    assert CudaCopyEngine().event_wait == "block" and CudaCopyEngine(event_wait="spin").event_wait == "spin"
    monkeypatch.setenv(EVENT_WAIT_ENV, "sleep")
    with pytest.raises(ValueError, match=f"^{EVENT_WAIT_ENV} must be one of spin, block, got 'sleep'$"):
        CudaCopyEngine()


def test_ipc_sent_tensors_are_let_go_once_their_copies_are_done_without_wait_sends(job_id):
    """A ping-pong never calls wait_sends: each IPC send's handle kept its tensor alive until then, so on a GPU
    every received tensor stayed allocated and the next receive needed fresh device memory (cudaMalloc)."""
    import gc
    import weakref

    from transport_helpers.fake_engine import FakeCopy

    class LateIpcCopies(FakeIpcEngine):
        def ipc_fill(self, destination, source, filled, consumed):
            destination.copy_(source)
            filled.record()
            return FakeCopy(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8), polls_left=1)

    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=LateIpcCopies(),
                       cuda_ipc=True)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=FakeIpcEngine(),
                         cuda_ipc=True)
    try:
        sent = []
        for index in range(40):
            tensor = torch.full((1000,), float(index))
            sent.append(weakref.ref(tensor))
            sender.send(1, make_tag(FWD, index), tensor)
            del tensor
            assert torch.equal(receiver.recv(0, make_tag(FWD, index)), torch.full((1000,), float(index)))
            wait_for_an_acknowledgement(sender)
        gc.collect()
        assert sender.device_path_of(1) == "cuda ipc"
        assert len(sender._stager._handles) <= 2 and sum(ref() is not None for ref in sent) <= 2
    finally:
        sender.close()
        receiver.close()


# ---- CUDA IPC: the slot lent to the receiver (device_ipc.py's lifetime rule) -----------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_is_lent_from_its_ipc_slot_bit_exactly(ipc_pair, dtype):
    sender, receiver, engine = ipc_pair
    for index, shape in enumerate([(), (1,), (7, 5), (2, 3, 4, 5), (9000,), (3, 0)]):
        tensor = random_tensor(torch.Generator().manual_seed(index), dtype, shape)
        sender.send(1, make_tag(FWD, index), tensor)
        received = receiver.recv(0, make_tag(FWD, index), device="cpu")  # "cpu" is the fake's device
        assert same_bits(received, tensor), shape
        del received
        receiver.poll()  # the lent slot's acknowledgement goes out with the next call
        if tensor.numel():
            wait_for_an_acknowledgement(sender)
    sender.wait_sends(timeout=10)
    # (3, 0): an empty tensor takes the staged path (no IPC slot for nothing)
    assert sender.device_path_of(1) == "cuda ipc + slots, registered" and engine.lends == 5 and engine.takes == 0


def test_a_lent_slot_is_not_refilled_while_its_tensor_lives(ipc_pair):
    sender, receiver, engine = ipc_pair
    held = []
    for index in range(6):  # 4 slots: the receiver holding 4 lent tensors makes the rest go staged
        sender.send(1, make_tag(FWD, index), torch.full((2000,), float(index)))
        held.append(receiver.recv(0, make_tag(FWD, index), device="cpu"))
        held[-1][:10] = -1.0  # the receiver may write into what it holds
    sender.wait_sends(timeout=10)
    assert engine.lends == 4 and sender.device_path_of(1) == "cuda ipc + slots, registered"
    for index, tensor in enumerate(held):
        assert torch.equal(tensor[10:], torch.full((1990,), float(index))) and bool((tensor[:10] == -1).all())
    assert not any(tag >> 60 == 0xF for _, tag in sender.poll())  # nothing acknowledged while held
    del held[0], tensor
    receiver.poll()
    wait_for_an_acknowledgement(sender)
    sender.send(1, make_tag(FWD, 6), torch.full((2000,), 6.0))
    assert torch.equal(receiver.recv(0, make_tag(FWD, 6), device="cpu"), torch.full((2000,), 6.0))
    assert engine.lends == 5  # the slot given back carried the next message
    for index, tensor in enumerate(held, start=1):  # the slots still held were left alone
        assert torch.equal(tensor[10:], torch.full((1990,), float(index)))


def test_ipc_lending_can_be_turned_off(job_id, monkeypatch):
    monkeypatch.setenv("MEGATRON_APP_CUDA_IPC_LEND", "0")
    engine = FakeIpcEngine()
    sender = Transport(0, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine, cuda_ipc=True)
    receiver = Transport(1, 2, job_id, slot_bytes=4096, num_slots=8, timeout_s=20, copy_engine=engine,
                         cuda_ipc=True)
    try:
        sender.send(1, make_tag(FWD, 0), torch.arange(100.0))
        assert torch.equal(receiver.recv(0, make_tag(FWD, 0), device="cpu"), torch.arange(100.0))
        assert engine.lends == 0 and engine.takes == 1
        wait_for_an_acknowledgement(sender)  # a copy is acknowledged at once
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("nbytes", [1, 4096, 3 * 4096 + 5])
def test_the_last_copies_can_be_left_to_the_callers_stream_and_their_slots_given_back_later(nbytes):
    from megatron_app.transport.device_staging import receive_through_slots

    payload = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    core, engine = FakeReceiveCore(payload, slots=2), FakeCopyEngine(lag=100)
    deferred = []
    received = receive_through_slots(core, engine, 0, "cpu", 10, defer=deferred.append)
    assert bytes(received.tolist()) == payload and engine.ordered_after == 1
    assert deferred and core.events.count("release") == core.taken - len(deferred)  # still held
    for token in deferred:
        engine.wait(token)
        core.release_claimed_chunk(0)
    assert core.handed == []


def test_a_receive_from_the_slots_gives_its_last_slots_back_without_another_call(slot_pair):
    """A rank that stops calling the transport after a receive (computing, in a collective with the peer) must not
    keep the peer's ring held: the releaser's thread gives the slots back once their copies are done."""
    sender, receiver, engine = slot_pair
    first, = receive_claimed(sender, receiver, [torch.arange(3000.0)])
    assert torch.equal(first, torch.arange(3000.0)) and engine.ordered_after == 1
    big = torch.randn(30_000)  # larger than the ring: it arrives only once the claim's last slots were given back
    handle = sender.send(1, make_tag(FWD, 7), big)
    give_up_at = time.monotonic() + 20
    while receiver._core.peek(0, make_tag(FWD, 7)) is None:  # the core's own call: the transport settles nothing
        assert time.monotonic() < give_up_at, "the claimed receive kept the ring"
        time.sleep(0.001)
    handle.wait(timeout=20)
    assert not receiver._releaser.pending() and same_bits(receiver.recv(0, make_tag(FWD, 7)), big)


def test_the_slot_releaser_gives_each_slot_back_only_after_its_copy():
    from transport_helpers.fake_engine import FakeCopy

    from megatron_app.transport.device_staging import SlotReleaser

    tokens = [FakeCopy(torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8), polls_left=10)
              for _ in range(5)]

    class Core:
        released = []

        def release_claimed_chunk(self, peer):
            self.released.append((peer, tokens[len(self.released)].performed))

    engine = FakeCopyEngine()
    engine.in_flight = len(tokens)
    releaser = SlotReleaser(Core(), engine)
    try:
        for token in tokens:
            releaser.add(3, token)
        give_up_at = time.monotonic() + 20
        while len(Core.released) < len(tokens):
            assert time.monotonic() < give_up_at, "the releaser's thread gave nothing back"
            time.sleep(0.001)
        assert Core.released == [(3, True)] * 5 and not releaser.pending()
    finally:
        releaser.stop()


# ---- the span a device send's trace event gets (executor._send_span): its own transfer ------------------------------
class MarkedLateEngine(FakeCopyEngine):
    """Marks at given times: the start mark 5 ms and the end mark 7 ms after the engine was made (device seconds
    between them: 2 ms), whenever the host makes them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.origin = time.monotonic()
        self.offsets = []

    def mark(self, device):
        from transport_helpers.fake_engine import FakeMark

        self.marks += 1
        self.offsets.append(0.005 if self.marks % 2 else 0.007)
        return FakeMark(self.origin + self.offsets[-1])


@pytest.mark.parametrize("size, where", [(100, "inline"), (100_000, "stager")])
def test_a_device_send_knows_its_transfer_from_its_marks(job_id, monkeypatch, size, where):
    import megatron_app.transport.device_staging as staging

    engine = MarkedLateEngine(lag=1)
    sender, receiver = staged_pair(job_id, engine)
    try:
        monkeypatch.setattr(staging, "INLINE_SEND_BYTES", 1000)
        posted = time.monotonic()
        handle = sender.send(1, make_tag(FWD, 0), torch.arange(float(size)))
        handle.wait(timeout=10)
        seen = time.monotonic()
        start, end = handle.transfer_span()
        assert engine.marks == 2 and abs((end - start) - 0.002) < 1e-9   # the device's seconds, not the host's
        assert posted <= end <= seen
        assert engine.copy_threads[0] == ("megatron_app-stager" if where == "stager" else
                                          threading.current_thread().name)
        assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), torch.arange(float(size)))
    finally:
        sender.close()
        receiver.close()


def test_sends_without_device_marks_have_no_transfer_span(pair):
    sender, receiver, engine = pair
    engine.handles = lambda tensor: False            # a host tensor: the core's handle, posted to completion
    handle = sender.send(1, make_tag(FWD, 0), torch.arange(10))
    handle.wait(timeout=10)
    assert getattr(handle, "transfer_span", None) is None
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), torch.arange(10))


def test_an_ipc_send_on_the_callers_thread_is_timed_from_its_marks(ipc_pair):
    sender, receiver, engine = ipc_pair
    handle = sender.send(1, make_tag(FWD, 0), torch.arange(100.0))
    assert handle.transfer_span() is None or handle.done()   # no span before its copy is seen done
    handle.wait(timeout=10)
    start, end = handle.transfer_span()
    assert 0 <= end - start < 1.0 and sender.device_path_of(1) == "cuda ipc"
    assert torch.equal(receiver.recv(0, make_tag(FWD, 0)), torch.arange(100.0))


def test_the_executor_traces_a_device_send_from_its_transfer_and_keeps_the_wait_before_it():
    from megatron_app.runtime.executor import PipelineStep

    class Clock:
        now = 10_000.0

        def _now(self):
            return self.now

    class Timed:
        def __init__(self, span):
            self.span = span

        def transfer_span(self):
            return self.span

    seen = time.monotonic()
    clock = Clock()
    # posted at 2,000 us; its transfer took 1 ms and ended 3 ms before now (now_us 10,000): 6,000 .. 7,000 us
    start, end, extra = PipelineStep._send_span(clock, Timed((seen - 0.004, seen - 0.003)), 2_000.0)
    assert abs(end - 7_000.0) < 200 and abs((end - start) - 1_000.0) < 1e-3
    assert abs(extra["queued_us"] - (start - 2_000.0)) < 1e-3
    # a transfer that would begin before the posting is cut there
    start, end, extra = PipelineStep._send_span(clock, Timed((seen - 1.0, seen)), 9_500.0)
    assert start == 9_500.0 and extra["queued_us"] == 0.0
    # a handle without a span (a host tensor's): posting to now
    assert PipelineStep._send_span(clock, object(), 2_000.0) == (2_000.0, 10_000.0, {})
