"""Whether CUDA IPC really works between two ranks of one host, tried once as their transports open.

What the rendezvous knows beforehand (another PID namespace, two GPUs without peer access) rules some links out;
what it cannot know is whether a receiver can map a peer's memory at all: a GPU hidden from it by
CUDA_VISIBLE_DEVICES (one GPU a task under SLURM), a driver or container that refuses. Before the probe such a
receiver ended the run at its first IPC message. Now each rank that asked for IPC exports a small device buffer
holding its own byte pattern, opens each same-host peer's, reads the bytes back and publishes what failed; a rank
sends by IPC only to the peers that read its pattern, and the others get the staged path, said once with the reason.

Both ends of a link take part or neither (the decision reads only what both published: same host, both asked for
IPC with CUDA in use), so no rank waits for a peer that skipped it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import torch

from .store_keys import read_json, wait_for_keys

PROBE_BYTES = 4096


def probe_pattern(rank: int) -> torch.Tensor:
    """The bytes rank `rank` exports: distinct for each rank, so that reading another buffer is caught too."""
    return ((torch.arange(PROBE_BYTES, dtype=torch.int64) * 7 + rank * 31 + 1) % 256).to(torch.uint8)


class CudaProbeDevice:
    """The CUDA calls of a probe (device_engine's IPC functions); tests pass a stand-in."""

    @staticmethod
    def buffer_holding(data: torch.Tensor) -> torch.Tensor:
        """A buffer allocated as device_ipc allocates its ring slots (1 MiB at least: the allocator's large pool),
        `data` at its start."""
        from .device_engine import CudaCopyEngine
        from .device_ipc import MIN_SLOT_BYTES

        buffer = CudaCopyEngine.ipc_buffer(max(MIN_SLOT_BYTES, data.numel()), torch.cuda.current_device())
        buffer[:data.numel()].copy_(data)
        torch.cuda.current_stream().synchronize()   # the peer reads it from its own process, unordered with ours
        return buffer

    @staticmethod
    def export(buffer: torch.Tensor) -> bytes:
        from .device_engine import _export_buffer

        return _export_buffer(buffer)

    @staticmethod
    def read(blob: bytes, nbytes: int) -> torch.Tensor:
        from .device_engine import _open_buffer

        return _open_buffer(blob)[:nbytes].cpu()

    @staticmethod
    def forget(blob: bytes) -> None:
        from .device_engine import _forget_export

        _forget_export(blob)


def probe_peers(my_rank: int, infos: Mapping[int, dict]) -> list[int]:
    """The peers this rank probes with: same host, and both ranks asked for IPC with CUDA in use ("ipc" in their
    published entries). Each end computes the same answer from the same entries."""
    mine = infos[my_rank]
    return sorted(peer for peer, info in infos.items()
                  if peer != my_rank and info["host"] == mine["host"] and info.get("ipc") and mine.get("ipc"))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def probe_ipc(store, prefix: str, rank: int, peers: Iterable[int], known_off: Mapping[int, str], timeout_s: float,
              device=None) -> dict[int, str]:
    """{peer: why} for the `peers` (probe_peers) that could not read this rank's pattern by CUDA IPC. Peers in
    `known_off` are not opened (their reason stands) but take part in the exchange."""
    peers = sorted(peers)
    if not peers:
        return {}
    device = device or CudaProbeDevice()
    buffer, blob, entry = None, None, {}
    try:
        buffer = device.buffer_holding(probe_pattern(rank))
        blob = device.export(buffer)
        entry["blob"] = blob.hex()
    except Exception as error:  # noqa: BLE001 - whatever fails, no peer can read us: they say why
        entry["error"] = f"rank {rank} could not export device memory: {_first_line(error)}"
    try:
        store.set(f"{prefix}/ipc_probe/{rank}", json.dumps(entry))
        wait_for_keys(store, [f"{prefix}/ipc_probe/{peer}" for peer in peers], timeout_s,
                      f"IPC probes of peers {peers}")
        failed = {}
        for peer in peers:
            theirs = read_json(store, f"{prefix}/ipc_probe/{peer}")
            if peer in known_off:
                failed[peer] = known_off[peer]
            elif "error" in theirs:
                failed[peer] = theirs["error"]
            else:
                failed[peer] = _read_failure(device, bytes.fromhex(theirs["blob"]), peer)
        store.set(f"{prefix}/ipc_probed/{rank}", json.dumps({str(peer): why for peer, why in failed.items()}))
        wait_for_keys(store, [f"{prefix}/ipc_probed/{peer}" for peer in peers], timeout_s,
                      f"IPC probe results of {peers}")
        off = {}
        for peer in peers:
            why = read_json(store, f"{prefix}/ipc_probed/{peer}").get(str(rank), "")
            if why:
                off[peer] = f"rank {peer} could not read rank {rank}'s device memory by CUDA IPC ({why})"
        return off
    finally:   # every peer has read (or failed to read) the buffer once its results are in
        if blob is not None:
            device.forget(blob)
        del buffer


def _read_failure(device, blob: bytes, peer: int) -> str:
    """'' when the peer's exported buffer reads back as its pattern, else why not."""
    try:
        got = device.read(blob, PROBE_BYTES)
    except Exception as error:  # noqa: BLE001 - any failure to map or read: no IPC from this peer
        return _first_line(error)
    if not torch.equal(got, probe_pattern(peer)):
        return "its buffer read back other bytes than it wrote"
    return ""
