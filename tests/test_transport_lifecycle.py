"""Shared-memory names: created per job and rank, removed as soon as every peer attached, on close, and after
crashes; never touching another job's names."""

import os
import time

import pytest
import torch
from transport_helpers.common import (
    RankProcess,
    job_id_fixture,  # noqa: F401  (provides the job_id fixture)
    job_segments,
    new_job_id,
)

from megatron_app.transport import Transport, TransportClosed, cleanup_job


@pytest.fixture
def ranks():
    started = []
    yield lambda *args: started.append(RankProcess(*map(str, args))) or started[-1]
    for rank in started:
        rank.close()


def test_names_disappear_once_every_peer_attached(job_id):
    with Transport(0, 2, job_id) as first, Transport(1, 2, job_id) as second:
        first.send(1, 1, torch.ones(1))
        second.send(0, 2, torch.ones(1))
        second.recv(0, 1, timeout=10)
        first.recv(1, 2, timeout=10)
        first.wait_sends(timeout=10)
        second.wait_sends(timeout=10)
        # Both attached to each other: the kernel frees the memory when the processes exit, whatever happens.
        assert job_segments(job_id) == []
        first.send(1, 3, torch.ones(1))
        assert second.recv(0, 3, timeout=10).item() == 1


def test_name_waits_for_missing_peers_and_close_removes_it(job_id):
    transport = Transport(0, 3, job_id)
    assert job_segments(job_id) == [f"mapp_{job_id}_r0"]
    transport.close()
    assert job_segments(job_id) == []


def test_crash_leftovers_are_removed_by_start_up_close_and_cleanup_job(job_id, ranks):
    def crash_rank(rank):
        process = ranks("serve", job_id, rank, 4)  # peers that never start: its name stays
        process.expect("READY")
        process.kill()  # kill -9, reaped
        return f"mapp_{job_id}_r{rank}"

    other_job = new_job_id()
    with Transport(0, 2, other_job):  # a live segment of another job
        left_by_rank_1 = crash_rank(1)
        assert job_segments(job_id) == [left_by_rank_1]
        assert cleanup_job(other_job) == []  # touches nothing of this job, nor live segments
        assert job_segments(other_job) == [f"mapp_{other_job}_r0"]

        # Start-up of the same rank replaces its stale segment.
        with Transport(1, 4, job_id):
            assert job_segments(job_id) == [left_by_rank_1]
        assert job_segments(job_id) == []

        # close() of any rank removes leftovers of dead processes of its job.
        left_by_rank_2 = crash_rank(2)
        live = Transport(3, 4, job_id)
        assert job_segments(job_id) == [left_by_rank_2, f"mapp_{job_id}_r3"]
        live.close()
        assert job_segments(job_id) == []

        # cleanup_job removes the dead only.
        left_by_rank_1 = crash_rank(1)
        with Transport(3, 4, job_id):
            assert cleanup_job(job_id) == [left_by_rank_1]
            assert job_segments(job_id) == [f"mapp_{job_id}_r3"]
    assert job_segments(other_job) == []


def test_job_ids_that_share_a_prefix_stay_apart(ranks):
    job = new_job_id()
    longer = job + "_r1"  # "mapp_<job>_r1_r0" must not be taken for rank 1 of <job>
    process = ranks("serve", longer, 0, 3)
    process.expect("READY")
    process.kill()
    try:
        assert job_segments(longer) == [f"mapp_{longer}_r0"]
        assert cleanup_job(job) == []
        assert cleanup_job(longer) == [f"mapp_{longer}_r0"]
    finally:
        cleanup_job(longer)


def test_a_live_rank_cannot_be_started_twice(job_id, ranks):
    process = ranks("serve", job_id, 1, 3)
    process.expect("READY")
    with pytest.raises(RuntimeError, match=rf"rank 1 of job '{job_id}' is already running as pid {process.pid}"):
        Transport(1, 3, job_id)
    process.kill()
    cleanup_job(job_id)


def test_two_jobs_with_the_same_tags_do_not_mix():
    jobs = [new_job_id(), new_job_id()]
    transports = [(Transport(0, 2, job), Transport(1, 2, job)) for job in jobs]
    try:
        for value, (sender, _) in enumerate(transports):
            sender.send(1, 42, torch.full((1000,), float(value)))
        for value, (_, receiver) in enumerate(transports):
            assert torch.equal(receiver.recv(0, 42, timeout=10), torch.full((1000,), float(value)))
            assert receiver.poll() == []
    finally:
        for pair in transports:
            for transport in pair:
                transport.close()
    assert all(job_segments(job) == [] for job in jobs)


def test_peer_closing_ends_a_wait_promptly(job_id):
    first = Transport(0, 2, job_id)
    second = Transport(1, 2, job_id)
    first.send(1, 1, torch.ones(1))
    second.recv(0, 1, timeout=10)  # attached both ways
    first.send(1, 2, torch.ones(3))
    first.wait_sends(timeout=10)
    first.close()
    assert torch.equal(second.recv(0, 2, timeout=10), torch.ones(3))  # sent before close: still delivered
    start = time.monotonic()
    with pytest.raises(TransportClosed, match="peer rank 0 closed its transport while rank 1 waited for tag "
                                              "0x0000000000000003"):
        second.recv(0, 3, timeout=30)
    assert time.monotonic() - start < 2.0  # detection takes ~0.1-0.2 s; slack for a loaded machine
    second.close()


def test_a_forked_child_leaves_the_parents_transport_alone(job_id):
    first, second = Transport(0, 2, job_id), Transport(1, 2, job_id)
    try:
        first.send(1, 1, torch.ones(2))
        second.recv(0, 1, timeout=10)
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            try:
                first.poll()
                verdict = b"used"
            except RuntimeError as error:
                verdict = b"refused" if b"forked child cannot use it" in str(error).encode() else b"wrong error"
            first.close()  # must neither stop the parent's threads nor mark its segment closed
            os.write(write_end, verdict)
            os._exit(0)
        os.close(write_end)
        _, status = os.waitpid(child, 0)
        assert os.read(read_end, 64) == b"refused" and status == 0
        os.close(read_end)
        second.send(0, 2, torch.full((3,), 5.0))
        assert torch.equal(first.recv(1, 2, timeout=10), torch.full((3,), 5.0))
        first.send(1, 3, torch.ones(1))
        assert second.recv(0, 3, timeout=10).item() == 1
    finally:
        first.close()
        second.close()


def test_close_cancels_pending_sends(job_id):
    transport = Transport(0, 2, job_id, timeout_s=30)  # rank 1 never starts
    handle = transport.send(1, 1, torch.ones(4))
    start = time.monotonic()
    transport.close()
    with pytest.raises(TransportClosed, match="transport closed"):
        handle.wait(timeout=5)
    assert time.monotonic() - start < 2.0  # detection takes ~0.1-0.2 s; slack for a loaded machine


def test_context_manager_flushes_sends_on_clean_exit(job_id):
    receiver = Transport(1, 2, job_id)
    with Transport(0, 2, job_id) as sender:
        handle = sender.send(1, 1, torch.ones(1_000_000))
    assert handle.done() and sender.closed
    assert torch.equal(receiver.recv(0, 1, timeout=10), torch.ones(1_000_000))
    receiver.close()


def test_the_same_rank_twice_in_one_process_is_refused(job_id):
    with Transport(0, 3, job_id):
        with pytest.raises(RuntimeError, match=f"rank 0 of job '{job_id}' is already running as pid {os.getpid()}"):
            Transport(0, 3, job_id)


def test_the_launchers_cleanup_removes_the_dead_without_importing_torch(job_id, ranks):
    """run_single.sh and launch_node.sh end with tools/transport_core.py --cleanup JOB (the core loaded from its file:
    an import through megatron_app.transport would import torch, seconds on a CUDA host, at every launcher's exit)."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "transport_core.py"
    process = ranks("serve", job_id, 1, 3)
    process.expect("READY")
    process.kill()
    with Transport(0, 3, job_id):
        assert job_segments(job_id) == [f"mapp_{job_id}_r0", f"mapp_{job_id}_r1"]
        probe = (f"import runpy, sys\nsys.argv = ['transport_core.py', '--cleanup', {job_id!r}]\n"
                 f"try:\n    runpy.run_path({str(tool)!r}, run_name='__main__')\n"
                 "except SystemExit as done:\n    assert not done.code, done.code\n"
                 "assert 'torch' not in sys.modules, 'the cleanup imported torch'")
        subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)
        assert job_segments(job_id) == [f"mapp_{job_id}_r0"]
    check = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    missing = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "MEGATRON_APP_CORE": "/nonexistent/core.so"})
    assert (missing.returncode, missing.stderr.strip()) == (1, "transport_core.py: /nonexistent/core.so is not built "
                                                               "(run `pip install -e . --no-build-isolation --no-deps`)")
