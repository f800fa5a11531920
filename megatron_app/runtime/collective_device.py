"""Where a small collective's tensor must live: the one rule for every agreement, flag and clock exchange."""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """The current CUDA device when ``group`` (the default group for None) runs on NCCL, which takes CUDA tensors
    only; the CPU otherwise (gloo takes CPU tensors whatever device the model is on, with no copy)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
