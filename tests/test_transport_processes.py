"""Transport between real processes: a stress run, full rings, crashes (kill -9) and CPU use while blocked.

The test process is one rank (an in-process Transport); the others run tests/transport_helpers/rank_main.py.
"""

import gc
import json
import os
import signal
import time

import pytest
import torch
from transport_helpers.common import (
    RankProcess,
    job_id_fixture,  # noqa: F401  (provides the job_id fixture)
    job_segments,
    message_for,
    process_cpu_seconds,
    same_bits,
)

from megatron_app.transport import Direction, PeerDied, Transport, make_tag

FWD = Direction.FORWARD


def tag(index):
    return make_tag(FWD, index)


@pytest.fixture
def ranks():
    """Subprocess ranks started by a test; killed and reaped at teardown."""
    started = []
    yield lambda *args: started.append(RankProcess(*map(str, args))) or started[-1]
    for rank in started:
        rank.close()


def test_stress_two_senders_one_receiver(job_id, ranks):
    count = 1500
    # 16 KiB slots, 4 per ring: most messages are chunked and the rings are full most of the time.
    senders = {peer: ranks("send-stream", job_id, peer, 3, 0, count, peer, 16384, 8) for peer in (1, 2)}
    with Transport(0, 3, job_id, slot_bytes=16384, num_slots=8, timeout_s=60) as receiver:
        next_index = {1: 0, 2: 0}
        window = 16
        while any(index < count for index in next_index.values()):
            keys = [(peer, tag(i)) for peer, start in next_index.items()
                    for i in range(start, min(start + window, count))]
            peer, arrived = receiver.wait_any(keys, timeout=60)
            index = arrived & 0xFFFFFFFF
            received = receiver.try_recv(peer, arrived)
            assert index == next_index[peer], "messages from one peer arrive in the order they were sent"
            assert same_bits(received, message_for(seed=peer, index=index)), (peer, index)
            next_index[peer] += 1
        for sender in senders.values():
            sender.expect("READY")
            sender.expect("SENT")
            sender.expect("DONE")
            assert sender.wait() == 0


def test_full_rings_make_the_worker_wait_not_the_caller(job_id, ranks):
    count = 40
    # Receiver capacity: 2 slots of 4 KiB. The receiver is stopped, so the rings fill up at once.
    receiver = ranks("recv-stream", job_id, 1, 2, 0, count, 5, 4096, 2)
    receiver.expect("READY")
    with Transport(0, 2, job_id, timeout_s=60) as sender:
        sender.send(1, make_tag(Direction.CONTROL, 0), torch.zeros(1))  # make sure the link is attached
        os.kill(receiver.pid, signal.SIGSTOP)
        try:
            slowest = 0.0
            handles = []
            for index in range(count):
                tensor = message_for(seed=5, index=index).clone()
                start = time.perf_counter()
                handles.append(sender.send(1, tag(index), tensor))
                slowest = max(slowest, time.perf_counter() - start)
                del tensor  # the transport keeps it alive until the copy is done
            gc.collect()
            garbage = [torch.full((10_000,), 7.0) for _ in range(50)]  # reuse freed memory, if any was freed
            assert slowest < 0.25, f"send() blocked for {slowest:.3f} s"
            cpu_before = process_cpu_seconds()
            time.sleep(1.0)
            cpu_used = process_cpu_seconds() - cpu_before
            assert not handles[-1].done()
            assert cpu_used < 0.05, f"a sender blocked on full rings used {cpu_used:.3f} s CPU in 1 s"
        finally:
            os.kill(receiver.pid, signal.SIGCONT)
        del garbage
        receiver.expect("VERIFIED", timeout=60)
        sender.wait_sends(timeout=60)
        assert all(handle.done() for handle in handles)


def test_messages_sent_before_a_crash_are_delivered_then_peer_died(job_id, ranks):
    crasher = ranks("send-then-exit", job_id, 1, 2, 0, 20, 9)
    with Transport(0, 2, job_id, timeout_s=60) as receiver:
        crasher.expect("READY")
        crasher.expect("SENT")
        assert crasher.wait() == 0  # exited without closing its transport
        for index in range(20):
            assert same_bits(receiver.recv(1, tag(index), timeout=10), message_for(seed=9, index=index))
        start = time.monotonic()
        with pytest.raises(PeerDied, match=rf"peer rank 1 \(pid {crasher.pid}\) died while rank 0 waited for "
                                           r"tag FORWARD vmb=20 iter=0"):
            receiver.recv(1, tag(20), timeout=30)
        assert time.monotonic() - start < 2.0  # detection takes ~0.1-0.2 s; slack for a loaded machine


def test_kill_9_mid_transfer_then_same_job_id_starts_cleanly(job_id, ranks):
    sender = ranks("send-stream", job_id, 1, 2, 0, 100_000, 3)
    with Transport(0, 2, job_id, timeout_s=60) as receiver:
        for index in range(30):
            assert same_bits(receiver.recv(1, tag(index), timeout=30), message_for(seed=3, index=index))
        os.kill(sender.pid, signal.SIGKILL)  # not reaped yet: a zombie counts as dead too
        start = time.monotonic()
        with pytest.raises(PeerDied, match=rf"peer rank 1 \(pid {sender.pid}\) died"):
            for index in range(30, 100_000):
                receiver.recv(1, tag(index), timeout=30)
        assert time.monotonic() - start < 2.0
    sender.kill()
    assert job_segments(job_id) == []
    # A new job with the same id starts and runs normally.
    with Transport(0, 2, job_id) as first, Transport(1, 2, job_id) as second:
        first.send(1, tag(0), torch.arange(5))
        assert torch.equal(second.recv(0, tag(0), timeout=10), torch.arange(5))
    assert job_segments(job_id) == []


def test_kill_9_receiver_fails_the_blocked_send(job_id, ranks):
    receiver = ranks("serve", job_id, 1, 2, 4096, 2)
    receiver.expect("READY")
    with Transport(0, 2, job_id, timeout_s=60) as sender:
        sender.send(1, tag(0), torch.zeros(10))
        receiver.expect("GOT 0")
        os.kill(receiver.pid, signal.SIGSTOP)
        handles = [sender.send(1, tag(index), torch.zeros(10_000)) for index in range(1, 6)]
        assert not handles[-1].done()
        os.kill(receiver.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(PeerDied, match=rf"peer rank 1 \(pid {receiver.pid}\) died while rank 0 was sending "
                                           r"tag FORWARD vmb=\d+ iter=0 to peer rank 1"):
            handles[-1].wait(timeout=30)
        assert time.monotonic() - start < 2.0  # detection takes ~0.1-0.2 s; slack for a loaded machine
        with pytest.raises(PeerDied, match=r"died while rank 0 was sending .* \(and \d+ more failed sends\)"):
            sender.poll()  # the other failed sends, reported together by the next call
        sender.wait_sends(timeout=10)  # each failure is reported once
        assert sender.poll() == []


def test_ctrl_c_interrupts_a_blocking_receive(job_id, ranks):
    waiter = ranks("interruptible", job_id, 1, 2, 0)
    waiter.expect("READY")
    time.sleep(0.3)  # let it block inside recv
    start = time.monotonic()
    waiter.process.send_signal(signal.SIGINT)
    line = waiter.expect("INTERRUPTED", timeout=10)
    assert time.monotonic() - start < 2.0, line
    assert waiter.wait() == 0


def test_blocked_rank_uses_no_cpu(job_id, ranks):
    with Transport(0, 2, job_id):
        waiter = ranks("idle-wait", job_id, 1, 2, 0, 1.5)
        waiter.expect("READY")
        line = waiter.expect("RESULT", timeout=30)
    result = json.loads(line.split(" ", 1)[1])
    assert result["outcome"] == "timeout" and result["wall_s"] >= 1.4
    assert result["cpu_s"] <= 0.05 * result["wall_s"], result
