"""Loss on tensor-parallel traffic: LossyMegatronIntegration wraps megatron-core's tensor-parallel communication.

    with LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.01), forward=True, backward=False):
        ... train ...

What is wrapped: the collectives themselves, as the megatron modules that communicate on tensor-parallel groups
look them up. In each module of SITES the global `torch` (and `dist`, and names bound by value such as
`dist_all_gather_func`) is replaced by a view whose torch.distributed collectives are lossy stand-ins
(collectives.py). That one mechanism covers the mappings helpers (all-reduce / all-gather / reduce-scatter, the MoE
all-to-all and all_to_all_sp2hp / hp2sp, and every module that imported them by name: their globals are the
mappings module's), the linear layers' own sequence-parallel all-gather, input-gradient all-reduce and
reduce-scatter, and vocab-parallel cross-entropy's all-reduces. disable() puts the original objects back.

Which traffic loses packets: calls whose group is one of megatron's intra-layer groups (GROUPS: tensor, expert and
their combinations); data-parallel, pipeline, embedding and WORLD calls pass untouched, as do calls on a group of one
rank. Only floating-point payloads are lost: integer and bool tensors carry token counts, split sizes and routing
maps, which (like headers) always arrive, so loss never turns into a shape error or a hang.

Semantics: the tensor a rank receives from a collective goes through the loss model before use, as a pipeline
receive does. Direction: a collective run while autograd's engine runs a backward pass is backward traffic, the
rest is forward traffic. Forward recomputed by activation checkpointing runs inside the backward pass, so its
collectives count as backward traffic: they travel then, beside the gradients (no public torch API tells a
recomputed forward apart from a Function that calls a collective in its own backward, such as the all-to-all).
One stream per (group, site, collective, direction) per rank, named "tp:cross_entropy.all_reduce@rank0" in the
statistics; stale fill reuses the last payload of the same size that the same line of megatron received from the
same source rank (row-parallel layers share one line in mappings.py, so their all-reduces share one memory).
"""

from __future__ import annotations

import functools
import importlib
import threading
import zlib
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import Piece, lossy_collective, module_view, wrapped_collectives
from .config import LossConfig, LossConfigError, make_loss_config
from .plugin import PluginLossModel, adapt, load_plugin
from .stats import LinkLossStats, from_core
from .tensors import TensorLoss

# megatron-core 0.16 modules that call collectives on tensor-parallel groups -> short name used in statistics and
# --loss-tp-sites (config.TP_SITES lists the same names for flag checks that must not import torch)
SITES: Dict[str, str] = {
    "megatron.core.tensor_parallel.mappings": "mappings",        # region helpers, MoE all-to-all
    "megatron.core.tensor_parallel.layers": "layers",            # linear autograd Functions' own collectives
    "megatron.core.tensor_parallel.cross_entropy": "cross_entropy",
    "megatron.core.fusions.fused_cross_entropy": "fused_cross_entropy",
    "megatron.core.tensor_parallel.utils": "tp_utils",           # gather_split_1d_tensor (distributed checkpointing)
    "megatron.core.utils": "core_utils",                         # drain_embedding_wgrad_compute's all-gather
}
# megatron-core modules with direct collective calls whose traffic stays exact, and why
LEFT_OUT: Dict[str, str] = {
    "megatron.core.tensor_parallel.data": "broadcast of the input batch, not model traffic",
    "megatron.core.transformer.attention": "a debugging check that QK-layernorm weights agree",
    "megatron.core.transformer.moe.moe_utils": "aux-loss logging; expert-bias update over the TP x DP group",
    "megatron.core.transformer.multi_token_prediction": "MTP loss logging; its other traffic is context-parallel",
    "megatron.core.transformer.experimental_attention_variant.dsa": "experimental attention variant",
    "megatron.core.models.common.language_module.language_module": "embedding-group all-reduce (pipeline ends)",
}
# intra-layer groups whose traffic loses packets: name in statistics -> megatron.core.parallel_state getter
GROUPS: Tuple[Tuple[str, str], ...] = (
    ("tp", "get_tensor_model_parallel_group"),
    ("tp_cp", "get_tensor_and_context_parallel_group"),
    ("ep", "get_expert_model_parallel_group"),
    ("expt_tp", "get_expert_tensor_parallel_group"),
    ("tp_ep", "get_expert_tensor_and_model_parallel_group"),
)
_TP_SALT = 0x54500000  # keeps tensor-parallel streams apart from pipeline ones
_DIRECTIONS = {"forward": 1, "backward": 2}

_active_lock = threading.Lock()
_active: Optional["LossyMegatronIntegration"] = None


def in_backward_pass() -> bool:
    """True while autograd's engine runs a backward pass on this thread (the id torch.utils.checkpoint uses too)."""
    return torch._C._current_graph_task_id() != -1


def group_kind(group) -> Optional[str]:
    """The GROUPS name of a process group, or None when it is not an intra-layer group of this rank."""
    from megatron.core import parallel_state

    for kind, getter in GROUPS:
        if getattr(parallel_state, getter)(check_initialized=False) is group:
            return kind
    return None


class LossyMegatronIntegration:
    """Applies a loss model to megatron-core's tensor-parallel traffic while enabled.

    loss_model: a LossConfig (built-in C++ models, or model="python"), or any plug-in object with send / apply /
    __call__. For a plug-in object, fill, packet_bytes, seed and loss_rate (the p of the rescale fill) may be given.
    forward / backward: which direction's traffic loses packets. rank: names this rank's streams (default: the
    torch.distributed rank). sites: the SITES names whose traffic loses packets (default: the LossConfig's tp_sites,
    which are all of them unless narrowed), e.g. everything but "cross_entropy".
    """

    def __init__(self, loss_model, *, forward: bool = True, backward: bool = True, fill: str = "zeros",
                 packet_bytes: int = 4096, seed: int = 0, loss_rate: Optional[float] = None,
                 rank: Optional[int] = None, sites: Optional[Iterable[str]] = None):
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
        sites = set(config.tp_sites) if sites is None else set(sites)
        unknown = sorted(sites - set(SITES.values()))
        if unknown or not sites:
            raise LossConfigError(f"sites must name some of {', '.join(SITES.values())}; got {sorted(sites)}")
        self.config = config
        self.forward = bool(forward)
        self.backward = bool(backward)
        self.sites = frozenset(sites)
        self._plugin = plugin
        self._rank = rank
        self._streams: Dict[Tuple[str, str, str, str], TensorLoss] = {}
        self._streams_lock = threading.Lock()  # backward may run on autograd's device threads
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
                self._rank = dist.get_rank() if dist.is_initialized() else 0
            try:
                self._patch()
            except BaseException:
                self._restore()
                raise
            _active = self
        return self

    def disable(self) -> None:
        """Restore every patched binding to the original object. Idempotent."""
        global _active
        with _active_lock:
            self._restore()
            if _active is self:
                _active = None

    def __enter__(self) -> "LossyMegatronIntegration":
        return self.enable()

    def __exit__(self, *exc_info) -> None:
        self.disable()

    def _restore(self) -> None:
        for module, attribute, original in reversed(self._bindings):
            setattr(module, attribute, original)
        self._bindings = []

    def _patch(self) -> None:
        originals = wrapped_collectives()
        name_of = {id(function): name for name, function in originals.items()}
        for module_name, site in SITES.items():
            if site not in self.sites:
                continue
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as missing:
                if missing.name != module_name:
                    raise
                continue  # a megatron-core without this module has no such traffic
            route = functools.partial(self._route, site)
            stand_ins = {name: lossy_collective(name, function, route) for name, function in originals.items()}
            dist_view = module_view(dist, stand_ins)
            torch_view = module_view(torch, {"distributed": dist_view})
            for attribute, value in list(vars(module).items()):
                if value is torch:
                    replacement = torch_view
                elif value is dist:
                    replacement = dist_view
                elif id(value) in name_of:
                    replacement = stand_ins[name_of[id(value)]]  # e.g. dist_all_gather_func
                else:
                    continue
                self._bindings.append((module, attribute, value))
                setattr(module, attribute, replacement)

    # -- the lossy path ----------------------------------------------------------------------------------------
    def _route(self, site: str, collective: str, group):
        """deliver(pieces, place) for a call that loses packets, None for one that passes untouched."""
        direction = "backward" if in_backward_pass() else "forward"
        if not getattr(self, direction):
            return None
        kind = group_kind(group)
        if kind is None or group.size() <= 1:
            return None
        return functools.partial(self._deliver, (kind, site, collective, direction))

    def _deliver(self, key: Tuple[str, str, str, str], pieces: List[Piece], place: int) -> None:
        pieces = [(tensor, source) for tensor, source in pieces if tensor.numel() and tensor.is_floating_point()]
        if not pieces:
            return  # metadata (integer / bool payloads) always arrives
        stream = self._stream(*key)
        for tensor, source in pieces:
            family = (place << 32) | ((tensor.numel() << 8 | source) & 0xFFFFFFFF)  # what stale fill reuses
            received = stream(tensor, family=family, inplace=True)
            if received is not tensor:  # a non-contiguous or device tensor went through a CPU copy
                tensor.copy_(received)

    def _stream(self, kind: str, site: str, collective: str, direction: str) -> TensorLoss:
        key = (kind, site, collective, direction)
        stream = self._streams.get(key)
        if stream is None:
            with self._streams_lock:
                stream = self._streams.get(key)
                if stream is None:
                    name = f"{kind}:{site}.{collective}"
                    parts = [_TP_SALT, self._rank or 0, zlib.crc32(name.encode()), _DIRECTIONS[direction]]
                    stream = self._streams[key] = TensorLoss(self.config, parts, plugin=self._plugin)
        return stream

    # -- statistics --------------------------------------------------------------------------------------------
    def stats(self) -> List[LinkLossStats]:
        """One entry per stream that carried traffic: link "tp:layers.all_gather@rank0", direction."""
        return [from_core(stream.stats(), "tp", f"{kind}:{site}.{collective}@rank{self._rank or 0}", direction)
                for (kind, site, collective, direction), stream in sorted(self._streams.items())]
