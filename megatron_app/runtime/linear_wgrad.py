"""Megatron-Core's local linear layers (ColumnParallelLinear / RowParallelLinear without Transformer Engine) split into
an input-gradient and a weight-gradient half.

Their autograd node (LinearWithGradAccumulationAndAsyncCommunication) computes the input gradient and the weight
gradient in one backward call, whatever is asked of it, so a graph-level split alone runs both products in B and
both again in W (measured with tools/bench_split_backward.py: B 0.94x and W 0.86x of a whole backward). Inside
backward_phase INPUT the node computes only grad_output @ weight (and its tensor-parallel all-reduce); inside
WEIGHT only the weight and bias gradients, with Megatron's own reshaping, so B + W do each product once,
bit-identical to Megatron's backward. Cases this does not cover (sequence parallelism, gradient-accumulation fusion,
deferred embedding gradients) run Megatron's own backward in both phases: correct, not cheaper.
"""

from __future__ import annotations

import torch

from megatron_app.backward_phase import INPUT, current

_original = None


def install() -> None:
    """Route the local linear node's backward through split_backward_of_linear (idempotent; outside a phase it is
    Megatron's own backward, unchanged)."""
    global _original
    if _original is not None:
        return
    from megatron.core.tensor_parallel import layers

    function = layers.LinearWithGradAccumulationAndAsyncCommunication
    _original = function.backward
    function.backward = staticmethod(layers.custom_bwd(_split_backward))


def _plain(ctx) -> bool:
    """Whether this node's backward is the plain local product the halves below reproduce."""
    return (not getattr(ctx, "gradient_accumulation_fusion", True) and not getattr(ctx, "sequence_parallel", True)
            and getattr(ctx, "grad_output_buffer", 0) is None and hasattr(ctx, "use_bias"))


def _split_backward(ctx, grad_output):
    phase = current()
    if phase is None or not _plain(ctx):
        return _original(ctx, grad_output)
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    input, weight = ctx.saved_tensors
    none = [None] * len(ctx.needs_input_grad)
    if phase == INPUT:
        grad_input = grad_output.matmul(weight)
        if getattr(ctx, "allreduce_dgrad", False):
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        none[0] = grad_input
        return tuple(none)
    grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, input)
    none[1] = grad_output.t().matmul(total_input)
    none[2] = grad_output.sum(dim=0) if ctx.use_bias else None
    return tuple(none)
