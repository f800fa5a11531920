"""Megatron's DDP on a gloo group with CUDA gradients, which ranks sharing one GPU need.

NCCL refuses two ranks on one device, so ranks that share a GPU (P=2 on one card) use gloo, whose single
collectives take CUDA tensors. Megatron's DDP reduces each bucket group inside torch's `_coalescing_manager`, which
on gloo ends in one coalesced all-reduce, and torch's gloo has that for CPU tensors only ("ProcessGroupGloo::
allreduce_coalesced: unsupported device type cuda", seen on an H100 with megatron-core 0.19.2 and torch 2.11).

`reduce_ddp_buckets_one_by_one_on_gloo()` gives Megatron's DDP a coalescing manager that, on gloo groups, issues
the all-reduces it collected one bucket at a time (async ones handed to the manager's wait, as torch's are); other
backends keep torch's manager. It uses torch's own capture of collectives in a coalescing block
(`distributed_c10d._world.pg_coalesce_state`, private: checked when installed).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist


def _torch_capture():
    """torch's private pieces the manager relies on, or a RuntimeError naming what this torch lacks."""
    from torch.distributed import distributed_c10d as c10d

    missing = [name for name in ("_world", "_CoalescingManager", "_CollOp") if not hasattr(c10d, name)]
    if not missing and not hasattr(c10d._world, "pg_coalesce_state"):
        missing.append("_world.pg_coalesce_state")
    if missing:
        raise RuntimeError(f"this torch's distributed_c10d has no {', '.join(missing)}: Megatron's DDP cannot be "
                           "made to reduce CUDA gradients through gloo (use one GPU per rank, with NCCL)")
    return c10d


def one_by_one_on_gloo(torch_manager):
    """A drop-in for torch's `_coalescing_manager` that runs `torch_manager` on every backend but gloo."""
    c10d = _torch_capture()

    @contextlib.contextmanager
    def coalescing(group=None, device=None, async_ops=False):
        group = group if group is not None else c10d._get_default_group()
        if dist.get_backend(group) != "gloo":
            with torch_manager(group, device, async_ops) as manager:
                yield manager
            return
        state = c10d._world.pg_coalesce_state
        if state.get(group):
            raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
        state[group] = []   # torch's collectives now record themselves here instead of running
        manager = c10d._CoalescingManager()
        try:
            yield manager
        finally:
            captured = state.pop(group, [])
        for op in captured:
            if op.op is not dist.all_reduce:
                raise RuntimeError(f"a coalesced {op.op.__name__} on a gloo group: only all-reduces are issued one "
                                   "by one (Megatron's DDP without the distributed optimizer)")
            work = dist.all_reduce(op.tensor, op=op.redop, group=group, async_op=async_ops)
            if async_ops:
                manager.append(work)

    coalescing.one_by_one_on_gloo = True
    return coalescing


def reduce_ddp_buckets_one_by_one_on_gloo() -> None:
    """Makes Megatron's DDP reduce its buckets one all-reduce each on gloo groups (CUDA gradients included); NCCL
    groups are untouched. Idempotent; call it before the first backward."""
    from megatron.core.distributed import param_and_grad_buffer

    current = param_and_grad_buffer._coalescing_manager
    if not getattr(current, "one_by_one_on_gloo", False):
        param_and_grad_buffer._coalescing_manager = one_by_one_on_gloo(current)
