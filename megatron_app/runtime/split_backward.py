"""A split of one chunk's backward into B (input gradient, sent upstream at once) and W (weight gradients, later).

B is the chunk's ordinary backward, with two changes. Nodes that can defer their weight gradient (Megatron's local
linear layers: linear_wgrad.py; the emulated chunks) compute only their input gradient and keep what the weight
gradient needs (weight_deferral.py). And B accumulates into every other leaf (the input, LayerNorm weights, ...)
but not into the deferred weights: a walk of the chunk's graph finds the leaves B must reach, and B runs autograd
with exactly those as inputs, so the deferred weights' AccumulateGrad nodes (and Megatron's DDP hooks on them) do
not fire in B. B frees the graph as a whole backward does; a pending W holds only the deferred products' inputs and
output gradients. W computes each product and sends it through its weight's AccumulateGrad node, so the hooks see
each gradient exactly as after a whole backward.

So each chunk's weight gradients are added by two tasks: B (weights outside deferrable nodes) and W (the others).
A chunk without an input tensor (the first virtual stage: its input is data) has no input gradient to hurry: its B
is Megatron's whole backward and its W does nothing. Neither is a chunk with reentrant recomputation (Megatron's full
activation recomputation) split: its checkpoint node runs its own backward inside B and refuses autograd's `inputs`,
so B is the whole backward there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from megatron_app import weight_deferral
from megatron_app.megatron_compat import backward_step

from . import linear_wgrad


@dataclass
class PendingWeights:
    """What a chunk's W needs after its B."""

    products: List[weight_deferral.DeferredProduct] = field(default_factory=list)

    def kept_bytes(self) -> int:
        """Bytes of activation memory kept alive for W (each storage once)."""
        storages = {}
        for product in self.products:
            for tensor in product.kept:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def defers_weights(input_tensor) -> bool:
    """Whether a B with this input leaves weight gradients to W (else B is the whole backward)."""
    return input_tensor is not None and input_tensor.requires_grad


# torch.utils.checkpoint's and Megatron's (tensor_parallel.random) reentrant checkpoint nodes
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


def walk_for_b(root) -> Tuple[List[torch.Tensor], List[object]]:
    """(the leaves a B from `root` must accumulate into: every leaf reachable other than through a deferred edge,
    the nodes that defer); ([], []) when the graph holds a reentrant checkpoint (then nothing is deferred)."""
    leaves, seen, stack, deferring = {}, {root}, [root], []
    while stack:
        node = stack.pop()
        if type(node).__name__ == _REENTRANT_CHECKPOINT:
            return [], []
        deferred = weight_deferral.deferred_edges(node)
        if deferred:
            deferring.append(node)
        for index, (target, _) in enumerate(node.next_functions):
            if target is None or index in deferred:
                continue
            variable = getattr(target, "variable", None)
            if variable is not None:
                leaves[id(variable)] = variable
            elif target not in seen:
                seen.add(target)
                stack.append(target)
    return list(leaves.values()), deferring


def run_input_backward(input_tensor, output_tensor, output_grad, model_type, config, installation=None
                       ) -> Tuple[Optional[torch.Tensor], Optional[PendingWeights]]:
    """B for one chunk and microbatch: (input gradient, what W needs). Mirrors Megatron's backward_step (loss
    scaling on the last stage); without an input tensor it is that whole backward and W has nothing to do.
    installation: the job's record (job.py) that keeps Megatron's linear backward; default the current job's."""
    if not defers_weights(input_tensor) or not output_tensor.requires_grad:   # (Megatron skips the latter too)
        return backward_step(input_tensor, output_tensor, output_grad, model_type, config), None
    if installation is None:
        from .job import current_job

        installation = current_job().installation
    linear_wgrad.install(installation)
    leaves, deferring = walk_for_b(output_tensor.grad_fn)
    if not deferring:     # nothing to defer (or a reentrant checkpoint): the whole backward, W empty
        return backward_step(input_tensor, output_tensor, output_grad, model_type, config), PendingWeights()
    if not any(leaf is input_tensor for leaf in leaves):
        leaves.append(input_tensor)
    if output_grad is None and config.grad_scale_func is not None:
        output_tensor = config.grad_scale_func(output_tensor)
    pending = PendingWeights()
    with weight_deferral.deferring(pending.products, deferring):
        torch.autograd.backward(output_tensor, grad_tensors=output_grad, inputs=leaves)
    return input_tensor.grad, pending


def run_weight_backward(pending: Optional[PendingWeights]) -> None:
    """W: compute the deferred weight gradients and accumulate them through the weights' AccumulateGrad nodes."""
    if pending is None:
        return
    while pending.products:      # one product at a time: each gradient is freed before the next is made
        product = pending.products.pop(0)
        torch.autograd.backward(list(product.edges), grad_tensors=list(product.compute()))
