"""Opening a rank's Transport in a multi-host job: every rank publishes its host identity, RDMA capability and
requested mode through the torch.distributed store (a c10d Store: set/get/wait/add), each link's backend is chosen
from both ends' entries, and ranks with remote links publish the address they listen on. Nothing is configured by
hand: the store is the job's own (torchrun's TCPStore).

The store also carries the job's admission secret: drawn once per round by the first rank to get there (rank 0
when it opens first; compare_set makes the first draw win), it is what a connection to a rank's listener must
prove (an HMAC of a fresh challenge; the secret itself never goes on the transport's sockets).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable

from ._core import core
from .backends import BACKENDS, RDMA
from .backend_choice import (BackendUnavailable, advertised_address, choose_backends, gpu_identity, host_identity,
                             ipc_impossible, pid_namespace, requested_mode)
from .device_ipc import ipc_requested
from .ipc_probe import probe_ipc, probe_peers
from .store_keys import read_json, wait_for_keys
from .transport import Transport

KEY_PREFIX = "megatron_app/link"
ADMISSION_SECRET_BYTES = 32  # as long as the HMAC-SHA256 it keys


def job_admission_secret(store, prefix: str) -> bytes:
    """The round's secret: the first rank's draw, the same bytes for every rank."""
    key = f"{prefix}/admission_secret"
    drawn = secrets.token_hex(ADMISSION_SECRET_BYTES)
    return bytes.fromhex(store.compare_set(key, "", drawn).decode())


def open_transport(store, rank: int, world_size: int, job_id: str, peers: Iterable[int], *,
                   mode: str | None = None, master_addr: str | None = None, timeout_s: float = 300.0,
                   **transport_options) -> Transport:
    """A Transport for `rank` whose links to `peers` use the backend chosen per link (see backend_choice).
    Every rank of the job that has peers must call this (it waits for its peers' entries). Errors: ValueError
    for a mode that cannot serve a link or disagreeing modes; TimeoutError when a peer never shows up."""
    peers = sorted(set(peers))
    mode = requested_mode(mode)
    # A job may open transports more than once (runtime shutdown and restart): each round gets its own keys.
    round_id = store.add(f"{KEY_PREFIX}/{job_id}/round/{rank}", 1)
    prefix = f"{KEY_PREFIX}/{job_id}/{round_id}"
    built, usable, rdma_detail = core.rdma_status()
    gpu = gpu_identity()
    # "ipc": this rank asked for CUDA IPC and uses CUDA: the peers that did too on this host probe it (ipc_probe.py)
    mine = {"host": host_identity(), "rdma": bool(built and usable), "mode": mode, "pid_ns": pid_namespace(),
            "gpu": gpu, "ipc": gpu is not None and ipc_requested(transport_options.get("cuda_ipc"))}
    store.set(f"{prefix}/info/{rank}", json.dumps(mine))
    wait_for_keys(store, [f"{prefix}/info/{peer}" for peer in peers], timeout_s, f"peers {peers} of rank {rank}")
    infos = {rank: mine} | {peer: read_json(store, f"{prefix}/info/{peer}") for peer in peers}
    disagreeing = sorted(peer for peer in peers if infos[peer]["mode"] != mode)
    if disagreeing:
        theirs = ", ".join(f"rank {peer}: {infos[peer]['mode']}" for peer in disagreeing)
        raise ValueError(f"ranks disagree on the transport: rank {rank} uses {mode}, {theirs} "
                         "(set MEGATRON_APP_TRANSPORT / --transport the same on every host)")
    try:
        backends = choose_backends(rank, peers, {r: info["host"] for r, info in infos.items()},
                                   {r: info["rdma"] for r, info in infos.items()}, mode)
    except BackendUnavailable as error:
        if mode == RDMA and not mine["rdma"]:  # say why this host has none
            raise BackendUnavailable(f"{error} [rank {rank}: {rdma_detail}]") from None
        raise
    remote = {peer: kind for peer, kind in backends.items() if BACKENDS[kind].remote}
    host = advertised_address(master_addr) if remote else "127.0.0.1"
    secret = job_admission_secret(store, prefix) if remote else b""
    ipc_off = ipc_impossible(rank, peers, {r: info["host"] for r, info in infos.items()},
                             {r: info.get("pid_ns", 0) for r, info in infos.items()},
                             {r: info.get("gpu") for r, info in infos.items()})
    for peer, why in probe_ipc(store, prefix, rank, probe_peers(rank, infos), ipc_off, timeout_s).items():
        ipc_off.setdefault(peer, why)   # a reason known beforehand says more than the probe's
    transport = Transport(rank, world_size, job_id, peers=peers, timeout_s=timeout_s, backends=remote,
                          listen_host=host, admission_secret=secret, ipc_off=ipc_off, **transport_options)
    try:
        if remote:
            kinds = sorted(set(remote.values()))
            store.set(f"{prefix}/addr/{rank}", json.dumps({kind: transport.local_address(kind) for kind in kinds}))
            wait_for_keys(store, [f"{prefix}/addr/{peer}" for peer in remote], timeout_s,
                          f"listening addresses of peers {sorted(remote)}")
            transport.set_peer_addresses({peer: read_json(store, f"{prefix}/addr/{peer}")[kind]
                                          for peer, kind in remote.items()})
    except BaseException:
        transport.close()
        raise
    return transport
