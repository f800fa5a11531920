"""Layout-independent parameter names.

Inside a chunk, Megatron numbers transformer layers locally (``decoder.layers.0`` is the chunk's
first layer); each TransformerLayer knows its global 1-based ``layer_number``. The global name swaps
the local index for the global one, so the same parameter has the same name whatever P and V are. With tied
embedding and output weights, the last stage's copy of the word embedding is named as the embedding itself (it is
drawn, dumped and compared as that one parameter).
"""

from __future__ import annotations

import re

import torch

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_WORD_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT_WEIGHT = "output_layer.weight"


def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """Strip wrappers (DDP, Float16Module) that keep the model under ``.module``."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_param_name(chunk: torch.nn.Module, local_name: str) -> str:
    """Name of ``local_name`` (as in ``chunk.named_parameters()`` of the unwrapped GPTModel) in the
    full, unsplit model."""
    model = unwrap_chunk(chunk)
    if local_name == _OUTPUT_WEIGHT and getattr(model, "share_embeddings_and_output_weights", False):
        return _WORD_EMBEDDING   # the last stage's copy of the tied weight (one stage holds the embedding alone)
    match = _LOCAL_LAYER.match(local_name)
    if match is None:
        return local_name
    local_index, rest = int(match.group(1)), match.group(2)
    layer_number = model.decoder.layers[local_index].layer_number
    return f"decoder.layers.{layer_number - 1}.{rest}"


def named_global_parameters(chunk: torch.nn.Module):
    """Yield (global_name, parameter) for one chunk."""
    model = unwrap_chunk(chunk)
    for local_name, param in model.named_parameters():
        yield global_param_name(model, local_name), param
