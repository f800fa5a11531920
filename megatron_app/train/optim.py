"""Optimizer and the end-of-iteration gradient finalisation.

Megatron-Core's optimizer (get_megatron_optimizer) needs chunks wrapped in its
DistributedDataParallel, whose grad buffers are allocated with ``torch.cuda.current_device()`` and
so cannot exist on CPU. We therefore use torch.optim.Adam on plain ``param.grad`` and do the
data-parallel all-reduce in ``finalize_model_grads``, which the schedules call through
``config.finalize_model_grads_func`` after the last backward (the same hook Megatron uses). The
same path runs on CUDA, so CPU and GPU runs use identical arithmetic.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import parallel_state


def _trainable(model: List[torch.nn.Module]) -> List[torch.nn.Parameter]:
    return [p for chunk in model for p in chunk.parameters() if p.requires_grad]


def build_optimizer(chunks: List[torch.nn.Module], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(_trainable(chunks), lr=lr)


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None,
                         pg_collection=None, force_all_reduce: Optional[bool] = False) -> None:
    """Megatron's finalize_model_grads contract without its DDP: average (or, with per-token loss,
    sum then divide by the global token count) every gradient over the data-parallel group.

    Embeddings are untied and sequence parallelism is off, so there is no embedding-group or
    layernorm all-reduce to do.
    """
    params = _trainable(model)
    for param in params:
        if param.grad is None:  # every DP rank must contribute a tensor of the same layout
            param.grad = torch.zeros_like(param)
    dp_group = (pg_collection.dp_cp if pg_collection is not None and hasattr(pg_collection, "dp_cp")
                else parallel_state.get_data_parallel_group(with_context_parallel=True))
    dp_size = dist.get_world_size(dp_group)

    if num_tokens is not None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(num_tokens, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=pp_group)
        dist.all_reduce(num_tokens, group=dp_group)
        scale = 1.0 / max(int(num_tokens.item()), 1)
    else:
        scale = 1.0 / dp_size

    if dp_size == 1 and scale == 1.0:
        return
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)  # one collective instead of one per parameter
    if dp_size > 1:
        dist.all_reduce(flat, group=dp_group)
    flat.mul_(scale)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)
