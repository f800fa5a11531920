"""Injectable packet loss for lossy-network research on pipeline and tensor-parallel traffic.

Public API:
    make_loss_config(model, loss_rate=None, burst_length=None, loss_on=..., fill="zeros", seed=0,
                     packet_bytes=4096, tp_sites="all") -> LossConfig   (LossConfigError on bad parameters)
    gilbert_from_burst(loss_rate, burst_length) -> (p, r, 1-h, 1-k)
    LossyMegatronIntegration(loss_model, *, forward=True, backward=True, sites=None, ...)  .enable() .disable()
                     .stats()  (megatron-core tensor/expert-parallel collectives; see tensor_parallel.py)
    adapt(obj) -> PluginLossModel, load_plugin("MOD.OBJ")      (send / apply / __call__ plug-ins)
    TensorLoss(config, stream, plugin=None)(tensor, family=0) -> tensor
    pipeline.configure(config); pipeline.attach_configured_loss(transport); pipeline.current_pipeline_loss()
    LinkLossStats, LossReporter
"""

from .config import (
    DEFAULT_PACKET_BYTES, FILLS, MODELS, TP_SITES, TRAFFIC, LossConfig, LossConfigError, gilbert_from_burst,
    make_loss_config, read_loss_pattern,
)
from .plugin import PluginLossModel, adapt, load_plugin
from .stats import LOSS_EVENT, LinkLossStats, LossReporter


def __getattr__(name):
    # torch-heavy parts load on first use, so flag parsing stays light
    if name == "LossyMegatronIntegration":
        from .tensor_parallel import LossyMegatronIntegration

        return LossyMegatronIntegration
    if name == "TensorLoss":
        from .tensors import TensorLoss

        return TensorLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_PACKET_BYTES", "FILLS", "LOSS_EVENT", "MODELS", "TP_SITES", "TRAFFIC", "LinkLossStats", "LossConfig",
    "LossConfigError", "LossReporter", "LossyMegatronIntegration", "PluginLossModel", "TensorLoss", "adapt",
    "gilbert_from_burst", "load_plugin", "make_loss_config", "read_loss_pattern",
]
