"""Activation recomputation (Megatron-LM's --recompute-* flags): the flags' rules, and recomputed layers that redraw
their forward's dropout, so the gradients are the ones without recomputation (runtime/recompute_randomness.py).

The pipelined runs with recomputation are rows of tests/test_pipeline_equality.py; here one chunk runs two
microbatches the way Megatron's own 1F1B does (both forwards, then the first backward), where the layers' microbatch
is the last forward's when the first one's backward recomputes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_app.data.document_data import pack_documents
from megatron_app.train.args import UsageError, parse_args

ENV = {"WORLD_SIZE": "1"}


@pytest.mark.parametrize("flags,line", [
    ("--recompute-activations --recompute-granularity full", "would override --recompute-granularity full"),
    ("--recompute-granularity full", "needs --recompute-method uniform|block and --recompute-num-layers"),
    ("--recompute-granularity full --recompute-method block", "needs --recompute-method"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 9",
     "between 1 and the layers of a pipeline stage (8)"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 0", "between 1"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 3",
     "divide the 8 layers of a model chunk"),
    ("--recompute-method uniform", "--recompute-method takes effect with --recompute-granularity full"),
    ("--recompute-granularity selective --recompute-num-layers 1", "--recompute-num-layers takes effect with"),
    ("--recompute-modules mlp", "--recompute-modules takes effect with --recompute-granularity selective"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --recompute-modules mlp",
     "--recompute-modules takes effect"),
    ("--recompute-activations --recompute-modules layernorm", "Transformer Engine"),
    ("--recompute-activations --recompute-modules mlp", "needs --disable-bias-linear"),
    ("--recompute-activations --emulate-compute 1", "--emulate-compute runs no model"),
])
def test_recompute_flags_that_cannot_take_effect_are_refused_in_one_line(flags, line):
    with pytest.raises(UsageError, match=line.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")):
        parse_args(flags.split(), ENV)


def test_recompute_flags_resolve_as_megatron_lm_resolves_them():
    args = parse_args(["--recompute-activations"], ENV)
    assert (args.recompute_granularity, args.recompute_modules) == ("selective", ["core_attn"])
    args = parse_args("--recompute-granularity selective --recompute-modules mlp core_attn mlp "
                      "--disable-bias-linear".split(), ENV)
    assert args.recompute_modules == ["mlp", "core_attn"]
    two_ranks = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    args = parse_args("--pipeline-model-parallel-size 2 --recompute-granularity full --recompute-method block "
                      "--recompute-num-layers 4".split(), two_ranks)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "block", 4)
    assert parse_args([], ENV).recompute_granularity is None


LENGTHS = ((7, 3, 12), (7, 3, 12))   # two packed microbatches of three documents each, shaped alike
RECOMPUTES = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective-core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective-mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
}


def _model(recompute):
    from megatron_app.train.model import build_model_chunks

    args = SimpleNamespace(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=64,
                           tensor_parallel=1, pipeline_parallel=1, model_chunks=1, seed=1234, device="cpu",
                           variable_seq_lengths=True, calculate_per_token_loss=True, hidden_dropout=0.2,
                           attention_dropout=0.2, disable_bias_linear=True, **recompute)
    return build_model_chunks(args)[0]


def _batches():
    from megatron_app.runtime.keyed_randomness import DocumentSegment

    generator = torch.Generator().manual_seed(0)
    batches, layout, document = [], [], 0
    for lengths in LENGTHS:
        documents = []
        for n in lengths:
            ids = torch.randint(0, 64, (n + 1,), generator=generator)
            documents.append({"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(n),
                              "position_ids": torch.arange(n)})
        batches.append(pack_documents(documents))
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        layout.append([DocumentSegment(document + i, 0, start, n) for i, (start, n) in enumerate(zip(starts, lengths))])
        document += len(lengths)
    return batches, layout


def _megatron_1f1b_gradients(model):
    """Forward microbatch 0, forward 1, then backward 0 and 1, each forward under Megatron's current_microbatch, as
    its 1F1B runs them; keyed dropout by document (packed microbatches)."""
    from megatron.core.pipeline_parallel.schedules import set_current_microbatch

    from megatron_app.runtime import enable_keyed_randomness, keyed_randomness, set_iteration
    from megatron_app.train.cpu_compat import CudaDeviceToCpu
    from megatron_app.train.step import packed_forward_step

    batches, layout = _batches()
    enable_keyed_randomness([model], seed=5)
    try:
        set_iteration(1)
        keyed_randomness.set_microbatch_documents(layout)
        model.zero_grad(set_to_none=True)
        losses = []
        with CudaDeviceToCpu():
            for microbatch, batch in enumerate(batches):
                set_current_microbatch(model, microbatch)
                output, loss_func = packed_forward_step(iter([batch]), model)
                losses.append(loss_func(output)[0])
        for loss in losses:
            loss.backward()
    finally:
        keyed_randomness.disable_keyed_randomness()
    return [loss.item() for loss in losses], {name: p.grad.clone() for name, p in model.named_parameters()}


def _count_reruns(model, module_type):
    calls = []
    for module in model.modules():
        if isinstance(module, module_type):
            module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("name", RECOMPUTES)
def test_recomputed_layers_redraw_their_forwards_dropout_under_megatrons_1f1b_order(megatron_single_rank, name):
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_app.train.attention import SdpaCoreAttention

    want_losses, want_grads = _megatron_1f1b_gradients(_model({}))
    model = _model(RECOMPUTES[name])
    rerun = {"full-uniform": TransformerLayer, "full-block": TransformerLayer,
             "selective-core_attn": SdpaCoreAttention, "selective-mlp": MLP}[name]
    calls = _count_reruns(model, rerun)
    losses, grads = _megatron_1f1b_gradients(model)
    layers_rerun = {"full-uniform": 4, "full-block": 1}.get(name, 4)
    assert len(calls) == len(LENGTHS) * (4 + layers_rerun), "recomputation did not run"
    assert losses == want_losses
    for param, want in want_grads.items():
        assert torch.equal(grads[param], want), f"{name} {param}: gradient differs from the run without recomputation"


@pytest.mark.parametrize("name", ["full-uniform", "selective-core_attn"])
def test_without_the_forwards_microbatch_and_layer_the_recomputed_masks_differ(megatron_single_rank, monkeypatch,
                                                                               name):
    """The test above can fail: a rerun keyed by the moment's microbatch (full) or layer (core attention) draws other
    masks, and other gradients."""
    from megatron_app.runtime.keyed_randomness import KeyedRandomness

    _, want_grads = _megatron_1f1b_gradients(_model({}))
    monkeypatch.setattr(KeyedRandomness, "restore_recompute_context", lambda self, context: None)
    _, grads = _megatron_1f1b_gradients(_model(RECOMPUTES[name]))
    assert any(not torch.equal(grads[param], want) for param, want in want_grads.items())
