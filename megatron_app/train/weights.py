"""Initial weights that do not depend on the parallel layout.

Megatron draws initial weights from one RNG stream in build order, so a rank's weights depend on
which layers it builds. Here every parameter gets its own generator, seeded from (seed, global
name); the FULL tensor is drawn with Megatron's distribution for that parameter and this TP rank
keeps its shard. Same seed => bit-identical weights for any P, V, T, D.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from .names import named_global_parameters
from .sharding import ShardInfo, full_shape, take_shard

InitFn = Callable[[torch.Tensor, torch.Generator], None]

# Parameters Megatron initialises with output_layer_init_method (scaled by depth).
_OUTPUT_PROJECTIONS = (".self_attention.linear_proj.weight", ".mlp.linear_fc2.weight")
_EMBEDDINGS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")


def stable_seed(seed: int, global_name: str) -> int:
    """A 63-bit seed from (seed, name), equal in every process (unlike Python's hash())."""
    digest = hashlib.sha256(f"{seed}/{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _normal_from(init_method) -> InitFn:
    # Megatron's init methods are partial(torch.nn.init.normal_, mean=..., std=...).
    return lambda tensor, generator: init_method(tensor, generator=generator)


def _fill(value: float) -> InitFn:
    return lambda tensor, generator: tensor.fill_(value)


def init_rule(global_name: str, config: TransformerConfig) -> InitFn:
    """Megatron's initial distribution for the parameter called ``global_name``."""
    is_norm = "layernorm" in global_name or ".layer_norm_" in global_name
    if global_name.endswith("bias"):
        return _fill(0.0)
    if is_norm and global_name.endswith("weight"):
        return _fill(0.0 if config.layernorm_zero_centered_gamma else 1.0)
    if global_name in _EMBEDDINGS:
        return _normal_from(config.embedding_init_method)
    if global_name.endswith(_OUTPUT_PROJECTIONS):
        return _normal_from(config.output_layer_init_method)
    if global_name.endswith(".weight"):
        return _normal_from(config.init_method)
    raise ValueError(f"no initialisation rule for parameter {global_name!r}")


def draw_full_parameter(global_name: str, shape, config: TransformerConfig, seed: int) -> torch.Tensor:
    """The unsharded initial value of one parameter (float32 on CPU)."""
    full = torch.empty(shape, dtype=torch.float32)
    generator = torch.Generator().manual_seed(stable_seed(seed, global_name))
    with torch.no_grad():
        init_rule(global_name, config)(full, generator)
    return full


def reinitialize_by_global_name(chunks, config: TransformerConfig, seed: int) -> None:
    """Overwrite every parameter of ``chunks`` with its layout-independent initial value."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for chunk in chunks:
        for global_name, param in named_global_parameters(chunk):
            info = ShardInfo.of(param)
            full = draw_full_parameter(global_name, full_shape(param.shape, info, tp_size), config, seed)
            with torch.no_grad():
                param.copy_(take_shard(full, info, tp_rank, tp_size))
