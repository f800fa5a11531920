"""transport/ipc_probe.py: ranks of one host that asked for CUDA IPC try it once as their transports open, and a
rank sends by IPC only to the peers that read its bytes. Here with a stand-in for the CUDA calls, ranks as threads on
one store; tests/test_transport_cuda.py runs the real one between two processes on a GPU."""

import threading

import pytest
import torch
import torch.distributed as dist

from megatron_app.transport.ipc_probe import PROBE_BYTES, probe_ipc, probe_pattern, probe_peers

HOST_A, HOST_B = "a/boot/1", "b/boot/1"


class StandInDevice:
    """One rank's CUDA calls: a 'device buffer' is a host tensor in a registry every rank of the test shares."""

    def __init__(self, registry: dict, reads_fail=False, export_fails=False, reads_garbage=False):
        self.registry, self.reads_fail, self.export_fails, self.reads_garbage = (registry, reads_fail, export_fails,
                                                                                 reads_garbage)
        self.reads, self.forgotten = [], []

    def buffer_holding(self, data):
        return data.clone()

    def export(self, buffer):
        if self.export_fails:
            raise RuntimeError("cudaIpcGetMemHandle failed\nsecond line")
        blob = f"handle-{len(self.registry)}".encode()
        self.registry[blob] = buffer
        return blob

    def read(self, blob, nbytes):
        self.reads.append(blob)
        if self.reads_fail:
            raise RuntimeError("CUDA error: invalid device context")
        return torch.zeros(nbytes, dtype=torch.uint8) if self.reads_garbage else self.registry[blob][:nbytes].clone()

    def forget(self, blob):
        self.forgotten.append(blob)


def run_ranks(devices: dict, known_off=None, timeout_s=20.0) -> dict:
    """Each rank of `devices` probes its peers (all on one host) in a thread; {rank: its result}."""
    store = dist.HashStore()
    ranks = sorted(devices)
    results, errors = {}, []

    def one(rank):
        try:
            results[rank] = probe_ipc(store, "job/1", rank, [peer for peer in ranks if peer != rank],
                                      (known_off or {}).get(rank, {}), timeout_s, devices[rank])
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return results


def test_peers_that_read_every_pattern_all_keep_ipc():
    registry = {}
    devices = {rank: StandInDevice(registry) for rank in range(3)}
    assert run_ranks(devices) == {0: {}, 1: {}, 2: {}}
    assert all(len(device.reads) == 2 and len(device.forgotten) == 1 for device in devices.values())


def test_a_rank_that_cannot_map_its_peers_memory_gets_nothing_by_ipc_and_says_why():
    """Rank 2 cannot open what ranks 0 and 1 export (a GPU hidden from it, say): they stage what they send it; it
    still sends to them by IPC (they read its bytes)."""
    registry = {}
    devices = {0: StandInDevice(registry), 1: StandInDevice(registry), 2: StandInDevice(registry, reads_fail=True)}
    results = run_ranks(devices)
    assert results[2] == {}
    for rank in (0, 1):
        assert results[rank] == {2: f"rank 2 could not read rank {rank}'s device memory by CUDA IPC "
                                    "(RuntimeError: CUDA error: invalid device context)"}


def test_an_export_that_fails_or_bytes_that_differ_turn_ipc_off_towards_that_rank():
    registry = {}
    devices = {0: StandInDevice(registry, export_fails=True), 1: StandInDevice(registry)}
    results = run_ranks(devices)
    assert results == {0: {1: "rank 1 could not read rank 0's device memory by CUDA IPC (rank 0 could not export "
                              "device memory: RuntimeError: cudaIpcGetMemHandle failed)"}, 1: {}}
    assert devices[1].reads == [] and devices[0].forgotten == []   # nothing to read, nothing exported
    devices = {0: StandInDevice(registry), 1: StandInDevice(registry, reads_garbage=True)}
    assert run_ranks(devices)[0] == {1: "rank 1 could not read rank 0's device memory by CUDA IPC (its buffer read "
                                        "back other bytes than it wrote)"}


def test_a_link_known_to_be_off_is_not_opened_and_keeps_its_reason():
    registry = {}
    devices = {rank: StandInDevice(registry) for rank in range(2)}
    why = "rank 0 runs in another PID namespace than rank 1"
    results = run_ranks(devices, known_off={0: {1: why}, 1: {0: why}})
    assert devices[0].reads == devices[1].reads == []
    assert results[0] == {1: f"rank 1 could not read rank 0's device memory by CUDA IPC ({why})"}


def test_a_peer_that_never_probes_is_a_timeout_not_a_hang():
    store = dist.HashStore()
    with pytest.raises(TimeoutError, match=r"IPC probes of peers \[1\] did not appear .* within 0.5 s"):
        probe_ipc(store, "job/1", 0, [1], {}, 0.5, StandInDevice({}))


def test_both_ends_of_a_link_agree_whether_to_probe():
    infos = {0: {"host": HOST_A, "ipc": True}, 1: {"host": HOST_A, "ipc": True}, 2: {"host": HOST_A, "ipc": False},
             3: {"host": HOST_B, "ipc": True}, 4: {"host": HOST_A}}
    assert probe_peers(0, infos) == [1] and probe_peers(1, infos) == [0]
    assert probe_peers(2, infos) == [] and probe_peers(3, infos) == [] and probe_peers(4, infos) == []
    for rank in infos:   # symmetric: a rank probes a peer exactly when the peer probes it
        assert all(rank in probe_peers(peer, infos) for peer in probe_peers(rank, infos))


def test_each_rank_writes_its_own_pattern():
    patterns = [probe_pattern(rank) for rank in range(4)]
    assert all(pattern.numel() == PROBE_BYTES and pattern.dtype == torch.uint8 for pattern in patterns)
    assert all(not torch.equal(patterns[a], patterns[b]) for a in range(4) for b in range(a + 1, 4))
