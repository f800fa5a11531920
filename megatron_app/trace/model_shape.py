"""The shape of the model a run computed, as a trace header records it (meta.extra["model"]) and cost curves carry
it on (their source["model"]): what a task's cost depends on besides its tokens.

Pure Python (no torch): the runtime records it from the model chunks' Megatron config, the emulation from the
config its emulated chunks get, and the simulator and the emulation compare it with the curves they replay.
"""

from __future__ import annotations

from typing import Optional

# The fields, in the order messages list them. num_layers is recorded but never compared: curves are per layer, and
# replaying them at another depth (--num-layers) is what they are for.
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                "params_dtype", "tensor_parallel")
NOT_COMPARED = ("num_layers",)


def model_shape(config, vocab_size: Optional[int]) -> dict:
    """The shape of a model built from a Megatron TransformerConfig (any object with its field names), with its
    (padded) vocabulary; a field the config lacks is None."""
    dtype = getattr(config, "params_dtype", None)
    return {
        "num_layers": getattr(config, "num_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "ffn_hidden_size": getattr(config, "ffn_hidden_size", None),
        "vocab_size": None if vocab_size is None else int(vocab_size),
        "params_dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "tensor_parallel": getattr(config, "tensor_model_parallel_size", None),
    }


def model_differences(traced: dict, replayed: dict) -> list:
    """'name traced -> replayed' for each compared field both shapes know and that differs."""
    return [f"{name} {traced[name]} -> {replayed[name]}" for name in MODEL_FIELDS
            if name not in NOT_COMPARED and traced.get(name) is not None and replayed.get(name) is not None
            and traced[name] != replayed[name]]


def describe(model: dict) -> str:
    """'hidden_size 2048, num_attention_heads 16, ...' of the fields it knows."""
    return ", ".join(f"{name} {model[name]}" for name in MODEL_FIELDS if model.get(name) is not None)
