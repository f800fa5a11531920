"""Where tensors live: every decision about the device once a run has one, in one module.

Three questions, each answered once: which device this process computes on (its local rank's GPU, or the CPU),
where a model's tensors are (its parameters'), and where a small collective's tensor must be (NCCL takes CUDA
tensors only; gloo takes CPU ones). Which device a run asked for (``--device auto|cpu|cuda``) is device_choice's,
which needs no torch. Outside the package's layers (it imports torch only), so the trainer, the runtime and the
emulation read the same rules.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from megatron_app.device_choice import CPU, CUDA


def local_device(device_type: str, environ: Optional[Mapping[str, str]] = None) -> torch.device:
    """This process's device: on CUDA, its local rank's GPU (ranks share GPUs round-robin when there are more)."""
    if device_type != CUDA:
        return torch.device(CPU)
    environ = os.environ if environ is None else environ
    return torch.device(CUDA, int(environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model chunk's tensors live: its parameters' device (the data and the pipeline tensors follow it)."""
    return next(model.parameters()).device


def collective_device(group=None) -> torch.device:
    """The current CUDA device when ``group`` (the default group for None) runs on NCCL, which takes CUDA tensors
    only; the CPU otherwise (gloo takes CPU tensors whatever device the model is on, with no copy)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device(CUDA, torch.cuda.current_device())
    return torch.device(CPU)


def is_cuda(where) -> bool:
    """A tensor, a torch.device or a device string (``cuda``, ``cuda:1``) on CUDA."""
    if isinstance(where, torch.Tensor):
        return where.is_cuda
    if isinstance(where, torch.device):
        return where.type == CUDA
    if isinstance(where, str):
        return where.split(":", 1)[0] == CUDA
    return False
