"""Tensor transport between pipeline ranks: shared memory within a node (TCP and RDMA backends later).

Public API:
    Transport(rank, world_size, job_id, *, slot_bytes, num_slots, max_message_bytes, send_workers, peers, timeout_s)
        .send(peer, tag, tensor) -> SendHandle      .wait_sends(timeout=None)
        .poll() -> [(peer, tag)]                     .try_recv(peer, tag, dtype=None, device=None)
        .recv(peer, tag, timeout=None, dtype=None, device=None)
        .wait_any(keys, timeout=None) -> (peer, tag) .close()  (also a context manager)
    make_tag / split_tag / describe_tag, Direction, cleanup_job(job_id)
    Errors: ValueError / TypeError (bad arguments), TransportTimeout (a TimeoutError), PeerDied and
    TransportClosed (RuntimeErrors).
"""

from .tags import Direction, describe_tag, make_tag, split_tag
from .transport import PeerDied, SendHandle, Transport, TransportClosed, TransportTimeout, cleanup_job

__all__ = [
    "Direction",
    "PeerDied",
    "SendHandle",
    "Transport",
    "TransportClosed",
    "TransportTimeout",
    "cleanup_job",
    "describe_tag",
    "make_tag",
    "split_tag",
]
