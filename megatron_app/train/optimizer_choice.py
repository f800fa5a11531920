"""Which optimizer a run steps with: the flags' choice among optim.Fp32Optimizer, optim.MixedPrecisionOptimizer and
distributed_optimizer.DistributedOptimizer."""

from __future__ import annotations

from typing import List, Optional

import torch

from .distributed_optimizer import DistributedOptimizer
from .optim import AdamSettings, Fp32Optimizer, MixedPrecision, MixedPrecisionOptimizer


def build_optimizer(chunks: List[torch.nn.Module], settings: AdamSettings, mixed: Optional[MixedPrecision] = None,
                    distributed: bool = False):
    """AdamW as the flags ask (settings); under mixed precision (``mixed``) on fp32 main parameters, sharded over
    the data-parallel ranks when ``distributed`` (--use-distributed-optimizer), and the chunks' config then scales
    the loss when the run has a loss scale."""
    if distributed:
        optimizer = DistributedOptimizer(chunks, settings, mixed)
    elif mixed is None:
        return Fp32Optimizer(chunks, settings)
    else:
        optimizer = MixedPrecisionOptimizer(chunks, settings, mixed)
    if optimizer.grad_scaler is not None:
        chunks[0].config.grad_scale_func = optimizer.scale_loss   # shared by all chunks, as in Megatron-LM
    return optimizer
