"""runtime/split_backward.py: B then W gives the whole backward's gradients; B accumulates only the weights outside
deferring nodes and W the others, each through its AccumulateGrad node (where Megatron's DDP hooks sit) and never
with a missing gradient; B frees the graph, a pending W keeps only the deferred products' tensors; a reentrant
recomputation inside B is computed whole. On a Megatron-Core GPTModel chunk: bit-identical gradients with every
local linear layer deferred. (Pipelines: the split-backward case of tests/test_pipeline_equality.py.)"""


import pytest
import torch

from megatron_app import weight_deferral
from megatron_app.runtime.split_backward import defers_weights, run_input_backward, run_weight_backward

CONFIG = type("Config", (), {"grad_scale_func": None, "timers": None, "deallocate_pipeline_outputs": False})()


class DeferrableLinear(torch.autograd.Function):
    """y = x @ w.t() whose weight gradient a split backward defers (the weight_deferral protocol)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if not weight_deferral.defers(ctx):
            return grad @ weight, grad.t() @ x
        weight_deferral.defer(ctx, lambda: (grad.t() @ x,), (x, grad))
        return grad @ weight, None


weight_deferral.register(DeferrableLinear._backward_cls,
                         lambda node: (1,) if weight_deferral.leads_to_weight(node, 1) else ())


class Chunk(torch.nn.Module):
    def __init__(self, recompute=False):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Parameter(torch.randn(16, 8))
        self.norm = torch.nn.LayerNorm(16)
        self.second = torch.nn.Parameter(torch.randn(8, 16))
        self.recompute = recompute

    def layer(self, x):
        return DeferrableLinear.apply(self.norm(torch.nn.functional.gelu(DeferrableLinear.apply(x, self.first))),
                                      self.second)

    def forward(self, x):
        if self.recompute:     # as Megatron's full recomputation: the layer's graph is rebuilt inside B
            return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=True)
        return self.layer(x)


def whole_backward(model, x, grad):
    x = x.clone().requires_grad_(True)
    torch.autograd.backward(model(x), grad)
    result = [w.grad.clone() for w in model.parameters()], x.grad.clone()
    model.zero_grad(set_to_none=True)
    return result


def record_accumulations(model):
    """(weight name, had a gradient) for every AccumulateGrad call, as Megatron's DDP hook would see them."""
    calls, nodes = [], []
    for name, weight in model.named_parameters():
        node = weight.view_as(weight).grad_fn.next_functions[0][0]
        node.register_hook(lambda *_, name=name, weight=weight: calls.append((name, weight.grad is not None)))
        nodes.append(node)      # kept alive, as Megatron's DDP does
    return calls, nodes


@pytest.mark.parametrize("recompute", [False, True])
def test_b_then_w_gives_the_whole_backwards_gradients_each_weight_accumulated_once(recompute):
    # recompute: a reentrant checkpoint refuses autograd's `inputs`, so that chunk's B is the whole backward
    model, x, grad = Chunk(recompute), torch.randn(4, 8), torch.randn(4, 8)
    want_weights, want_input = whole_backward(model, x, grad)
    calls, _nodes = record_accumulations(model)
    deferred = set() if recompute else {"first", "second"}
    for microbatch in range(2):      # two microbatches accumulate, as in a pipeline
        inp = x.clone().requires_grad_(True)
        assert defers_weights(inp)
        calls.clear()
        input_grad, pending = run_input_backward(inp, model(inp), grad, None, CONFIG)
        assert torch.equal(input_grad, want_input)
        assert sorted(calls) == sorted((name, True) for name, _ in model.named_parameters() if name not in deferred)
        assert len(pending.products) == len(deferred)
        calls.clear()
        run_weight_backward(pending)
        assert sorted(calls) == sorted((name, True) for name in deferred) and not pending.products
    for weight, want in zip(model.parameters(), want_weights):
        assert torch.allclose(weight.grad, 2 * want, atol=1e-6)


def test_a_pending_w_keeps_only_the_deferred_products_tensors():
    model, x, grad = Chunk(), torch.randn(64, 8, requires_grad=True), torch.randn(64, 8)
    out = model(x)
    _, pending = run_input_backward(x, out, grad, None, CONFIG)
    # kept: first's input (x itself), second's input (norm output, 64x16) and both output gradients (64x16, 64x8)
    assert pending.kept_bytes() == 4 * 64 * (8 + 16 + 16 + 8)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.backward(out, grad)     # B freed the graph, as a whole backward does


def test_without_an_input_b_is_the_whole_backward_and_w_is_empty(monkeypatch):
    calls = []
    monkeypatch.setattr("megatron_app.runtime.split_backward.backward_step",
                        lambda *args: calls.append(args) or "whole")
    assert not defers_weights(None)
    assert run_input_backward(None, torch.zeros(1), None, None, CONFIG) == ("whole", None)
    assert len(calls) == 1
    run_weight_backward(None)


def test_a_gpt_chunk_defers_every_linear_layer_with_identical_gradients(megatron_single_rank):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_app.train.model import document_layer_spec

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0, cuda_graph_scope=[])
    chunk = GPTModel(config=config, transformer_layer_spec=document_layer_spec(), vocab_size=64,
                     max_sequence_length=16, pre_process=False, post_process=False)
    x, grad = torch.randn(16, 2, 32), torch.randn(16, 2, 32)

    def forward():
        inp = x.clone().requires_grad_(True)
        chunk.set_input_tensor(inp)
        return inp, chunk(None, None, None)

    inp, out = forward()
    torch.autograd.backward(out, grad)
    want = {name: w.grad.clone() for name, w in chunk.named_parameters()}
    want_input = inp.grad.clone()
    chunk.zero_grad(set_to_none=True)
    calls, _nodes = record_accumulations(chunk)
    inp, out = forward()
    input_grad, pending = run_input_backward(inp, out, grad, None, config)
    in_b = {name for name, _ in calls}
    products = len(pending.products)
    calls.clear()
    run_weight_backward(pending)
    in_w = {name for name, _ in calls}
    linear = {name for name, _ in chunk.named_parameters() if "linear_" in name}
    weights = {name for name in linear if name.endswith(".weight")}
    # 4 linear layers per layer, all weights deferred; a bias only where the layer adds it itself (Megatron fuses
    # the others into the next operation, which B runs)
    assert products == 2 * 4 and len(weights) == 2 * 4 and weights <= in_w <= linear
    assert in_b == set(want) - in_w and all(had for _, had in calls)
    assert torch.equal(input_grad, want_input)
    for name, weight in chunk.named_parameters():
        assert torch.equal(weight.grad, want[name]), name
