"""Existing research loss models as plug-ins: any object with send(tensor) -> mask, apply(tensor) -> tensor, or
__call__(tensor). The adapter picks the first of those the object has (in that order).

What a plug-in returns is read the same way for all three methods:
  - a bool tensor: a delivery mask (True = delivered); with as many entries as the tensor has elements it is
    per element, otherwise the tensor is cut into that many near-equal packets, one entry each;
  - a non-bool tensor of the input's shape: the received tensor itself (the plug-in did the damage);
  - any other non-bool 1-D tensor or sequence: a per-packet mask, non-zero = delivered.
"""

from __future__ import annotations

import importlib
from typing import Tuple

from .errors import LossConfigError

INTERFACES = ("send", "apply", "__call__")


def _interface_of(obj) -> str:
    for name in ("send", "apply"):
        if callable(getattr(obj, name, None)):
            return name
    if callable(obj) and not isinstance(obj, type):
        return "__call__"
    raise LossConfigError(
        f"loss model {type(obj).__name__} has none of send(tensor) -> mask, apply(tensor) -> tensor or "
        "__call__(tensor)")


class PluginLossModel:
    """Calls a plug-in on one tensor and says what came back: ('mask', bool tensor) or ('tensor', tensor)."""

    def __init__(self, obj):
        self.obj = obj
        self.interface = _interface_of(obj)
        self._method = obj if self.interface == "__call__" else getattr(obj, self.interface)

    def __call__(self, tensor) -> Tuple[str, object]:
        import torch

        result = self._method(tensor)
        if not isinstance(result, torch.Tensor):
            try:
                result = torch.as_tensor(result)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"loss model {type(self.obj).__name__}.{self.interface} returned "
                                f"{type(result).__name__}; expected a mask or a tensor") from None
        if result.dtype == torch.bool:
            return "mask", result.reshape(-1)
        if result.shape == tensor.shape:
            return "tensor", result
        if result.dim() == 1:
            return "mask", result != 0
        raise TypeError(f"loss model {type(self.obj).__name__}.{self.interface} returned a tensor of shape "
                        f"{tuple(result.shape)} for input {tuple(tensor.shape)}; expected a mask or the same shape")

    def __repr__(self) -> str:
        return f"PluginLossModel({type(self.obj).__name__}.{self.interface})"


def adapt(obj) -> PluginLossModel:
    """The adapter for `obj`; LossConfigError when it has none of the three methods."""
    return obj if isinstance(obj, PluginLossModel) else PluginLossModel(obj)


def load_plugin(path: str) -> PluginLossModel:
    """Import MOD.OBJ ('pkg.module.Name'); a class is instantiated without arguments. Errors are LossConfigError."""
    module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise LossConfigError(f"python loss model must be given as MODULE.OBJECT, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix; say which
        raise LossConfigError(f"cannot import loss model module {module_name!r}: {exc}") from None
    try:
        obj = getattr(module, attribute)
    except AttributeError:
        raise LossConfigError(f"module {module_name!r} has no loss model {attribute!r}") from None
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001
            raise LossConfigError(f"cannot create loss model {path}() without arguments: {exc}") from None
    return adapt(obj)
