"""What a tensor becomes before its bytes are sent: the one set of checks for the host and the device paths."""

import torch

from .dtypes import dtype_code


def prepare(tensor) -> torch.Tensor:
    """Dense, detached, conj/neg resolved, contiguous, of a dtype the wire carries: what codec.encode and the device
    stager send."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"can only send torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise ValueError(f"can only send dense tensors, got layout {tensor.layout}")
    dtype_code(tensor.dtype)  # ValueError for dtypes the wire cannot carry
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor
