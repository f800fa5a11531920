"""Run Megatron-Core code that names ``device="cuda"`` on a CPU-only machine.

``forward_backward_no_pipelining`` (Megatron's schedule for P == 1, our loss reference) allocates its
token counter with ``torch.zeros(..., device="cuda")``. Instead of forking Megatron, the call runs
under a TorchFunctionMode that sends explicit CUDA device arguments to the CPU.
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

from megatron_app.devices import is_cuda


class CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites ``device=cuda`` keyword arguments of torch functions to ``cpu``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def keep_rotary_on_cpu(chunk) -> None:
    """Megatron's RotaryEmbedding moves its frequencies to ``torch.cuda.current_device()`` at its first forward
    (a CPU-only torch raises there); a chunk on the CPU keeps them on the CPU: during that call the current device
    reads as the CPU. No-op for a chunk without rotary embeddings."""
    rotary = getattr(chunk, "rotary_pos_emb", None)
    if rotary is None:
        return
    import torch

    megatron_get_emb = rotary.get_emb

    def get_emb_on_cpu(*args, **kwargs):
        current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"
        try:
            return megatron_get_emb(*args, **kwargs)
        finally:
            torch.cuda.current_device = current_device

    rotary.get_emb = get_emb_on_cpu
