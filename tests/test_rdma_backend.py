"""The RDMA backend as the job sees it: built exactly when rdma-core's verbs header exists, a forced rdma
transport without a device fails with one clear line, and (on a machine with an active RDMA port) tensors cross
a loopback link intact. No kernel RDMA support exists on these machines: the device test skips with the reason."""

import datetime
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_app.transport import _shm_tensor_rdma as core
from megatron_app.transport import BackendUnavailable, Direction, Transport, TransportClosed, make_tag, open_transport

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT, USABLE, DETAIL = core.rdma_status()
needs_device = pytest.mark.skipif(not USABLE, reason=f"no usable RDMA device here: {DETAIL}")
needs_no_device = pytest.mark.skipif(USABLE, reason=f"this host has an RDMA device ({DETAIL})")


def test_backend_is_built_exactly_when_the_verbs_header_exists():
    header = os.path.exists("/usr/include/infiniband/verbs.h")
    if os.environ.get("MAPP_WITHOUT_RDMA", "") not in ("", "0"):
        pytest.skip("built with MAPP_WITHOUT_RDMA set")
    assert BUILT == header, DETAIL
    if not BUILT:
        assert DETAIL.startswith("not built")


@pytest.mark.skipif(os.path.exists("/sys/class/infiniband"), reason="this kernel has RDMA support")
def test_status_says_no_devices_without_kernel_support():
    if not BUILT:
        pytest.skip(f"rdma backend {DETAIL}")
    assert (BUILT, USABLE, DETAIL) == (True, False, "no RDMA devices")


@needs_no_device
def test_transport_with_an_rdma_link_says_no_usable_device():
    with pytest.raises(ValueError, match="^no usable RDMA device: "):
        Transport(0, 2, "rdmanone", backends={1: "rdma"})


@needs_no_device
def test_bad_rdma_setting_is_named(monkeypatch):
    if not BUILT:
        pytest.skip(f"rdma backend {DETAIL}")
    monkeypatch.setenv("MEGATRON_APP_RDMA_SLOTS", "0")
    with pytest.raises(ValueError, match="no usable RDMA device: MEGATRON_APP_RDMA_SLOTS='0'"):
        Transport(0, 2, "rdmabad", backends={1: "rdma"})


@needs_no_device
def test_forced_rdma_rendezvous_fails_with_the_reason():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    errors = {}

    def open_rank(rank):
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        try:
            open_transport(client, rank, 2, "rdmaforced", [1 - rank], mode="rdma", timeout_s=20)
        except Exception as error:  # reported below
            errors[rank] = error

    threads = [threading.Thread(target=open_rank, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for rank in (0, 1):
        assert isinstance(errors.get(rank), BackendUnavailable), errors
        assert "have no usable RDMA device" in str(errors[rank])
        assert f"[rank {rank}: {DETAIL}]" in str(errors[rank])


def _train(argv, **env):
    environ = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", PYTHONPATH=REPO, **env)
    return subprocess.run([sys.executable, "-m", "megatron_app.train", *argv], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=120)


@needs_no_device
def test_forced_rdma_fails_the_config_check_in_one_line():
    result = _train(["--pipeline_parallel", "2", "--check-config"], MEGATRON_APP_TRANSPORT="rdma")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "megatron_app.train: error: MEGATRON_APP_TRANSPORT=rdma but this host has no usable RDMA device "
        f"({DETAIL}); see tools/rdma_check.py, or use tcp or auto"]
    assert _train(["--pipeline_parallel", "2", "--check-config"], MEGATRON_APP_TRANSPORT="tcp").returncode == 0


def test_trainer_reports_an_unservable_backend_in_one_line(monkeypatch, capsys):
    import megatron_app.train.__main__ as cli
    import megatron_app.train.loop as loop

    def refuse(args):
        raise BackendUnavailable("MEGATRON_APP_TRANSPORT=rdma but rank(s) [0] have no usable RDMA device")

    monkeypatch.setattr(loop, "train", refuse)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "megatron_app.train: error: MEGATRON_APP_TRANSPORT=rdma but rank(s) [0] have no usable RDMA device"]


@needs_device
def test_tensors_cross_a_loopback_rdma_link(monkeypatch):
    monkeypatch.setenv("MEGATRON_APP_RDMA_SLOT_BYTES", "8192")  # small slots: messages span many chunks
    monkeypatch.setenv("MEGATRON_APP_RDMA_SLOTS", "4")
    a = Transport(0, 2, "rdmaloop", backends={1: "rdma"}, timeout_s=30)
    b = Transport(1, 2, "rdmaloop", backends={0: "rdma"}, timeout_s=30)
    try:
        a.set_peer_addresses({1: b.local_address("rdma")})
        b.set_peer_addresses({0: a.local_address("rdma")})
        assert a.backend_of(1) == "rdma"
        tensors = [torch.arange(n, dtype=torch.float32) for n in (0, 1, 2000, 100_000)] + [torch.ones(3, 5, 7)]
        for i, tensor in enumerate(tensors):
            a.send(1, make_tag(Direction.FORWARD, i), tensor)
            b.send(0, make_tag(Direction.BACKWARD, i), tensor * 2)
        for i, tensor in enumerate(tensors):
            assert torch.equal(b.recv(0, make_tag(Direction.FORWARD, i), timeout=30), tensor)
            assert torch.equal(a.recv(1, make_tag(Direction.BACKWARD, i), timeout=30), tensor * 2)
        a.wait_sends(timeout=30)
        a.close()
        with pytest.raises(TransportClosed, match="peer rank 0 closed its transport"):
            b.recv(0, make_tag(Direction.FORWARD, 99), timeout=30)
    finally:
        a.close()
        b.close()
