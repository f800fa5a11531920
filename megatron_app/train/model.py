"""Model provider: Megatron-Core GPTModel chunks for this pipeline rank.

Only the layer spec differs from Megatron's local one, on CPU and CUDA alike (core attention -> SdpaCoreAttention,
dropouts keyed by document); the model is stock Megatron-Core, shaped by Megatron-LM's architecture flags (norm,
SwiGLU, biases, query groups, rotary embeddings). Embedding and output weights are tied unless
--untie-embeddings-and-output-weights, as in Megatron-LM: the last stage holds a copy of the word embedding, drawn
equal to it (weights.py) and kept equal by summing both copies' gradients (optim.finalize_model_grads).
"""

from __future__ import annotations

import copy
from typing import List

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_app.devices import local_device
from megatron_app.runtime import recompute_randomness

from .flags import completed
from .attention import SdpaCoreAttention
from .cpu_compat import keep_rotary_on_cpu
from .document_dropout import ATTENTION_OUTPUT_STREAM, MLP_OUTPUT_STREAM, DocumentBiasDropoutAdd, DocumentDropout
from .names import global_param_name, named_global_parameters  # noqa: F401 (re-exported API)
from .weights import megatron_draws_skipped, reinitialize_by_global_name

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}   # args.precision's


def document_layer_spec(normalization: str = "LayerNorm") -> ModuleSpec:
    """Megatron's local GPT layer spec with our core attention (CPU and CUDA; packed documents by cu_seqlens), and
    hidden dropouts that key their masks by document when the loop tells the documents (Megatron's own otherwise).
    The one spec for both devices, so the CPU tests cover the code a GPU runs."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    spec.submodules.self_attn_bda = ModuleSpec(module=DocumentBiasDropoutAdd,
                                               params={"stream": ATTENTION_OUTPUT_STREAM})
    spec.submodules.mlp_bda = ModuleSpec(module=DocumentBiasDropoutAdd, params={"stream": MLP_OUTPUT_STREAM})
    return spec


def build_transformer_config(args) -> TransformerConfig:
    """The one TransformerConfig shared by all chunks (the schedules read it from chunk.config)."""
    args = completed(args)
    model_chunks, variable, precision = args.model_chunks, bool(args.variable_seq_lengths), args.precision
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_parallel,
        pipeline_model_parallel_size=args.pipeline_parallel,
        virtual_pipeline_model_parallel_size=model_chunks if model_chunks > 1 else None,
        # --bf16 / --fp16 (Megatron-LM's rule): parameters and the tensors sent between stages in that precision.
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        pipeline_dtype=PRECISION_DTYPES[precision],
        params_dtype=PRECISION_DTYPES[precision],
        # Megatron's CPU init also tags TP-sharded params (partition_dim, stride); we then
        # overwrite the values with layout-independent ones.
        use_cpu_initialization=True,
        perform_initialization=True,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        calculate_per_token_loss=bool(args.calculate_per_token_loss),
        # Megatron's own p2p (--schedule megatron on CUDA) then exchanges shapes before every message; our transport
        # carries the shape with the message and ignores this.
        variable_seq_lengths=variable,
        # Megatron refuses variable lengths with the default MoE dispatcher even without experts (there are none).
        moe_token_dispatcher_type="alltoall" if variable else "allgather",
        cuda_graph_scope=[],  # the default "full" is deprecated and warns
        # Megatron-LM's architecture flags
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        init_method_std=args.init_method_std,
        gated_linear_unit=bool(args.swiglu),
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        bias_activation_fusion=False,
        ffn_hidden_size=args.ffn_hidden_size,
        add_bias_linear=not args.disable_bias_linear,
        num_query_groups=args.num_query_groups,
        # --recompute-*: Megatron-Core's own recomputation; keyed dropout redraws the same masks
        # (runtime/recompute_randomness.py)
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=args.recompute_modules,
    )


def build_model_chunks(args) -> List[GPTModel]:
    """The V chunks this pipeline rank owns, initialised independently of the layout.

    ``args`` needs num_layers, hidden_size, num_attention_heads, seq_length, vocab_size,
    tensor_parallel, pipeline_parallel, model_chunks, seed and device ('cpu' | 'cuda').
    Model-parallel state must be initialised first.
    """
    config = build_transformer_config(args)
    if config.recompute_granularity is not None:
        recompute_randomness.install()   # Megatron's recomputation saves CUDA's generator, which a CPU run lacks
    spec = document_layer_spec(args.normalization)
    chunks = []
    with megatron_draws_skipped(config):
        for vp_stage in range(args.model_chunks):
            chunks.append(_gpt_chunk(args, config, spec, vp_stage if args.model_chunks > 1 else None))
    for chunk in chunks:   # with the spec's dropouts: the embedding's too is keyed by document
        if chunk.pre_process:
            chunk.embedding.embedding_dropout = DocumentDropout(config.hidden_dropout)
    reinitialize_by_global_name(chunks, config, args.seed)
    device = local_device(args.device)
    if device.type == "cpu":
        for chunk in chunks:
            keep_rotary_on_cpu(chunk)
    return [wrap_precision(chunk.to(device), config) for chunk in chunks]


def _gpt_chunk(args, config: TransformerConfig, spec, stage) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings or args.seq_length,   # validate() fills it; drivers may not
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        parallel_output=True,
        vp_stage=stage,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )


def wrap_precision(chunk: torch.nn.Module, config: TransformerConfig) -> torch.nn.Module:
    """Megatron-LM's wrap under --bf16 / --fp16: Float16Module keeps the chunk in half precision, casts float inputs of
    the first stage to it and the last stage's outputs to fp32. fp32 chunks stay unwrapped."""
    return Float16Module(config, chunk) if config.bf16 or config.fp16 else chunk
