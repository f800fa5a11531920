"""Tensor-parallel shards of a parameter, following Megatron's own split.

Megatron marks a TP-sharded parameter with ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride``; ``_initialize_affine_weight_cpu`` splits the full tensor into pieces of
``local_size / stride`` along ``partition_dim`` and gives rank r the pieces r, r+T, r+2T, ...
These helpers do that split and its inverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class ShardInfo:
    """How one rank's tensor relates to the full tensor (partition_dim None: replicated)."""

    partition_dim: Optional[int]
    stride: int = 1

    @classmethod
    def of(cls, param: torch.Tensor) -> "ShardInfo":
        if getattr(param, "tensor_model_parallel", False):
            return cls(int(param.partition_dim), int(getattr(param, "partition_stride", 1)))
        return cls(None, 1)

    @property
    def is_sharded(self) -> bool:
        return self.partition_dim is not None


def full_shape(local_shape: Sequence[int], info: ShardInfo, tp_size: int) -> tuple:
    shape = list(local_shape)
    if info.is_sharded:
        shape[info.partition_dim] *= tp_size
    return tuple(shape)


def take_shard(full: torch.Tensor, info: ShardInfo, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of ``full``."""
    if not info.is_sharded or tp_size == 1:
        return full
    local_size = full.size(info.partition_dim) // tp_size
    pieces = torch.split(full, local_size // info.stride, dim=info.partition_dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=info.partition_dim)


def merge_shards(shards: Sequence[torch.Tensor], info: ShardInfo) -> torch.Tensor:
    """Inverse of take_shard: ``shards[r]`` is TP rank r's part."""
    if not info.is_sharded or len(shards) == 1:
        return shards[0]
    piece_size = shards[0].size(info.partition_dim) // info.stride
    per_rank = [torch.split(shard, piece_size, dim=info.partition_dim) for shard in shards]
    ordered = [per_rank[rank][piece] for piece in range(info.stride) for rank in range(len(shards))]
    return torch.cat(ordered, dim=info.partition_dim)
