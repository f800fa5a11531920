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
