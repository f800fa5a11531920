"""Dropout keyed by document and position: the same masks whatever microbatch or row a document lands in.

With variable-length documents the loop tells runtime.keyed_randomness which documents each microbatch holds; these
dropouts then draw each document's mask from its own generator over its whole length (one draw per document, in
position order), padded rows and packed rows alike. Positions outside any document (padding) are kept: no real token
sees them. Without a document layout (fixed-length data, keyed randomness off) they are Megatron's own dropouts.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_app.runtime.keyed_randomness import document_generators

EMBEDDING_STREAM = "embedding"
ATTENTION_OUTPUT_STREAM = "attention-output"
MLP_OUTPUT_STREAM = "mlp-output"
ATTENTION_PROBS_STREAM = "attention-probs"


def keyed_hidden_dropout(x: torch.Tensor, prob: float, generators) -> torch.Tensor:
    """Dropout of [s, b, hidden] hidden states, each document's positions masked from its own generator (drawn on
    the generator's device, CPU or the tensor's CUDA device)."""
    keep = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    for segment, generator in generators:
        end = segment.start + segment.length
        draw = torch.rand(segment.length, x.size(-1), generator=generator, device=generator.device)
        keep[segment.start:end, segment.row] = (draw >= prob).to(x.device)
    return x * keep / (1.0 - prob)


class DocumentBiasDropoutAdd:
    """A bias-dropout-add spec entry (``self_attn_bda`` / ``mlp_bda``) that keys its mask by document."""

    def __init__(self, stream: str):
        self.stream = stream

    def __call__(self, training: bool, fused: bool):
        megatron_bda = get_bias_dropout_add(training, fused)
        if not training:
            return megatron_bda

        def bias_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            generators = document_generators(self.stream, x.device) if prob > 0 else None
            if generators is None:
                return megatron_bda(x_with_bias, residual, prob)
            if bias is not None:
                x = x + bias
            residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
            return residual + keyed_hidden_dropout(x, prob, generators)

        return bias_dropout_add


class DocumentDropout(torch.nn.Module):
    """Stands in for the embedding's torch.nn.Dropout."""

    def __init__(self, prob: float, stream: str = EMBEDDING_STREAM):
        super().__init__()
        self.prob = prob
        self.stream = stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        generators = document_generators(self.stream, x.device) if self.training and self.prob > 0 else None
        if generators is None:
            return torch.nn.functional.dropout(x, self.prob, self.training)
        return keyed_hidden_dropout(x, self.prob, generators)


def attention_dropout_draw(batch: int, heads: int, rows: int, cols: int, segment_index=None, device=None):
    """Uniform draws [batch, all heads, rows, cols] on ``device`` (CPU by default) for attention dropout keyed by
    document, or None (draw as before). ``segment_index``: the call attends one document of a packed row (that
    document's draw alone); otherwise each padded row holds its documents at their positions, and the rest draws 1
    (kept)."""
    generators = document_generators(ATTENTION_PROBS_STREAM, device)
    if generators is None:
        return None
    if segment_index is not None:
        segment, generator = generators[segment_index]
        return torch.rand(1, heads, segment.length, segment.length, generator=generator, device=generator.device)
    draw = torch.ones(batch, heads, rows, cols, device=device)
    for segment, generator in generators:
        end = segment.start + segment.length
        draw[segment.row, :, segment.start:end, segment.start:end] = torch.rand(
            heads, segment.length, segment.length, generator=generator, device=generator.device)
    return draw
