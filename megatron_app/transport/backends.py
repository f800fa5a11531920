"""The transport backend vocabulary, read from the compiled core's own registry (csrc backend_registry.cpp): every
backend's name, what it carries and its priority for the automatic choice.

Adding a backend: its C++ class behind csrc's Backend interface and one line in backend_registry.cpp; this table,
the automatic choice (backend_choice.py), flag choices and the tools follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from ._core import core

AUTO = "auto"   # a mode, not a backend: per link, the usable backend with the highest auto_priority


@dataclass(frozen=True)
class BackendInfo:
    remote: bool          # carries links between hosts (needs an address exchange at start-up); else same host only
    needs_device: bool    # serves a link only where both ends have a usable device
    auto_priority: int    # the automatic choice takes the usable backend with the highest
    summary: str

    def serves(self, same_host: bool, both_have_devices: bool) -> bool:
        return (same_host or self.remote) and (both_have_devices or not self.needs_device)


BACKENDS: Dict[str, BackendInfo] = {
    row["name"]: BackendInfo(remote=row["remote"], needs_device=row["needs_device"],
                             auto_priority=row["auto_priority"], summary=row["summary"])
    for row in core.BACKEND_KINDS
}
SHM, TCP, RDMA = "shm", "tcp", "rdma"   # the names code refers to (checked against the core's list by the tests)
BACKEND_NAMES: Tuple[str, ...] = tuple(BACKENDS)
REMOTE_BACKENDS: Tuple[str, ...] = tuple(name for name, info in BACKENDS.items() if info.remote)
MODES: Tuple[str, ...] = (AUTO,) + BACKEND_NAMES
BY_PRIORITY: Tuple[str, ...] = tuple(sorted(BACKENDS, key=lambda name: -BACKENDS[name].auto_priority))
