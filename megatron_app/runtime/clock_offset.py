"""Align each rank's monotonic clock to rank 0's with an NTP-style ping-pong over torch.distributed."""

from __future__ import annotations

import time


def boot_id() -> str:
    """The kernel's boot id: processes that share it read one CLOCK_MONOTONIC (network namespaces included)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as source:
            return source.read().strip()
    except OSError:
        return ""


def measure_clock_offset(group=None, rounds: int = 8, trust_shared_clock: bool = False) -> float:
    """Return the offset in microseconds to ADD to this rank's monotonic clock to read rank 0's clock.

    Collective over `group` (default: the world): the group's first rank answers `rounds` pings from every other
    rank in turn; each rank keeps the sample with the smallest round trip (least queueing) and assumes the reply
    was stamped half-way through it. Error is at most half that round trip. The root returns 0.0.
    trust_shared_clock: ranks booted in the same kernel as the root read the very same clock, so they take 0.0
    exactly instead of an estimate whose error (half a round trip on a loaded machine: tens of microseconds or
    more) would exceed the gap between a send and its receipt through shared memory.
    Works over gloo across hosts; with NCCL the ping tensors live on the current CUDA device.
    """
    import torch
    import torch.distributed as dist

    from megatron_app.devices import collective_device

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not dist.is_initialized():
        raise RuntimeError("measure_clock_offset needs torch.distributed to be initialized")
    me = dist.get_rank()
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    root = members[0]
    if me not in members:
        raise ValueError(f"rank {me} is not a member of the given group")
    device = collective_device(group)
    stamp = torch.zeros(1, dtype=torch.int64, device=device)  # nanoseconds: exact in int64

    measured = members[1:]
    if trust_shared_clock:
        boots = [None] * len(members)
        dist.all_gather_object(boots, boot_id(), group=group)
        root_boot = boots[0]
        measured = [rank for rank, boot in zip(members[1:], boots[1:]) if not boot or boot != root_boot]
        if me != root and me not in measured:
            return 0.0

    if me == root:
        for peer in measured:
            for _ in range(rounds):
                dist.recv(stamp, src=peer, group=group)
                stamp.fill_(time.monotonic_ns())
                dist.send(stamp, dst=peer, group=group)
        return 0.0

    best_rtt_ns = None
    best_offset_ns = 0.0
    for _ in range(rounds):
        sent_ns = time.monotonic_ns()
        stamp.fill_(sent_ns)
        dist.send(stamp, dst=root, group=group)
        dist.recv(stamp, src=root, group=group)
        received_ns = time.monotonic_ns()
        rtt_ns = received_ns - sent_ns
        if best_rtt_ns is None or rtt_ns < best_rtt_ns:
            best_rtt_ns = rtt_ns
            best_offset_ns = int(stamp.item()) - (sent_ns + received_ns) / 2
    return best_offset_ns / 1e3
