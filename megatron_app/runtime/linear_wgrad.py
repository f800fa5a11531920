"""Megatron-Core's local linear layers (ColumnParallelLinear / RowParallelLinear without Transformer Engine) with a
deferrable weight gradient (weight_deferral.py).

Their autograd node (LinearWithGradAccumulationAndAsyncCommunication) computes the input and the weight gradient in
one backward call. In a split backward's B it computes only grad_output @ weight (and its tensor-parallel
all-reduce) and keeps (grad_output, input) for W, which computes the weight and bias gradients with Megatron's own
reshaping: each product once, bit-identical to Megatron's backward, and nothing else of the chunk's graph stays
alive for W. Cases this does not cover (sequence parallelism, gradient-accumulation fusion, a weight that is not a
leaf) compute both products in B, as Megatron does: correct, not deferred.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_app import weight_deferral

def install(installation) -> None:
    """Route the local linear node's backward through a deferrable one (idempotent; outside a split backward's B it
    is Megatron's own backward, unchanged). The original is kept in the job's installation record (job.py)."""
    if installation.linear_backward is not None:
        return
    from megatron.core.tensor_parallel import layers

    function = layers.LinearWithGradAccumulationAndAsyncCommunication
    installation.linear_backward = function.backward
    function.backward = staticmethod(layers.custom_bwd(_deferrable_backward(installation.linear_backward)))
    weight_deferral.register(function._backward_cls, _deferred_edges)


def uninstall(installation) -> None:
    """Put Megatron's own backward back."""
    if installation.linear_backward is None:
        return
    from megatron.core.tensor_parallel import layers

    layers.LinearWithGradAccumulationAndAsyncCommunication.backward = staticmethod(installation.linear_backward)
    installation.linear_backward = None


def _plain(ctx) -> bool:
    """Whether this node's backward is the plain local product the halves below reproduce."""
    return (not getattr(ctx, "gradient_accumulation_fusion", True) and not getattr(ctx, "sequence_parallel", True)
            and getattr(ctx, "grad_output_buffer", 0) is None and hasattr(ctx, "use_bias"))


def _deferred_edges(ctx) -> Tuple[int, ...]:
    """Inputs are (input, weight, bias, ...): defer the weight's edge, and the bias's when there is one."""
    if not _plain(ctx) or not weight_deferral.leads_to_weight(ctx, 1):
        return ()
    if ctx.use_bias:
        return (1, 2) if weight_deferral.leads_to_weight(ctx, 2) else ()
    return (1,)


def _deferrable_backward(original):
    """The node's backward: Megatron's `original`, or in a split backward's B the input gradient only."""
    def backward(ctx, grad_output):
        if not weight_deferral.defers(ctx):
            return original(ctx, grad_output)
        input, weight = ctx.saved_tensors
        use_bias = ctx.use_bias

        def weight_gradients():
            from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

            grad, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, input)
            grad_weight = grad.t().matmul(total_input)
            return (grad_weight, grad.sum(dim=0)) if use_bias else (grad_weight,)

        weight_deferral.defer(ctx, weight_gradients, (input, grad_output))
        grad_input = grad_output.matmul(weight)
        if getattr(ctx, "allreduce_dgrad", False):
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        grads = [None] * len(ctx.needs_input_grad)
        grads[0] = grad_input
        return tuple(grads)
    return backward
