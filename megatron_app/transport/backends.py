"""The transport backend vocabulary: every backend name, in one place (the compiled core accepts these names).

Adding a backend: its C++ class behind csrc's Backend interface, one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

SHM, TCP, RDMA = "shm", "tcp", "rdma"
AUTO = "auto"   # a mode, not a backend: shm on one host, else rdma where both ends have a device, else tcp


@dataclass(frozen=True)
class BackendInfo:
    remote: bool      # carries links between hosts (needs an address exchange at start-up)
    summary: str


BACKENDS: Dict[str, BackendInfo] = {
    SHM: BackendInfo(remote=False, summary="shared-memory rings between processes of one host"),
    TCP: BackendInfo(remote=True, summary="TCP sockets between hosts"),
    RDMA: BackendInfo(remote=True, summary="RDMA (ibverbs) between hosts with a usable device"),
}
BACKEND_NAMES: Tuple[str, ...] = tuple(BACKENDS)
REMOTE_BACKENDS: Tuple[str, ...] = tuple(name for name, info in BACKENDS.items() if info.remote)
MODES: Tuple[str, ...] = (AUTO,) + BACKEND_NAMES
