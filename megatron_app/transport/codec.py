"""Tensor <-> (dtype code, shape, bytes) for the core: one copy in on send, zero copies out on receive."""

import math

import torch

from .dtypes import CODE_TO_DTYPE, dtype_code, dtype_from_code
from .sendable import prepare


def encode(tensor) -> tuple:
    """(dtype_code, shape, data_ptr, nbytes, host_tensor): a host-contiguous view of `tensor` for the core.
    The core reads host_tensor's memory until the send completes. Transport.send hands CUDA tensors to the stager
    (device_staging.py); other callers get them staged here via pinned memory."""
    tensor = prepare(tensor)
    code = dtype_code(tensor.dtype)
    if tensor.is_cuda:
        tensor = _stage_on_host(tensor)
    elif not tensor.is_cpu:
        raise ValueError(f"cannot send a tensor on device {tensor.device}")
    nbytes = tensor.nbytes
    return code, tensor.shape, tensor.data_ptr() if nbytes else 0, nbytes, tensor


def _stage_on_host(tensor: torch.Tensor) -> torch.Tensor:
    staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    staged.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return staged


def decode(code: int, shape: tuple, nbytes: int, payload, device=None) -> torch.Tensor:
    """Rebuild a received tensor on top of the core's buffer (no copy), then move it to `device` if given."""
    dtype = CODE_TO_DTYPE.get(code) or dtype_from_code(code)
    # The shape comes from another process: check it against the bytes that arrived before anything is allocated.
    if any(extent < 0 for extent in shape) or math.prod(shape) * dtype.itemsize != nbytes:
        raise ValueError(f"received a malformed message: shape {tuple(shape)} of {dtype} does not describe its "
                         f"{nbytes} bytes")
    if nbytes == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.frombuffer(payload, dtype=dtype)
        if len(shape) != 1:  # 1-D: frombuffer's shape already is the message's
            tensor = tensor.view(*shape) if shape else tensor.view(())  # view() checks the element count
    if device is not None:
        tensor = to_device(tensor, device)
    return tensor


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A received host tensor moved to `device`: CUDA through page-locked chunks (device_engine), else .to()."""
    device = torch.device(device)
    if device.type == "cuda":
        from .device_engine import CudaCopyEngine  # the CUDA lines
        return CudaCopyEngine.to_device(host, device)
    return host.to(device)
