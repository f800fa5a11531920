"""Initial weights that do not depend on the parallel layout.

Megatron draws initial weights from one RNG stream in build order, so a rank's weights depend on
which layers it builds. Here every parameter gets its own generator, seeded from (seed, global
name); the FULL tensor is drawn with Megatron's distribution for that parameter and this TP rank
keeps its shard. Same seed => bit-identical weights for any P, V, T, D.
"""

from __future__ import annotations

import collections
import hashlib
import inspect
import math
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from megatron.core import parallel_state
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel import layers as megatron_layers
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


# Threads drawing parameters at once: each parameter has its own generator, so the values do not depend on the
# order; torch's normal_ draws serially (~270 M values/s a core), 6 s for a 1.6 B-parameter model on one.
_MOST_DRAW_THREADS = 8
# Full fp32 tensors drawn ahead of their copies, at most (one larger parameter is drawn alone): every rank of a host
# draws at once, so the host's memory bounds it, not the model.
_DRAWN_BYTES_AHEAD = 1 << 30
_MEGATRON_INIT_FIELDS = ("init_method", "output_layer_init_method", "embedding_init_method")


def _leave_as_allocated(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def _outside_embedding_group(module) -> bool:
    return False


def _tag_only(megatron_initializer):
    """Megatron's _initialize_affine_weight_cpu reduced to what our initialisation keeps of it: the tensor-parallel
    tags (partition_dim, stride). Its full-size fp32 master weight per parameter (allocated, cast, split and copied:
    6.9 s of an 11.4 s build of a 1.65 B-parameter model on 2 cores) is skipped. None where the signature is not the
    one this was written against (megatron-core 0.16-0.19), or for a caller that keeps the master weight."""
    signature = inspect.signature(megatron_initializer)
    if not {"weight", "partition_dim", "stride", "return_master_weight"} <= set(signature.parameters):
        return None

    def tag_only(*args, **kwargs):
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        arguments = given.arguments
        if arguments["return_master_weight"]:
            return megatron_initializer(*args, **kwargs)
        if not arguments.get("skip_set_tensor_parallel_attributes", False):
            megatron_layers.set_tensor_model_parallel_attributes(tensor=arguments["weight"], is_parallel=True,
                                                                 dim=arguments["partition_dim"],
                                                                 stride=arguments["stride"])
        return None

    return tag_only


@contextmanager
def megatron_draws_skipped(config: TransformerConfig) -> Iterator[None]:
    """While building the model, Megatron's initialisation runs without drawing: its layers allocate their parameters
    and tag the tensor-parallel ones with partition_dim and stride (which the sharding and the clipping read), and
    reinitialize_by_global_name overwrites every parameter afterwards. Megatron's own draw of a 1.6 B-parameter model
    took about as long as ours, and its master weights longer. Nor does Megatron copy a tied embedding to the last
    stage. The config's init methods, Megatron's initializer and its embedding-group test are restored on leaving."""
    saved = {name: getattr(config, name) for name in _MEGATRON_INIT_FIELDS if getattr(config, name, None) is not None}
    megatron_initializer = megatron_layers._initialize_affine_weight_cpu
    in_embedding_group = LanguageModule._is_in_embd_group
    for name in saved:
        setattr(config, name, _leave_as_allocated)
    megatron_layers._initialize_affine_weight_cpu = _tag_only(megatron_initializer) or megatron_initializer
    # A tied output weight's copy on the last stage is drawn under the embedding's name like the embedding itself, so
    # Megatron's copying all-reduce between the stages (which moves the weight to CUDA first) has nothing to do.
    LanguageModule._is_in_embd_group = _outside_embedding_group
    try:
        yield
    finally:
        LanguageModule._is_in_embd_group = in_embedding_group
        megatron_layers._initialize_affine_weight_cpu = megatron_initializer
        for name, value in saved.items():
            setattr(config, name, value)


def _draw_threads(parameters: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(parameters, cores, _MOST_DRAW_THREADS))


def reinitialize_by_global_name(chunks, config: TransformerConfig, seed: int) -> None:
    """Overwrite every parameter of ``chunks`` with its layout-independent initial value. Drawn on several threads
    (each parameter has its own generator, so the values are the same in any order), copied into the parameters on
    the calling thread: a worker thread copying into a GPU's parameter could make a CUDA context on device 0."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    parameters = []
    for chunk in chunks:
        for global_name, param in named_global_parameters(chunk):
            info = ShardInfo.of(param)
            parameters.append((global_name, param, info, full_shape(param.shape, info, tp_size)))

    def drawn_shard(global_name: str, info: ShardInfo, shape) -> torch.Tensor:
        return take_shard(draw_full_parameter(global_name, shape, config, seed), info, tp_rank, tp_size)

    def copy(param: torch.nn.Parameter, shard: torch.Tensor) -> None:
        with torch.no_grad():
            param.copy_(shard)

    threads = _draw_threads(len(parameters))
    if threads == 1:
        for global_name, param, info, shape in parameters:
            copy(param, drawn_shard(global_name, info, shape))
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weights") as pool:
        ahead, drawn_bytes = collections.deque(), 0
        for global_name, param, info, shape in parameters:
            full_bytes = 4 * math.prod(shape)
            while ahead and drawn_bytes + full_bytes > _DRAWN_BYTES_AHEAD:
                waiting, future, size = ahead.popleft()
                copy(waiting, future.result())   # a worker's exception is raised here
                drawn_bytes -= size
            ahead.append((param, pool.submit(drawn_shard, global_name, info, shape), full_bytes))
            drawn_bytes += full_bytes
        for waiting, future, _ in ahead:
            copy(waiting, future.result())
