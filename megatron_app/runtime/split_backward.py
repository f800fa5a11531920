"""A model-agnostic split of one chunk's backward into B (input gradient) and W (weight gradients), on CPU or GPU.

B: torch.distributed.pipelining's stage_backward_input. It walks the chunk's autograd graph once, finds for each group
of weights the nodes where their gradient path leaves the input's path ("intermediates"), computes only the input
gradient (autograd.grad with retain_graph) and keeps the gradients that reached those intermediates.
W: autograd.backward from the kept intermediate gradients to the weights only (inputs=weights). The engine runs just
the weight-gradient products and whatever lies between an intermediate and its weights, never the input-gradient
chain again; and the weights' AccumulateGrad nodes run, so Megatron's DDP hooks (main_grad accumulation, overlapped
gradient reduction) see each gradient exactly as after a whole backward. (torch's own stage_backward_weight writes
.grad directly, which those hooks would miss.) Megatron's local linear layers compute both products in one autograd
node; linear_wgrad.py makes that node do only its B half in B and its W half in W.

A chunk without an input tensor (the first virtual stage: its input is data) has no input gradient to hurry: its B
is Megatron's whole backward and its W does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input

from megatron_app import backward_phase
from megatron_app.megatron_compat import backward_step

from . import linear_wgrad


@dataclass
class PendingWeights:
    """What a chunk's W needs after its B: per weight group, the kept intermediate gradients and the weights."""

    # per group: (edges, grads, weights, pins); pins: (node, kept grads) when the group has several intermediates
    groups: List[Tuple[List[GradientEdge], List[torch.Tensor], List[torch.Tensor], List[tuple]]]


def trainable_weights(model) -> List[torch.Tensor]:
    return [param for param in model.parameters() if param.requires_grad]


def defers_weights(input_tensor) -> bool:
    """Whether a B with this input leaves the weight gradients to W (else B is the whole backward)."""
    return input_tensor is not None and input_tensor.requires_grad


def run_input_backward(input_tensor, output_tensor, output_grad, model_type, config, weights
                       ) -> Tuple[Optional[torch.Tensor], Optional[PendingWeights]]:
    """B for one chunk and microbatch: (input gradient, what W needs). Mirrors Megatron's backward_step (loss
    scaling on the last stage); without an input tensor it is that whole backward and W has nothing to do."""
    if not defers_weights(input_tensor):
        return backward_step(input_tensor, output_tensor, output_grad, model_type, config), None
    if output_grad is None and config.grad_scale_func is not None:
        output_tensor = config.grad_scale_func(output_tensor)
    if not output_tensor.requires_grad:    # Megatron skips such a backward too (e.g. an absent modality)
        return None, None
    if output_grad is None:
        output_grad = torch.ones_like(output_tensor)
    by_node = {_get_grad_fn_or_grad_acc(weight): weight for weight in weights}
    linear_wgrad.install()
    try:
        with backward_phase.phase(backward_phase.INPUT):
            input_grads, param_groups = stage_backward_input([output_tensor], [output_grad], [input_tensor],
                                                             iter(weights))
    except RuntimeError as exc:     # e.g. reentrant activation recomputation refuses autograd.grad
        raise RuntimeError(f"split backward: the input-gradient pass failed on this chunk ({exc.__cause__ or exc}); "
                           f"a chunk with reentrant activation recomputation cannot split its backward: run without "
                           f"--split-backward") from exc
    covered = set()
    groups = []
    for group in param_groups:
        edges, grads = [], []
        for kept, node in zip(group.get("grads") or [], group["intermediates"]):
            for index, grad in enumerate(kept):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        pins = []
        if len(group["intermediates"]) > 1:
            pins = [(node, kept) for kept, node in zip(group["grads"], group["intermediates"])]
        covered.update(group["params"])
        if edges:
            groups.append((edges, grads, [by_node[node] for node in group["params"]], pins))
    missing = [weight for node, weight in by_node.items() if node is not None and node not in covered]
    if missing:
        raise RuntimeError(f"split backward: {len(missing)} trainable weight(s) of shapes "
                           f"{[tuple(w.shape) for w in missing[:3]]} are not on the input's gradient path, so their "
                           f"gradients cannot be deferred; run without --split-backward")
    return input_grads[0], PendingWeights(groups)


def run_weight_backward(pending: Optional[PendingWeights]) -> None:
    """W: accumulate the weight gradients kept by B into the weights (through their AccumulateGrad nodes)."""
    if pending is None:
        return
    for edges, grads, weights, pins in pending.groups:
        # An intermediate downstream of another in its group would get gradient twice (kept, and flowing from the
        # upstream one): pin each to its kept gradient, as torch's stage_backward_weight does.
        handles = [node.register_prehook(lambda grad_outputs, kept=kept: kept) for node, kept in pins]
        try:
            with backward_phase.phase(backward_phase.WEIGHT):
                torch.autograd.backward(edges, grad_tensors=grads, inputs=weights)
        finally:
            for handle in handles:
                handle.remove()
    pending.groups.clear()     # frees the kept gradients and, with them, the graph's saved tensors
