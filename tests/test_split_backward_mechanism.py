"""runtime/split_backward.py on plain torch modules: B then W gives the whole backward's gradients, W's gradients
reach the weights through their AccumulateGrad nodes (where Megatron's DDP hooks sit), B adds no weight gradient,
and weights off the input's gradient path are refused with a clear error. (Megatron-Core chunks: the split-backward
case of tests/test_pipeline_equality.py.)"""

from types import SimpleNamespace

import pytest
import torch

from megatron_app.runtime.split_backward import (defers_weights, run_input_backward, run_weight_backward,
                                                 trainable_weights)

CONFIG = SimpleNamespace(grad_scale_func=None)


def chunk():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def whole_backward(model, x, grad):
    x = x.clone().requires_grad_(True)
    torch.autograd.backward(model(x), grad)
    result = [w.grad.clone() for w in model.parameters()], x.grad.clone()
    model.zero_grad(set_to_none=True)
    return result


def test_b_then_w_gives_the_whole_backwards_gradients_and_w_alone_accumulates_weights():
    model, x, grad = chunk(), torch.randn(4, 8), torch.randn(4, 8)
    want_weights, want_input = whole_backward(model, x, grad)
    weights = trainable_weights(model)
    accumulated = []
    nodes = [w.view_as(w).grad_fn.next_functions[0][0] for w in weights]    # kept alive, as Megatron's DDP does
    for node, weight in zip(nodes, weights):
        node.register_hook(lambda *_, weight=weight: accumulated.append(weight))
    for microbatch in range(2):      # two microbatches accumulate, as in a pipeline
        inp = x.clone().requires_grad_(True)
        assert defers_weights(inp)
        before = [None if w.grad is None else w.grad.clone() for w in weights]
        input_grad, pending = run_input_backward(inp, model(inp), grad, None, CONFIG, weights)
        assert torch.allclose(input_grad, want_input)
        assert len(accumulated) == len(weights) * microbatch        # B: input gradient only
        assert all((w.grad is None and b is None) or torch.equal(w.grad, b) for w, b in zip(weights, before))
        run_weight_backward(pending)
        assert len(accumulated) == len(weights) * (microbatch + 1)
    for weight, want in zip(weights, want_weights):
        assert torch.allclose(weight.grad, 2 * want, atol=1e-6)


def test_without_an_input_b_is_the_whole_backward_and_w_is_empty(monkeypatch):
    calls = []
    monkeypatch.setattr("megatron_app.runtime.split_backward.backward_step",
                        lambda *args: calls.append(args) or "whole")
    assert not defers_weights(None)
    assert run_input_backward(None, torch.zeros(1), None, None, CONFIG, []) == ("whole", None)
    assert len(calls) == 1
    run_weight_backward(None)


def test_weights_hidden_inside_a_reentrant_checkpoint_are_refused():
    # A reentrant checkpoint (as Megatron's full recomputation) runs its weights' backward inside one opaque node:
    # B would accumulate them itself, so the split cannot defer them and says so.
    class Recomputed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.linear, x, use_reentrant=True)

    model = Recomputed()
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="split backward: the input-gradient pass failed .* reentrant"):
        run_input_backward(x, model(x), torch.ones(2, 4), None, CONFIG, trainable_weights(model))
