"""Which backend carries each link: per link, the usable backend with the highest automatic-choice priority in the
compiled core's registry (today: shm to a peer on the same host, rdma when both ends have a usable device, else
tcp). MEGATRON_APP_TRANSPORT (or a launcher's --transport) forces one: shm | tcp | rdma | auto (the default).

"Same host" means same machine *and* same network namespace: two pods (or the test's namespaces) on one machine
are separate hosts, since their /dev/shm and addresses may differ.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping

from .backends import AUTO, BACKENDS, BY_PRIORITY, MODES

TRANSPORT_ENV = "MEGATRON_APP_TRANSPORT"
HOST_ADDRESS_ENV = "MEGATRON_APP_HOST_ADDRESS"


class BackendUnavailable(ValueError):
    """A forced backend cannot serve a link (shm across hosts, rdma without a usable device): a user setting to
    change, reported in one line by the launchers."""


def requested_mode(value: str | None = None) -> str:
    """The forced backend: `value`, else $MEGATRON_APP_TRANSPORT, else auto. ValueError for an unknown name."""
    mode = (value if value is not None else os.environ.get(TRANSPORT_ENV, "")).strip().lower() or AUTO
    if mode not in MODES:
        raise ValueError(f"{TRANSPORT_ENV}={mode!r} is not a transport; choose one of {', '.join(MODES)}")
    return mode


def host_identity() -> str:
    """Equal for two processes exactly when they share a machine and a network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = "?"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{boot_id}/{netns}"


def pid_namespace() -> int:
    """This process's PID namespace (0 where /proc cannot say): CUDA IPC opens a peer's memory by its process id, so
    two ranks of one host in different PID namespaces (containers without a shared one) cannot use it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def gpu_identity() -> str | None:
    """The UUID of this process's current CUDA device, None where CUDA is not in use yet (a CPU rank: the transport
    never initialises CUDA for this)."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def cuda_peer_access(mine: str, theirs: str) -> bool | None:
    """Whether this process's view of the GPUs says device `mine` can map memory of device `theirs` (by UUID): None
    when one of them is not visible here (CUDA may still open it: tried)."""
    import torch

    visible = {str(torch.cuda.get_device_properties(index).uuid): index for index in range(torch.cuda.device_count())}
    if mine not in visible or theirs not in visible:
        return None
    return bool(torch.cuda.can_device_access_peer(visible[mine], visible[theirs]))


def ipc_impossible(my_rank: int, peers: Iterable[int], hosts: Mapping[int, str], pid_namespaces: Mapping[int, int],
                   gpus: Mapping[int, str | None] | None = None, peer_access=cuda_peer_access) -> dict[int, str]:
    """{peer: why} for the same-host peers CUDA IPC cannot serve: another PID namespace (0: unknown, not refused), or
    another GPU that this one has no peer access to (gpus: each rank's gpu_identity; unknown: tried)."""
    gpus = gpus or {}
    mine, my_gpu = pid_namespaces.get(my_rank, 0), gpus.get(my_rank)
    impossible = {}
    for peer in peers:
        if hosts[peer] != hosts[my_rank]:
            continue
        if mine and pid_namespaces.get(peer, 0) and pid_namespaces[peer] != mine:
            impossible[peer] = (f"rank {peer} runs in another PID namespace than rank {my_rank} (CUDA IPC opens a "
                                "peer's memory by its process id; share one, e.g. docker --pid=host)")
        elif my_gpu and gpus.get(peer) and gpus[peer] != my_gpu and peer_access(my_gpu, gpus[peer]) is False:
            impossible[peer] = (f"rank {peer}'s GPU ({gpus[peer]}) has no peer access to rank {my_rank}'s "
                                f"({my_gpu})")
    return impossible


def advertised_address(master_addr: str | None) -> str:
    """The address peers should use to reach this process: $MEGATRON_APP_HOST_ADDRESS, else the local address of
    the interface that routes to the master (no packet is sent), else the loopback address."""
    explicit = os.environ.get(HOST_ADDRESS_ENV)
    if explicit:
        return explicit
    if master_addr:
        try:
            infos = socket.getaddrinfo(master_addr, 1, type=socket.SOCK_DGRAM)
            family, _, _, _, target = infos[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(target)
                return probe.getsockname()[0]
        except OSError:
            pass
    return "127.0.0.1"


def choose_backends(my_rank: int, peers: Iterable[int], hosts: Mapping[int, str], rdma_usable: Mapping[int, bool],
                    mode: str) -> dict[int, str]:
    """{peer: 'shm'|'tcp'|'rdma'}. Both ends of a link compute the same answer from the same inputs.
    BackendUnavailable (a ValueError) when a forced backend cannot serve a link (shm across hosts, rdma without a
    device)."""
    mode = requested_mode(mode)
    chosen = {}
    for peer in peers:
        same_host = hosts[peer] == hosts[my_rank]
        both_devices = bool(rdma_usable.get(peer)) and bool(rdma_usable.get(my_rank))
        if mode == AUTO:
            chosen[peer] = next(name for name in BY_PRIORITY if BACKENDS[name].serves(same_host, both_devices))
            continue
        info = BACKENDS[mode]
        if not (same_host or info.remote):
            raise BackendUnavailable(f"{TRANSPORT_ENV}={mode} but rank {peer} runs on another host ({hosts[peer]}) "
                                     f"than rank {my_rank} ({hosts[my_rank]}); use tcp or auto")
        if info.needs_device and not both_devices:
            without = [rank for rank in (my_rank, peer) if not rdma_usable.get(rank)]
            raise BackendUnavailable(f"{TRANSPORT_ENV}={mode} but rank(s) {without} have no usable RDMA device "
                                     "(see tools/rdma_check.py); use tcp or auto")
        chosen[peer] = mode
    return chosen
