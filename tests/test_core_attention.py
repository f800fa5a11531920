"""The core attention's paths for packed documents: host bounds (no device read), the varlen kernel's wiring (CPU,
with a reference kernel in its place), and on CUDA the flash varlen kernel and keyed dropout on device generators."""

import pytest
import torch

LENGTHS = (7, 3, 12)
BOUNDS = (0, 7, 10, 22)


def _attention(heads=2, query_groups=None, hidden=16, dropout=0.0):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_app.train.attention import SdpaCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, attention_dropout=dropout,
                               num_query_groups=query_groups, use_cpu_initialization=True)
    return SdpaCoreAttention(config, 1, AttnMaskType.causal, "self")


def _qkv(heads, groups, dim, device="cpu", dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(LENGTHS), 1, heads, dim, generator=generator)
    k, v = (torch.randn(sum(LENGTHS), 1, groups, dim, generator=generator) for _ in range(2))
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def test_packed_documents_carry_host_bounds_so_no_device_tensor_is_read():
    """The bounds come from the host: a cu_seqlens that cannot be read back (meta) is never read."""
    from megatron_app.train.attention import packed_documents

    attention = _attention()
    q, k, v = _qkv(2, 2, 8)
    unreadable = torch.empty(len(BOUNDS), dtype=torch.int32, device="meta")
    params = packed_documents(BOUNDS, unreadable, qkv_format="sbhd")
    assert params.max_seqlen_q == 12 and isinstance(params.max_seqlen_q, int)
    packed = attention(q, k, v, None, packed_seq_params=params)
    alone = torch.cat([attention(q[s:e], k[s:e], v[s:e], None) for s, e in zip(BOUNDS[:-1], BOUNDS[1:])])
    assert torch.equal(packed, alone)


def test_packed_seq_params_of_reads_bounds_from_the_batch_before_it_moved():
    from megatron_app.data.document_data import CU_SEQLENS
    from megatron_app.train.step import packed_seq_params_of

    host = {CU_SEQLENS: torch.tensor(BOUNDS, dtype=torch.int32)}
    moved = {CU_SEQLENS: torch.empty(len(BOUNDS), dtype=torch.int32, device="meta")}
    params = packed_seq_params_of(moved, host)
    assert params.bounds == BOUNDS and params.cu_seqlens_q is moved[CU_SEQLENS] and params.max_seqlen_kv == 12
    assert packed_seq_params_of({"tokens": torch.zeros(1)}) is None


@pytest.mark.parametrize("heads,groups", [(2, 2), (4, 2)])
def test_the_varlen_path_hands_the_kernel_every_document_at_once(monkeypatch, heads, groups):
    """The varlen wiring (layout, grouped-query repeat, int max_seqlen, output shape) with a reference kernel in
    place of torch's flash one, which needs CUDA: the same result as one SDPA call per document."""
    from megatron_app.train import attention as attention_module

    calls = []

    def reference_kernel(q, k, v, cu_seqlens, max_len, scale):
        calls.append((tuple(q.shape), tuple(cu_seqlens.tolist()), max_len))
        assert isinstance(max_len, int) and k.shape == q.shape
        bounds = cu_seqlens.tolist()
        out = [torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
            scale=scale).transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(out)

    attention = _attention(heads=heads, query_groups=groups, hidden=8 * heads)
    q, k, v = _qkv(heads, groups, 8)
    params = attention_module.packed_documents(BOUNDS, torch.tensor(BOUNDS, dtype=torch.int32), qkv_format="sbhd")
    per_document = attention(q, k, v, None, packed_seq_params=params)
    monkeypatch.setattr(attention_module, "varlen_kernel", lambda: reference_kernel)
    monkeypatch.setattr(attention_module.SdpaCoreAttention, "_takes_varlen_kernel", lambda self, query: True)
    through_varlen = attention(q, k, v, None, packed_seq_params=params)
    assert calls == [((22, heads, 8), BOUNDS, 12)]
    assert through_varlen.shape == per_document.shape == (22, 1, heads * 8)
    assert torch.allclose(through_varlen, per_document, atol=1e-6)


def test_the_varlen_kernel_is_never_taken_on_cpu():
    """CPU rows take one SDPA call per document, whatever the dtype or dropout (CUDA rows: the tests below)."""
    for dropout in (0.0, 0.1):
        attention = _attention(dropout=dropout)
        for dtype in (torch.float32, torch.bfloat16):
            assert not attention._takes_varlen_kernel(torch.zeros(4, 1, 2, 8, dtype=dtype))


@pytest.mark.cuda
def test_cuda_rows_take_the_varlen_kernel_only_in_half_precision_without_dropout():
    from megatron_app.train import attention as attention_module

    assert attention_module.varlen_kernel() is not None, "this torch has no torch.nn.attention.varlen"
    row = torch.zeros(4, 1, 2, 8, device="cuda")
    assert not _attention()._takes_varlen_kernel(row)                              # fp32
    assert _attention()._takes_varlen_kernel(row.bfloat16())
    assert not _attention(dropout=0.1)._takes_varlen_kernel(row.bfloat16())         # training with dropout
    assert _attention(dropout=0.1).eval()._takes_varlen_kernel(row.bfloat16())      # evaluation: no dropout


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_varlen_kernel_matches_per_document_sdpa(dtype):
    """Forward and input gradients of the flash varlen path against per-document SDPA, on CUDA in half precision
    (tolerance: a few ulps of the dtype over these 12-token documents)."""
    from megatron_app.train import attention as attention_module

    assert attention_module.varlen_kernel() is not None, "this torch has no torch.nn.attention.varlen"
    attention = _attention(heads=4, query_groups=2, hidden=256).cuda()
    q, k, v = (t.requires_grad_() for t in _qkv(4, 2, 64, device="cuda", dtype=dtype))
    bounds = torch.tensor(BOUNDS, dtype=torch.int32, device="cuda")
    params = attention_module.packed_documents(BOUNDS, bounds, qkv_format="sbhd")
    assert attention._takes_varlen_kernel(q)
    fused = attention(q, k, v, None, packed_seq_params=params)
    fused.float().square().sum().backward()
    fused_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    reference = attention._per_document_forward(q, k, v, list(BOUNDS))
    reference.float().square().sum().backward()
    tolerance = 4 * torch.finfo(dtype).eps
    assert (fused - reference).abs().max() <= tolerance * reference.abs().max()
    for got, want in zip(fused_grads, (q.grad, k.grad, v.grad)):
        assert (got - want).abs().max() <= 8 * tolerance * want.abs().max()


@pytest.mark.cuda
def test_cuda_keyed_dropout_masks_follow_the_document_on_device_generators():
    """On CUDA the masks are drawn on the GPU from per-document generators: document 42 drops the same positions
    in a padded row as in a packed one, and nothing is drawn on the host."""
    from megatron_app.runtime import keyed_randomness
    from megatron_app.runtime.job import current_job
    from megatron_app.runtime.keyed_randomness import DocumentSegment
    from megatron_app.train.document_dropout import attention_dropout_draw, keyed_hidden_dropout

    state = keyed_randomness.KeyedRandomness(seed=3)
    current_job().keyed_randomness = state
    try:
        keyed_randomness.set_microbatch_documents([[DocumentSegment(7, 0, 0, 8), DocumentSegment(42, 1, 0, 5)],
                                                   [DocumentSegment(9, 0, 0, 3), DocumentSegment(42, 0, 3, 5)]])
        state.current = (0, 4)
        generators = keyed_randomness.document_generators("s", "cuda")
        assert all(g.device.type == "cuda" for _, g in generators)
        in_padded = keyed_hidden_dropout(torch.ones(8, 2, 16, device="cuda"), 0.5, generators)[:5, 1]
        padded_draw = attention_dropout_draw(2, 4, 8, 8, device=torch.device("cuda"))[1, :, :5, :5]
        state.current = (1, 4)
        in_packed = keyed_hidden_dropout(torch.ones(8, 1, 16, device="cuda"), 0.5,
                                         keyed_randomness.document_generators("s", "cuda"))[3:, 0]
        packed_draw = attention_dropout_draw(1, 4, 5, 5, segment_index=1, device=torch.device("cuda"))[0]
        assert in_padded.is_cuda and packed_draw.is_cuda
        assert torch.equal(in_padded, in_packed) and 0 < (in_padded == 0).sum() < in_padded.numel()
        assert torch.equal(padded_draw, packed_draw)
    finally:
        current_job().keyed_randomness = None


def test_thd_packed_rows_attend_as_sbhd_ones():
    """The trainer packs in 'thd' (Megatron squeezes the batch dimension before the core attention and restarts
    rotary positions per document): the same result as the 'sbhd' row, reshaped."""
    from megatron_app.train.attention import packed_documents

    attention = _attention()
    q, k, v = _qkv(2, 2, 8)
    bounds = torch.tensor(BOUNDS, dtype=torch.int32)
    sbhd = attention(q, k, v, None, packed_seq_params=packed_documents(BOUNDS, bounds, qkv_format="sbhd"))
    thd = attention(q.squeeze(1), k.squeeze(1), v.squeeze(1), None, packed_seq_params=packed_documents(BOUNDS, bounds))
    assert torch.equal(thd, sbhd.squeeze(1))
