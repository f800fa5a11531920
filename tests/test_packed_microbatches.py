"""Packed microbatches: several whole documents in one row, no padding, attention inside each document.

The packed row must give the loss and gradients that the same documents padded (the loader's layout) give, on a
real megatron-core GPTModel built as train/model.py builds it.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_app.data.document_data import CU_SEQLENS, pack_documents, pad_to_longest

LENGTHS = (7, 3, 12)


def _documents(lengths=LENGTHS, vocab=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    documents = []
    for length in lengths:
        ids = torch.randint(0, vocab, (length + 1,), generator=generator)
        documents.append({"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(length),
                          "position_ids": torch.arange(length)})
    return documents


def test_pack_documents_concatenates_whole_documents_with_restarting_positions():
    documents = _documents()
    batch = pack_documents(documents)
    assert batch["tokens"].shape == (1, sum(LENGTHS))
    assert batch["tokens"][0].tolist() == torch.cat([d["tokens"] for d in documents]).tolist()
    assert batch["position_ids"][0].tolist() == [p for n in LENGTHS for p in range(n)]
    assert batch["loss_mask"].sum() == sum(LENGTHS)
    assert batch[CU_SEQLENS].tolist() == [0, 7, 10, 22] and batch[CU_SEQLENS].dtype == torch.int32


@pytest.mark.parametrize("qkv_format", ["sbhd", "thd"])
def test_packed_core_attention_keeps_attention_inside_each_document(qkv_format):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_app.train.attention import SdpaCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0,
                               use_cpu_initialization=True)
    attention = SdpaCoreAttention(config, 1, AttnMaskType.causal, "self")
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), 1, 2, 8) for _ in range(3))
    bounds = torch.tensor([0, 7, 10, 22], dtype=torch.int32)
    params = PackedSeqParams(qkv_format=qkv_format, cu_seqlens_q=bounds, cu_seqlens_kv=bounds)
    args = (q, k, v) if qkv_format == "sbhd" else (q.squeeze(1), k.squeeze(1), v.squeeze(1))
    packed = attention(*args, None, packed_seq_params=params)
    alone = torch.cat([attention(q[s:e], k[s:e], v[s:e], None) for s, e in ((0, 7), (7, 10), (10, 22))])
    assert torch.allclose(packed.reshape(alone.shape), alone, atol=1e-6)
    assert not torch.allclose(attention(q, k, v, None)[7:], alone[7:], atol=1e-3)   # the documents do interact


def _loss_and_grads(model, forward_step_func, batch):
    from megatron_app.train.cpu_compat import CudaDeviceToCpu

    model.zero_grad(set_to_none=True)
    with CudaDeviceToCpu():
        output, loss_func = forward_step_func(iter([batch]), model)
        loss_sum, num_tokens, _ = loss_func(output)
    loss_sum.backward()
    return loss_sum.detach(), int(num_tokens), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_packed_microbatch_gives_the_loss_and_gradients_of_the_same_documents_padded(megatron_single_rank):
    from megatron_app.train.model import build_model_chunks
    from megatron_app.train.step import forward_step, packed_forward_step

    args = SimpleNamespace(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                           tensor_parallel=1, pipeline_parallel=1, model_chunks=1, seed=1234, device="cpu",
                           variable_seq_lengths=True, calculate_per_token_loss=True, hidden_dropout=0.0,
                           attention_dropout=0.0)
    model = build_model_chunks(args)[0]
    documents = _documents()
    padded = _loss_and_grads(model, forward_step, pad_to_longest(documents))
    packed = _loss_and_grads(model, packed_forward_step, pack_documents(documents))
    assert padded[1] == packed[1] == sum(LENGTHS)
    assert abs(packed[0] - padded[0]) <= 1e-6 * abs(padded[0])
    for name, want in padded[2].items():
        err = (packed[2][name] - want).abs().max() / (want.abs().max() + 1e-12)
        assert err <= 1e-6, f"{name}: gradient differs by {err:.2e} of its max"
    # and packing without the documents' bounds (attention across documents) would not
    crossing = pack_documents(documents)
    del crossing[CU_SEQLENS]
    assert abs(_loss_and_grads(model, forward_step, crossing)[0] - padded[0]) > 1e-4 * abs(padded[0])


def test_hidden_and_attention_dropout_masks_follow_the_document_not_its_place():
    """Document 42 (5 tokens) drops the same positions as row 1 of a padded microbatch and second in a packed row."""
    from megatron_app.runtime import keyed_randomness
    from megatron_app.runtime.job import current_job
    from megatron_app.runtime.keyed_randomness import DocumentSegment
    from megatron_app.train.document_dropout import attention_dropout_draw, keyed_hidden_dropout

    state = keyed_randomness.KeyedRandomness(seed=3)
    current_job().keyed_randomness = state
    try:
        padded = [DocumentSegment(7, 0, 0, 8), DocumentSegment(42, 1, 0, 5)]
        packed = [DocumentSegment(9, 0, 0, 3), DocumentSegment(42, 0, 3, 5)]
        keyed_randomness.set_microbatch_documents([padded, packed])
        x = torch.ones(8, 2, 16)
        state.current = (0, 4)
        in_padded = keyed_hidden_dropout(x, 0.5, keyed_randomness.document_generators("s"))[:5, 1]
        padded_draw = attention_dropout_draw(2, 4, 8, 8)[1, :, :5, :5]
        state.current = (1, 4)
        in_packed = keyed_hidden_dropout(torch.ones(8, 1, 16), 0.5, keyed_randomness.document_generators("s"))[3:, 0]
        packed_draw = attention_dropout_draw(1, 4, 5, 5, segment_index=1)[0]
        assert torch.equal(in_padded, in_packed) and 0 < (in_padded == 0).sum() < in_padded.numel()
        assert torch.equal(padded_draw, packed_draw)
        state.current = (1, 5)    # another layer: another mask
        assert not torch.equal(attention_dropout_draw(1, 4, 5, 5, segment_index=1)[0], packed_draw)
    finally:
        current_job().keyed_randomness = None
