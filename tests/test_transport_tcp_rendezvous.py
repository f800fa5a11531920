"""Backend choice per link and the address exchange through a real torch.distributed TCPStore."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_app.transport import Direction, choose_backends, make_tag, open_transport, requested_mode
from megatron_app.transport.backend_choice import advertised_address, host_identity

HOSTS = {0: "nodeA/boot1/ns1", 1: "nodeA/boot1/ns1", 2: "nodeB/boot2/ns7", 3: "nodeB/boot2/ns7"}


def test_auto_uses_shm_on_the_same_host_and_tcp_across():
    assert choose_backends(0, [1, 2, 3], HOSTS, {}, "auto") == {1: "shm", 2: "tcp", 3: "tcp"}
    assert choose_backends(2, [0, 3], HOSTS, {}, "auto") == {0: "tcp", 3: "shm"}


def test_auto_prefers_rdma_only_when_both_ends_have_a_device():
    rdma = {0: True, 2: True, 3: False}
    assert choose_backends(0, [1, 2, 3], HOSTS, rdma, "auto") == {1: "shm", 2: "rdma", 3: "tcp"}


def test_both_ends_of_every_link_agree():
    rdma = {0: True, 1: False, 2: True, 3: True}
    for mode in ("auto", "tcp"):
        choices = {r: choose_backends(r, [p for p in HOSTS if p != r], HOSTS, rdma, mode) for r in HOSTS}
        for r in HOSTS:
            for p in choices[r]:
                assert choices[r][p] == choices[p][r], (mode, r, p)


def test_forced_modes():
    assert choose_backends(0, [1, 2], HOSTS, {}, "tcp") == {1: "tcp", 2: "tcp"}
    with pytest.raises(ValueError, match="shm but rank 2 runs on another host"):
        choose_backends(0, [1, 2], HOSTS, {}, "shm")
    with pytest.raises(ValueError, match=r"rdma but rank\(s\) \[0, 2\] have no usable RDMA device"):
        choose_backends(0, [2], HOSTS, {}, "rdma")


def test_requested_mode_reads_the_environment(monkeypatch):
    monkeypatch.setenv("MEGATRON_APP_TRANSPORT", "TCP")
    assert requested_mode() == "tcp"
    monkeypatch.delenv("MEGATRON_APP_TRANSPORT")
    assert requested_mode() == "auto"
    with pytest.raises(ValueError, match="'infiniband' is not a transport; choose one of auto, shm, tcp, rdma"):
        requested_mode("infiniband")


def test_host_identity_includes_the_network_namespace():
    import os

    assert host_identity().endswith("/" + str(os.stat("/proc/self/ns/net").st_ino))
    assert advertised_address("127.0.0.1") == "127.0.0.1"


def test_cuda_ipc_is_known_impossible_across_pid_namespaces_of_one_host():
    from megatron_app.transport.backend_choice import ipc_impossible, pid_namespace

    namespaces = {0: 11, 1: 12, 2: 13, 3: 0}
    off = ipc_impossible(0, [1, 2, 3], {**HOSTS, 3: HOSTS[0]}, namespaces)
    assert list(off) == [1] and "rank 1 runs in another PID namespace than rank 0" in off[1]  # 2: another host
    assert ipc_impossible(0, [1], HOSTS, {0: 11, 1: 11}) == {}                               # 3: unknown, tried
    assert pid_namespace() > 0


def test_cuda_ipc_is_known_impossible_between_gpus_without_peer_access():
    from megatron_app.transport.backend_choice import gpu_identity, ipc_impossible

    namespaces = {0: 11, 1: 11, 2: 11, 3: 11}
    hosts = {rank: HOSTS[0] for rank in range(4)}
    gpus = {0: "GPU-a", 1: "GPU-a", 2: "GPU-b", 3: "GPU-c"}     # 1 shares rank 0's GPU: IPC needs no peer access
    access = {("GPU-a", "GPU-b"): False, ("GPU-a", "GPU-c"): None}   # c is not visible to rank 0: tried
    off = ipc_impossible(0, [1, 2, 3], hosts, namespaces, gpus, lambda mine, theirs: access[(mine, theirs)])
    assert list(off) == [2] and "rank 2's GPU (GPU-b) has no peer access to rank 0's (GPU-a)" in off[2]
    assert ipc_impossible(0, [1, 2], hosts, namespaces, {0: None, 1: "GPU-a", 2: "GPU-b"}) == {}   # a CPU rank
    assert gpu_identity() is None   # no CUDA in use in this process: nothing is initialised for the answer


def test_the_rendezvous_tells_each_transport_which_peers_ipc_cannot_reach(monkeypatch):
    """Each rank publishes its PID namespace; here every rank (a thread) claims its own."""
    import megatron_app.transport.rendezvous as rendezvous

    monkeypatch.setattr(rendezvous, "pid_namespace", lambda: threading.get_ident())
    transports = _open_all(_store(), 2, "rdvpidns", {0: "auto", 1: "auto"})
    try:
        assert all(not isinstance(t, Exception) for t in transports.values()), transports
        assert list(transports[0]._ipc_off) == [1] and list(transports[1]._ipc_off) == [0]
        assert "another PID namespace" in transports[0]._ipc_off[1]
    finally:
        for transport in transports.values():
            if not isinstance(transport, Exception):
                transport.close()


def test_the_rendezvous_probes_ipc_between_ranks_that_asked_for_it_and_stages_to_a_rank_that_failed(monkeypatch):
    """Ranks with CUDA in use that asked for IPC probe each other as their transports open (ipc_probe.py, here with
    a stand-in for the CUDA calls): the second rank to probe cannot read what the other exports, so the other's
    transport stages to it and says why; the first read its bytes, so IPC stays on towards the first."""
    import megatron_app.transport.ipc_probe as ipc_probe
    import megatron_app.transport.rendezvous as rendezvous
    from test_ipc_probe import StandInDevice

    registry, by_thread = {}, {}

    class PerRank:   # the rank is its thread: the second thread's reads fail
        def __getattr__(self, name):
            second = len(by_thread) == 1
            device = by_thread.setdefault(threading.get_ident(), StandInDevice(registry, reads_fail=second))
            return getattr(device, name)

    monkeypatch.setattr(rendezvous, "gpu_identity", lambda: "GPU-same")
    monkeypatch.setattr(ipc_probe, "CudaProbeDevice", PerRank)
    opened = _open_all(_store(), 2, "rdvprobe", {0: "auto", 1: "auto"}, cuda_ipc=True)
    try:
        assert all(not isinstance(t, Exception) for t in opened.values()), opened
        assert sum(bool(t._ipc_off) for t in opened.values()) == 1     # one rank stages to the other
        (stager, why), = [(rank, t._ipc_off) for rank, t in opened.items() if t._ipc_off]
        assert why == {1 - stager: f"rank {1 - stager} could not read rank {stager}'s device memory by CUDA IPC "
                                   "(RuntimeError: CUDA error: invalid device context)"}
    finally:
        for transport in opened.values():
            if not isinstance(transport, Exception):
                transport.close()
    opened = _open_all(_store(), 2, "rdvnoprobe", {0: "auto", 1: "auto"})   # IPC not asked for: no probe
    try:
        assert all(not isinstance(t, Exception) and not t._ipc_off for t in opened.values()), opened
    finally:
        for transport in opened.values():
            if not isinstance(transport, Exception):
                transport.close()


def _store(port=0):
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def _open_all(store, world, job_id, modes, **kwargs):
    """open_transport for every rank, each in a thread (ranks are processes in real jobs); rank -> result."""
    results = {}

    def open_rank(rank):
        try:  # each rank its own client, as in a real job (one client serialises blocking waits)
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
            results[rank] = open_transport(client, rank, world, job_id, [p for p in range(world) if p != rank],
                                           mode=modes[rank], master_addr="127.0.0.1", timeout_s=20, **kwargs)
        except Exception as error:  # reported by the test
            results[rank] = error

    threads = [threading.Thread(target=open_rank, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_forced_tcp_exchanges_addresses_through_the_store():
    store = _store()
    transports = _open_all(store, 3, "rdvtcp", {r: "tcp" for r in range(3)})
    try:
        assert all(not isinstance(t, Exception) for t in transports.values()), transports
        for rank, transport in transports.items():
            assert {transport.backend_of(p) for p in transport.peers} == {"tcp"}
        for sender in range(3):
            for receiver in range(3):
                if sender != receiver:
                    transports[sender].send(receiver, make_tag(Direction.FORWARD, sender), torch.tensor([sender]))
        for receiver in range(3):
            for sender in range(3):
                if sender != receiver:
                    got = transports[receiver].recv(sender, make_tag(Direction.FORWARD, sender), timeout=20)
                    assert got.tolist() == [sender]
    finally:
        for transport in transports.values():
            if not isinstance(transport, Exception):
                transport.close()


def test_auto_on_one_host_picks_shm_and_a_second_round_gets_fresh_keys():
    store = _store()
    for _ in range(2):
        transports = _open_all(store, 2, "rdvauto", {0: "auto", 1: "auto"})
        try:
            assert transports[0].backend_of(1) == "shm" and transports[1].backend_of(0) == "shm"
            transports[0].send(1, make_tag(Direction.FORWARD, 0), torch.ones(2))
            assert torch.equal(transports[1].recv(0, make_tag(Direction.FORWARD, 0), timeout=20), torch.ones(2))
        finally:
            for transport in transports.values():
                transport.close()


def test_disagreeing_modes_are_named():
    results = _open_all(_store(), 2, "rdvmix", {0: "tcp", 1: "auto"})
    assert isinstance(results[0], ValueError)
    assert "rank 0 uses tcp, rank 1: auto" in str(results[0])
    assert "rank 1 uses auto, rank 0: tcp" in str(results[1])


def test_a_missing_peer_times_out_clearly():
    store = _store()
    with pytest.raises(TimeoutError, match=r"peers \[1\] of rank 0 did not appear .* within 1 s"):
        open_transport(store, 0, 2, "rdvlonely", [1], mode="tcp", timeout_s=1)
