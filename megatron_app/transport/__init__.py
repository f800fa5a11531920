"""Tensor transport between pipeline ranks: shared memory within a host, TCP or RDMA between hosts.

Public API:
    Transport(rank, world_size, job_id, *, slot_bytes, num_slots, max_message_bytes, send_workers, peers, timeout_s)
        .send(peer, tag, tensor) -> SendHandle      .wait_sends(timeout=None)
        .poll() -> [(peer, tag)]                     .try_recv(peer, tag, dtype=None, device=None)
        .recv(peer, tag, timeout=None, dtype=None, device=None)
        .wait_any(keys, timeout=None) -> (peer, tag) .close()  (also a context manager)
        backends={peer: "tcp"|"rdma"}, listen_host="127.0.0.1": links to other hosts (default: shm);
        .backend_of(peer), .local_address(backend), .set_peer_addresses({peer: "host:port"})
    open_transport(store, rank, world_size, job_id, peers, *, mode=None, master_addr=None, timeout_s, ...):
        chooses each link's backend and exchanges addresses through the torch.distributed store
    requested_mode(value=None) ($MEGATRON_APP_TRANSPORT: auto|shm|tcp|rdma), choose_backends(...), rdma_status()
    make_tag / split_tag / describe_tag / direction_code_of, Direction, cleanup_job(job_id)
    PipelineTransport (what the runtime needs), TransportWrapper (filter_arrival / send hooks for layers above)
    Transport.attach_loss_injector(loss_injection.LossInjector)   (loss_injection: the core's loss-model types)
    Errors: ValueError / TypeError (bad arguments; BackendUnavailable, a ValueError, for a forced backend that
    cannot serve a link), TransportTimeout (a TimeoutError), PeerDied and TransportClosed (RuntimeErrors).
"""

import importlib

from .backend_choice import TRANSPORT_ENV, BackendUnavailable, choose_backends, requested_mode

# The rest loads at first use (PEP 562): the compiled core and torch come with it. A launcher's --check-config reads
# the backend choice and the slot geometry only, and skips the 1.2 s (CPU) to 5 s (GPU host) torch import.
_LAZY = {
    "open_transport": ".rendezvous",
    "loss_injection": None,
    "PipelineTransport": ".protocol", "SendCompletion": ".protocol", "TransportWrapper": ".protocol",
    "Direction": ".tags", "describe_tag": ".tags", "direction_code_of": ".tags", "make_tag": ".tags",
    "split_tag": ".tags",
    "PeerDied": ".transport", "SendHandle": ".transport", "Transport": ".transport", "TransportClosed": ".transport",
    "TransportTimeout": ".transport", "cleanup_job": ".transport", "rdma_status": ".transport",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _LAZY[name]
    value = (importlib.import_module(f".{name}", __name__) if module is None
             else getattr(importlib.import_module(module, __name__), name))
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BackendUnavailable",
    "Direction",
    "PipelineTransport",
    "SendCompletion",
    "TransportWrapper",
    "direction_code_of",
    "loss_injection",
    "TRANSPORT_ENV",
    "PeerDied",
    "SendHandle",
    "Transport",
    "TransportClosed",
    "TransportTimeout",
    "choose_backends",
    "cleanup_job",
    "open_transport",
    "rdma_status",
    "requested_mode",
    "describe_tag",
    "make_tag",
    "split_tag",
]
