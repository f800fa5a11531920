"""The C++ loss channels applied to torch tensors (CPU in place; other devices through a CPU copy), and
`TensorLoss`: one stream of Python-side traffic with a built-in model or a plug-in."""

from __future__ import annotations

import functools
import warnings
from typing import Optional, Sequence

import torch

from megatron_app.transport import loss_injection
from megatron_app.transport.dtypes import DTYPE_TO_CODE

from .config import LossConfig
from .plugin import PluginLossModel

_FLOAT_KINDS = {
    torch.float16: loss_injection.ElementKind.FLOAT16,
    torch.bfloat16: loss_injection.ElementKind.BFLOAT16,
    torch.float32: loss_injection.ElementKind.FLOAT32,
    torch.float64: loss_injection.ElementKind.FLOAT64,
}


@functools.lru_cache(maxsize=None)
def element_of(dtype: torch.dtype):
    """(element size, ElementKind) of a dtype; only float kinds can be rescaled."""
    with warnings.catch_warnings():
        # Sizing torch.complex32 (in the wire table, never sent by us) makes torch warn "ComplexHalf support is
        # experimental" on every rank: not the user's concern.
        warnings.filterwarnings("ignore", message="ComplexHalf support is experimental", category=UserWarning)
        size = torch.empty((), dtype=dtype).element_size()
    return size, _FLOAT_KINDS.get(dtype, loss_injection.ElementKind.OPAQUE)


def element_table() -> dict:
    """dtype wire code -> (element size, element kind), for the transport's injector."""
    table = {}
    for dtype, code in DTYPE_TO_CODE.items():
        size, kind = element_of(dtype)
        table[code] = (size, int(kind))
    return table


def make_channel(config: LossConfig, stream: Sequence[int], rescale_rate: Optional[float] = None):
    """A core.LossChannel for one stream, seeded from (config.seed, stream)."""
    return loss_injection.LossChannel(config.core_spec(), fill=config.fill, packet_bytes=config.packet_bytes,
                            seed=config.seed, stream=[int(part) & ((1 << 64) - 1) for part in stream],
                            rescale_rate=rescale_rate)


def _host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor the channel may write: `tensor` itself when possible."""
    if tensor.is_cpu and tensor.is_contiguous():
        return tensor
    return tensor.detach().to("cpu", copy=True).contiguous()


class TensorLoss:
    """Loss on one stream of tensors. Built-in models run in C++; a plug-in decides, and C++ fills and counts.

    __call__(tensor, family) returns the received tensor. With inplace=True a contiguous CPU tensor is changed in
    place (the transport's own receive buffers); otherwise the input is never modified.
    """

    def __init__(self, config: LossConfig, stream: Sequence[int], plugin: Optional[PluginLossModel] = None):
        self.config = config
        self.plugin = plugin
        rescale_rate = config.loss_rate if plugin is not None else None
        self.channel = make_channel(config, stream, rescale_rate=rescale_rate)

    def __call__(self, tensor: torch.Tensor, family: int = 0, inplace: bool = False) -> torch.Tensor:
        if tensor.numel() == 0:
            return tensor
        if self.plugin is not None:
            return self._apply_plugin(tensor, family, inplace)
        host = _host_view(tensor) if inplace else tensor.detach().to("cpu", copy=True).contiguous()
        size, kind = element_of(host.dtype)
        self.channel.apply(host.data_ptr(), host.nbytes, size, int(kind), family)
        return host if host.device == tensor.device else host.to(tensor.device)

    def _apply_plugin(self, tensor: torch.Tensor, family: int, inplace: bool) -> torch.Tensor:
        what, result = self.plugin(tensor)
        if what == "tensor":
            self._record_changes(tensor, result)
            return result.to(device=tensor.device, dtype=tensor.dtype)
        keep = result.to(device="cpu", dtype=torch.uint8).contiguous()
        host = _host_view(tensor) if inplace else tensor.detach().to("cpu", copy=True).contiguous()
        size, kind = element_of(host.dtype)
        self.channel.apply_mask(host.data_ptr(), host.nbytes, size, int(kind), family, keep.data_ptr(), keep.numel())
        return host if host.device == tensor.device else host.to(tensor.device)

    def _record_changes(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """Counts packets (of config.packet_bytes) the plug-in changed as lost."""
        old = before.detach().reshape(-1).to("cpu")
        new = after.detach().reshape(-1).to(device="cpu", dtype=old.dtype)
        per_packet = max(1, self.config.packet_bytes // max(1, old.element_size()))
        changed = old.ne(new) & ~(old.isnan() & new.isnan()) if old.is_floating_point() else old.ne(new)
        padded = torch.nn.functional.pad(changed, (0, (-changed.numel()) % per_packet))
        keep = (~padded.view(-1, per_packet).any(dim=1)).to(torch.uint8).contiguous()
        self.channel.record_mask(keep.data_ptr(), keep.numel())

    def stats(self) -> dict:
        return self.channel.stats()
