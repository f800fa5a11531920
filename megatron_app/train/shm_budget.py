"""Before start-up: how much of /dev/shm this host's ranks will reserve, against what is free there.

Each rank that has pipeline peers on its own host owns one receive segment: a ring per such peer, the transport's
`num_slots` slots in all (at least 2 per ring) of `slot_bytes` each, plus a page or two of control data. The pages
are reserved up front (posix_fallocate), so a /dev/shm that is too small fails at start-up; checked here first, it
fails with the number instead of inside every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
PAGE = 4096
_CONTROL_BYTES_PER_SLOT = 256  # chunk header and ring control, rounded up (shm_layout.h)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def segment_bytes(rings: int, slot_bytes: int, num_slots: int) -> int:
    if rings < 1:
        return 0
    slots = rings * max(2, num_slots // rings)
    control = _round_up(PAGE + slots * _CONTROL_BYTES_PER_SLOT + rings * _CONTROL_BYTES_PER_SLOT, PAGE)
    return control + slots * _round_up(slot_bytes, PAGE)


def local_ring_counts(pipeline_parallel: int, tensor_parallel: int, data_parallel: int, ranks_per_node: int,
                      node_rank: int) -> list[int]:
    """Shared-memory peers of each rank on this node: the other stages of its pipeline that run here.

    Megatron's rank order puts tensor parallel fastest, then data parallel, then pipeline, and torchrun gives node k
    the global ranks k*ranks_per_node .. (k+1)*ranks_per_node - 1.
    """
    stride = tensor_parallel * data_parallel
    here = range(node_rank * ranks_per_node, (node_rank + 1) * ranks_per_node)
    counts = []
    for rank in here:
        stage = rank // stride
        peers = [rank + (other - stage) * stride for other in range(pipeline_parallel) if other != stage]
        counts.append(sum(1 for peer in peers if peer in here))
    return counts


@dataclass(frozen=True)
class ShmEstimate:
    needed: int
    ranks: int  # ranks on this node that own a segment
    per_rank: int

    def shortfall(self, free: int, total: int) -> str | None:
        """None when `free` bytes are enough, else the one-line reason."""
        if self.needed <= free:
            return None
        return (f"this job needs about {_mib(self.needed)} of shared memory in {SHM_DIR} ({self.ranks} rank(s) on "
                f"this host, up to {_mib(self.per_rank)} of receive rings each) but only {_mib(free)} is free there "
                f"(size {_mib(total)}); make {SHM_DIR} larger (docker run --shm-size=1g, or mount -o remount,size=1G "
                f"{SHM_DIR}) or run fewer ranks per host")


def estimate(pipeline_parallel: int, tensor_parallel: int, data_parallel: int, ranks_per_node: int,
             node_rank: int = 0, sizes: tuple[int, int] | None = None) -> ShmEstimate:
    from megatron_app.transport.slot_geometry import default_slot_geometry   # the runtime's transport opens with these

    slot_bytes, num_slots = sizes or default_slot_geometry()
    per_rank = [segment_bytes(rings, slot_bytes, num_slots) for rings in
                local_ring_counts(pipeline_parallel, tensor_parallel, data_parallel, ranks_per_node, node_rank)]
    owners = [size for size in per_rank if size]
    return ShmEstimate(sum(owners), len(owners), max(owners, default=0))


def free_and_total(path: str = SHM_DIR) -> tuple[int, int] | None:
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"
