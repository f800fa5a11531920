"""Per-rank dumps of gradients or weights, merged back into full tensors by global name.

Each rank writes ``<kind>_rank<global rank>.pt``: {global_name: {"tensor", "tp_rank", "tp_size",
"partition_dim", "partition_stride"}}. Only data-parallel rank 0 writes: after finalisation every
DP replica holds the same gradients and weights. The loaders merge TP shards, so dumps taken under
different layouts (P, V, T, D) compare name by name.
"""

from __future__ import annotations

import glob
import os
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from .names import named_global_parameters
from .optim import model_grad
from .sharding import ShardInfo, merge_shards

GRADS = "grads"
WEIGHTS = "weights"


def _dump(chunks: List[torch.nn.Module], directory: str, kind: str) -> None:
    if parallel_state.get_data_parallel_rank() != 0:
        return
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    records = {}
    for chunk in chunks:
        for global_name, param in named_global_parameters(chunk):
            info = ShardInfo.of(param)
            if kind == GRADS:
                grad = model_grad(param)   # main_grad under mixed precision (then scaled by any loss scale)
                tensor = grad if grad is not None else torch.zeros_like(param)
            else:
                tensor = param
            records[global_name] = {
                "tensor": tensor.detach().float().cpu().clone(),
                "tp_rank": tp_rank,
                "tp_size": tp_size,
                "partition_dim": info.partition_dim,
                "partition_stride": info.stride,
            }
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{kind}_rank{dist.get_rank():05d}.pt")
    torch.save(records, path + ".tmp")
    os.replace(path + ".tmp", path)


def _load_full(directory: str, kind: str) -> Dict[str, torch.Tensor]:
    paths = sorted(glob.glob(os.path.join(directory, f"{kind}_rank*.pt")))
    if not paths:
        raise FileNotFoundError(f"no {kind}_rank*.pt files in {directory}")
    shards: Dict[str, Dict[int, dict]] = {}
    for path in paths:
        for name, record in torch.load(path, weights_only=True).items():
            shards.setdefault(name, {})[record["tp_rank"]] = record
    full = {}
    for name, by_rank in shards.items():
        first = next(iter(by_rank.values()))
        info = ShardInfo(first["partition_dim"], first["partition_stride"])
        if not info.is_sharded:
            full[name] = first["tensor"]
            continue
        missing = sorted(set(range(first["tp_size"])) - set(by_rank))
        if missing:
            raise ValueError(f"{name}: shards of tensor-parallel ranks {missing} are missing in {directory}")
        full[name] = merge_shards([by_rank[r]["tensor"] for r in range(first["tp_size"])], info)
    return full


def dump_grads(chunks: List[torch.nn.Module], directory: str) -> None:
    """Save this rank's gradients (call after backward + finalisation, before the optimizer step)."""
    _dump(chunks, directory, GRADS)


def dump_weights(chunks: List[torch.nn.Module], directory: str) -> None:
    """Save this rank's weights."""
    _dump(chunks, directory, WEIGHTS)


def load_full_grads(directory: str) -> Dict[str, torch.Tensor]:
    """{global_name: full gradient} merged from all rank files in ``directory``."""
    return _load_full(directory, GRADS)


def load_full_weights(directory: str) -> Dict[str, torch.Tensor]:
    """{global_name: full weight} merged from all rank files in ``directory``."""
    return _load_full(directory, WEIGHTS)
