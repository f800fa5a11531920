"""Loss on tensor-parallel traffic: LossyMegatronIntegration wraps megatron-core's tensor-parallel communication.

    with LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.01), forward=True, backward=False):
        ... train ...

What is wrapped: the public functions of megatron.core.tensor_parallel.mappings (copy_to / reduce_from / scatter_to /
gather_from tensor- and sequence-parallel regions, the last-dim all-gather / reduce-scatter) and layers.py's
linear_with_grad_accumulation_and_async_allreduce (its input-gradient all-reduce / reduce-scatter), in mappings and in
every loaded megatron module that imported them by name (layers.py, the package __init__, attention.py, ...).
disable() puts every one of those bindings back, the original objects themselves.

Semantics: the tensor a rank receives from a collective (all-reduce result, gathered tensor, reduce-scatter shard)
goes through the loss model before use, as a pipeline receive does. Forward loss changes the collective's output
(its gradient passes straight through, as the gradient of a received activation goes back over its own link);
backward loss changes the gradient the collective delivers. Calls on a group of one rank move nothing and lose
nothing. One stream per (collective, direction) per rank; stale fill reuses the last tensor of the same size that
collective delivered.
"""

from __future__ import annotations

import functools
import sys
import threading
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .config import LossConfig, LossConfigError, make_loss_config
from .plugin import PluginLossModel, adapt, load_plugin
from .stats import LinkLossStats, from_core
from .tensors import TensorLoss

# public mapping function -> (collective in forward, collective in backward); None: no communication
MAPPING_SITES: Dict[str, Tuple[Optional[str], Optional[str]]] = {
    "copy_to_tensor_model_parallel_region": (None, "all_reduce"),
    "reduce_from_tensor_model_parallel_region": ("all_reduce", None),
    "scatter_to_tensor_model_parallel_region": (None, "all_gather"),
    "gather_from_tensor_model_parallel_region": ("all_gather", None),
    "scatter_to_sequence_parallel_region": (None, "all_gather"),
    "gather_from_sequence_parallel_region": ("all_gather", "reduce_scatter"),
    "reduce_scatter_to_sequence_parallel_region": ("reduce_scatter", "all_gather"),
    "all_gather_last_dim_from_tensor_parallel_region": ("all_gather", "reduce_scatter"),
    "reduce_scatter_last_dim_to_tensor_parallel_region": ("reduce_scatter", "all_gather"),
}
LINEAR_SITE = "linear_with_grad_accumulation_and_async_allreduce"
_TP_SALT = 0x54500000  # keeps tensor-parallel streams apart from pipeline ones
_DIRECTIONS = {"forward": 1, "backward": 2}

_active_lock = threading.Lock()
_active: Optional["LossyMegatronIntegration"] = None


class _LossOnOutput(torch.autograd.Function):
    """Forward: the received tensor loses packets. Backward: the gradient passes straight through."""

    @staticmethod
    def forward(ctx, tensor, stream):
        return stream(tensor, family=tensor.numel())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _LossOnGradient(torch.autograd.Function):
    """Forward: identity. Backward: the gradient a collective delivered here loses packets."""

    @staticmethod
    def forward(ctx, tensor, stream):
        ctx.stream = stream
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return ctx.stream(grad.contiguous(), family=grad.numel()), None


def _group_size(group) -> int:
    if group is not None:
        return group.size()
    from megatron.core import parallel_state

    try:
        return parallel_state.get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):  # model parallel not initialised: nothing is communicated
        return 1


def _argument(args, kwargs, position: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


class LossyMegatronIntegration:
    """Applies a loss model to megatron-core's tensor-parallel traffic while enabled.

    loss_model: a LossConfig (built-in C++ models, or model="python"), or any plug-in object with send / apply /
    __call__. For a plug-in object, fill, packet_bytes, seed and loss_rate (the p of the rescale fill) may be given.
    forward / backward: which direction's traffic loses packets. rank: names this rank's streams (default: the
    torch.distributed rank).
    """

    def __init__(self, loss_model, *, forward: bool = True, backward: bool = True, fill: str = "zeros",
                 packet_bytes: int = 4096, seed: int = 0, loss_rate: Optional[float] = None,
                 rank: Optional[int] = None):
        plugin: Optional[PluginLossModel] = None
        if isinstance(loss_model, LossConfig):
            config = loss_model
            if config.model == "python":
                plugin = load_plugin(config.source)
            elif not config.enabled:
                raise LossConfigError("LossyMegatronIntegration needs a loss model (got model 'none')")
        else:
            plugin = adapt(loss_model)
            config = make_loss_config("none", fill=fill, packet_bytes=packet_bytes, seed=seed)
            if fill == "rescale" and loss_rate is None:
                raise LossConfigError("fill='rescale' with a plug-in needs loss_rate (the p of 1/(1-p))")
            config = config.replace(model="python", loss_rate=loss_rate, source=type(loss_model).__name__)
        if not (forward or backward):
            raise LossConfigError("LossyMegatronIntegration needs forward=True or backward=True")
        self.config = config
        self.forward = bool(forward)
        self.backward = bool(backward)
        self._plugin = plugin
        self._rank = rank
        self._streams: Dict[Tuple[str, str], TensorLoss] = {}
        self._bindings: List[Tuple[object, str, object]] = []  # (module, attribute, original)

    # -- switching ---------------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return bool(self._bindings)

    def enable(self) -> "LossyMegatronIntegration":
        global _active
        with _active_lock:
            if _active is self:
                return self
            if _active is not None:
                raise RuntimeError("another LossyMegatronIntegration is enabled; disable it first")
            if self._rank is None:
                self._rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self._patch()
            _active = self
        return self

    def disable(self) -> None:
        """Restore every patched binding to the original object. Idempotent."""
        global _active
        with _active_lock:
            for module, attribute, original in reversed(self._bindings):
                setattr(module, attribute, original)
            self._bindings = []
            if _active is self:
                _active = None

    def __enter__(self) -> "LossyMegatronIntegration":
        return self.enable()

    def __exit__(self, *exc_info) -> None:
        self.disable()

    def _patch(self) -> None:
        from megatron.core.tensor_parallel import layers, mappings

        replacements = {}
        for name, (forward_op, backward_op) in MAPPING_SITES.items():
            original = getattr(mappings, name, None)
            if original is not None:
                replacements[id(original)] = (original, self._wrap_mapping(name, original, forward_op, backward_op))
        linear = getattr(layers, LINEAR_SITE, None)
        if linear is not None:
            replacements[id(linear)] = (linear, self._wrap_linear(linear))
        # Every binding of an original in a loaded megatron module: mappings itself and whoever imported by name.
        for module_name, module in list(sys.modules.items()):
            if module is None or not module_name.startswith("megatron"):
                continue
            for attribute, value in list(vars(module).items()):
                found = replacements.get(id(value))
                if found is not None and found[0] is value:
                    self._bindings.append((module, attribute, value))
                    setattr(module, attribute, found[1])

    # -- wrappers ----------------------------------------------------------------------------------------------
    def _wrap_mapping(self, name: str, original: Callable, forward_op, backward_op) -> Callable:
        group_position = 2 if name == "gather_from_sequence_parallel_region" else 1

        @functools.wraps(original)  # also copies attributes Megatron keeps on its functions (e.g. `warned`)
        def lossy_mapping(input_, *args, **kwargs):
            if _group_size(_argument((input_,) + args, kwargs, group_position, "group")) <= 1:
                return original(input_, *args, **kwargs)
            gradient_op = backward_op
            if name == "gather_from_sequence_parallel_region" and not _argument(
                    (input_,) + args, kwargs, 1, "tensor_parallel_output_grad", True):
                gradient_op = None  # the backward is a local split
            if gradient_op is not None and self.backward:
                input_ = _LossOnGradient.apply(input_, self._stream(gradient_op, "backward"))
            output = original(input_, *args, **kwargs)
            if forward_op is not None and self.forward:
                output = _LossOnOutput.apply(output, self._stream(forward_op, "forward"))
            return output

        return lossy_mapping

    def _wrap_linear(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def lossy_linear(input, weight, *args, **kwargs):
            values = (input, weight) + args
            allreduce_dgrad = _argument(values, kwargs, 4, "allreduce_dgrad", False)
            sequence_parallel = _argument(values, kwargs, 5, "sequence_parallel", False)
            group = _argument(values, kwargs, 9, "tp_group")
            if self.backward and (allreduce_dgrad or sequence_parallel) and _group_size(group) > 1:
                gradient_op = "reduce_scatter" if sequence_parallel else "all_reduce"
                input = _LossOnGradient.apply(input, self._stream(gradient_op, "backward"))
            return original(input, weight, *args, **kwargs)

        return lossy_linear

    def _stream(self, collective: str, direction: str) -> TensorLoss:
        key = (collective, direction)
        stream = self._streams.get(key)
        if stream is None:
            parts = [_TP_SALT, self._rank or 0, zlib.crc32(collective.encode()), _DIRECTIONS[direction]]
            stream = self._streams[key] = TensorLoss(self.config, parts, plugin=self._plugin)
        return stream

    # -- statistics --------------------------------------------------------------------------------------------
    def stats(self) -> List[LinkLossStats]:
        return [from_core(stream.stats(), "tp", f"{collective}@rank{self._rank or 0}", direction)
                for (collective, direction), stream in sorted(self._streams.items())]
