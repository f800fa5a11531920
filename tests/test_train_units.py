"""In-process unit tests of megatron_app.train's building blocks (no process group needed)."""

import json
import math
import os

import numpy
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")


# --- sharding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("partition_dim, stride", [(0, 1), (1, 1), (0, 2), (0, 3)])
def test_take_shard_matches_megatron_cpu_split_and_merge_inverts(partition_dim, stride):
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    from megatron_app.train.sharding import ShardInfo, merge_shards, take_shard

    tp_size = 2
    full = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6)
    info = ShardInfo(partition_dim, stride)
    shards = []
    for rank in range(tp_size):
        local_shape = list(full.shape)
        local_shape[partition_dim] //= tp_size
        megatron_shard = torch.empty(local_shape)
        _initialize_affine_weight_cpu(
            megatron_shard, full.shape[0], full.shape[1], local_shape[partition_dim], partition_dim,
            lambda t: t.copy_(full), stride=stride, rank=rank, world_size=tp_size)
        ours = take_shard(full, info, rank, tp_size)
        assert torch.equal(ours, megatron_shard)
        assert megatron_shard.partition_dim == partition_dim  # Megatron tags the param as we read it
        assert ShardInfo.of(megatron_shard) == info
        shards.append(ours)
    assert torch.equal(merge_shards(shards, info), full)


def test_replicated_parameter_is_not_split():
    from megatron_app.train.sharding import ShardInfo, full_shape, take_shard

    info = ShardInfo.of(torch.nn.Parameter(torch.ones(4)))
    assert not info.is_sharded
    assert full_shape((4,), info, 8) == (4,)
    assert torch.equal(take_shard(torch.ones(4), info, 1, 2), torch.ones(4))


# --- deterministic initialisation --------------------------------------------------------------

@pytest.fixture(scope="module")
def config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4, init_method_std=0.02,
                             cuda_graph_scope=[])


def test_init_rules_follow_megatron_distributions(config):
    from megatron_app.train.weights import draw_full_parameter

    def draw(name, shape=(256, 256)):
        return draw_full_parameter(name, shape, config, seed=3)

    assert draw("decoder.layers.3.self_attention.linear_qkv.weight").std().item() == pytest.approx(0.02, rel=0.05)
    assert draw("decoder.layers.3.mlp.linear_fc2.weight").std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert draw("decoder.layers.3.self_attention.linear_proj.weight").std().item() == pytest.approx(0.005, rel=0.05)
    assert draw("embedding.word_embeddings.weight").std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(draw("decoder.layers.0.input_layernorm.weight", (8,)) == 1)
    assert torch.all(draw("decoder.final_layernorm.bias", (8,)) == 0)
    assert torch.all(draw("decoder.layers.1.mlp.linear_fc1.bias", (8,)) == 0)
    with pytest.raises(ValueError, match="no initialisation rule"):
        draw("decoder.layers.0.mystery_scale", (3,))


def test_each_global_name_has_its_own_reproducible_stream(config):
    from megatron_app.train.weights import draw_full_parameter, stable_seed

    a = draw_full_parameter("decoder.layers.0.mlp.linear_fc1.weight", (16, 8), config, seed=1)
    again = draw_full_parameter("decoder.layers.0.mlp.linear_fc1.weight", (16, 8), config, seed=1)
    other_layer = draw_full_parameter("decoder.layers.1.mlp.linear_fc1.weight", (16, 8), config, seed=1)
    other_seed = draw_full_parameter("decoder.layers.0.mlp.linear_fc1.weight", (16, 8), config, seed=2)
    assert torch.equal(a, again)
    assert not torch.equal(a, other_layer) and not torch.equal(a, other_seed)
    assert stable_seed(1, "x") == stable_seed(1, "x") < 2 ** 63


# --- CPU attention -----------------------------------------------------------------------------

def _reference_attention(q, k, v, scale, keep=None):
    """softmax(q k^T * scale + mask) v on [s, b, h, d] inputs, written out by hand."""
    s = q.size(0)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if keep is None else keep
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(dim=-1), v)
    return out.reshape(s, q.size(1), -1)


def test_sdpa_core_attention_is_causal_and_handles_grouped_queries():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_app.train.attention import SdpaCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            attention_dropout=0.0, cuda_graph_scope=[])
    attention = SdpaCoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 4, 8, generator=generator)
    k = torch.randn(5, 3, 2, 8, generator=generator)
    v = torch.randn(5, 3, 2, 8, generator=generator)
    out = attention(q, k, v, attention_mask=None)
    assert out.shape == (5, 3, 32)
    expected = _reference_attention(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), 1 / math.sqrt(8))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    # Causality: changing the last position leaves earlier outputs alone.
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 1.0
    v2[-1] += 1.0
    torch.testing.assert_close(attention(q, k2, v2, None)[:-1], out[:-1])


def test_sdpa_core_attention_padding_mask_uses_megatron_polarity():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_app.train.attention import SdpaCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0,
                            cuda_graph_scope=[])
    attention = SdpaCoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.padding, attention_type="self")
    q, k, v = (torch.randn(4, 1, 2, 8) for _ in range(3))
    masked_out = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    masked_out[..., 3] = True  # Megatron: True = do not attend to key 3
    expected = _reference_attention(q, k, v, 1 / math.sqrt(8), keep=~masked_out[0, 0])
    torch.testing.assert_close(attention(q, k, v, masked_out), expected, rtol=1e-5, atol=1e-6)


def test_sdpa_attention_dropout_draws_from_the_default_stream(monkeypatch):
    """The mask comes from the default stream (keyed per layer and microbatch by runtime.keyed_randomness), the same
    on every tensor-parallel rank, so it does not depend on which stream Megatron's tracker would hand out."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_app.train.attention import SdpaCoreAttention

    def run_with_seed(seed):
        torch.manual_seed(seed)
        return attention(q, k, v, None)

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.5,
                            cuda_graph_scope=[])
    attention = SdpaCoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    q, k, v = (torch.randn(6, 2, 2, 8) for _ in range(3))
    a, b, c = run_with_seed(1), run_with_seed(1), run_with_seed(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    attention.eval()
    assert not torch.equal(attention(q, k, v, None), a)  # no dropout outside training


# --- RNG tracker and CUDA-name shim ------------------------------------------------------------

def test_cpu_rng_tracker_forks_named_streams_and_restores_outer_state():
    from megatron_app.train.init import CpuRNGStatesTracker

    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 11)
    with pytest.raises(ValueError):
        tracker.add("other", 11)
    torch.manual_seed(5)
    outer_expected = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork():
        first = torch.rand(3)
    with tracker.fork():
        second = torch.rand(3)
    assert torch.equal(torch.rand(3), outer_expected)  # outer stream untouched by the forks
    stream = torch.Generator().manual_seed(11)
    assert torch.equal(first, torch.rand(3, generator=stream))
    assert torch.equal(second, torch.rand(3, generator=stream))  # the named stream continues


def test_cuda_device_arguments_run_on_cpu_inside_the_shim():
    from megatron_app.train.cpu_compat import CudaDeviceToCpu

    with CudaDeviceToCpu():
        a = torch.zeros([], dtype=torch.int, device="cuda")
        b = torch.ones(2, device=torch.device("cuda", 0))
        c = torch.full((2,), 3.0, device="cpu")
    assert a.device.type == b.device.type == c.device.type == "cpu"


# --- data ----------------------------------------------------------------------------------------

def test_microbatch_sampler_splits_each_step_over_data_parallel_ranks():
    from megatron_app.train.data import MicrobatchSampler

    single = list(MicrobatchSampler(24, micro_batch_size=2, dp_rank=0, dp_size=1))
    per_rank = [list(MicrobatchSampler(24, micro_batch_size=2, dp_rank=r, dp_size=3)) for r in range(3)]
    assert len(single) == 12 and all(len(steps) == 4 for steps in per_rank)
    for step in range(4):
        together = sorted(i for r in range(3) for i in per_rank[r][step])
        assert together == sorted(i for mb in single[3 * step:3 * step + 3] for i in mb)
    resumed = list(MicrobatchSampler(24, 2, 1, 3, consumed_samples=12))
    assert resumed == per_rank[1][2:]
    with pytest.raises(ValueError):
        MicrobatchSampler(24, 2, dp_rank=3, dp_size=3)


def _data_args(**overrides):
    from types import SimpleNamespace

    base = dict(seq_length=16, vocab_size=64, iters=2, global_batch_size=8, micro_batch_size=2,
                data_parallel=1, seed=5, data_path=None)
    base.update(overrides)
    return SimpleNamespace(**base)


def test_mock_data_iterators_agree_across_chunks_and_data_parallel_ranks():
    from megatron_app.train.data import build_data_iterators

    chunks = build_data_iterators(_data_args(), num_chunks=2, dp_rank=0)
    assert isinstance(chunks, list) and len(chunks) == 2
    a, b = next(chunks[0]), next(chunks[1])
    assert a["tokens"].shape == (2, 16) and a["tokens"].dtype == torch.int64
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])
    assert torch.all(a["loss_mask"] == 1)
    assert int(a["tokens"].max()) < 64

    single = build_data_iterators(_data_args(), num_chunks=1, dp_rank=0)
    first_two = [next(single), next(single)]
    halves = [next(build_data_iterators(_data_args(data_parallel=2, global_batch_size=8), 1, dp_rank=r))
              for r in range(2)]
    assert torch.equal(torch.cat([h["tokens"] for h in halves]),
                       torch.cat([mb["tokens"] for mb in first_two]))
    assert sum(1 for _ in single) == 2 * 8 // 2 - 2  # exactly iters * GBS samples, no more


def test_indexed_dataset_via_data_path(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_app.train.args import parse_args
    from megatron_app.train.data import build_data_iterators

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for doc in range(40):
        builder.add_document(torch.arange(doc, doc + 30) % 63, [30])
    builder.finalize(prefix + ".idx")

    args = parse_args(["--data-path", prefix, "--seq-length", "16", "--vocab-size", "64", "--iters", "2",
                       "--global-batch-size", "4", "--schedule", "megatron"], environ={"WORLD_SIZE": "1"})
    batch = next(build_data_iterators(args, 1, dp_rank=0))
    tokens, labels = batch["tokens"], batch["labels"]
    assert tokens.shape == (2, 16)
    # Documents are runs of consecutive ids, so within a sample the label is mostly token + 1.
    assert (labels[:, :-1] == tokens[:, 1:]).all()
    assert ((labels - tokens) % 63 == 1).float().mean() > 0.8


# --- forward step and loss ---------------------------------------------------------------------

class _StubChunk(torch.nn.Module):
    """Stands in for a GPTModel chunk: records what forward_step passed in."""

    def __init__(self, pre_process, post_process):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.calls = []

    def forward(self, tokens, position_ids, attention_mask, labels=None):
        self.calls.append((tokens, position_ids, attention_mask, labels))
        return torch.full((2, 4), 2.0) * self.weight


def _batches():
    while True:
        yield {"tokens": torch.zeros(2, 4, dtype=torch.long), "position_ids": torch.arange(4).repeat(2, 1),
               "labels": torch.ones(2, 4, dtype=torch.long), "loss_mask": torch.tensor([[1., 1, 0, 0], [1, 1, 1, 1]])}


@pytest.mark.parametrize("pre, post, draws", [(True, False, 1), (False, False, 0), (False, True, 1), (True, True, 1)])
def test_forward_step_reads_data_only_where_needed(pre, post, draws):
    from megatron_app.train.step import forward_step

    source = _batches()
    consumed = []

    def counting():
        for batch in source:
            consumed.append(1)
            yield batch

    chunk = _StubChunk(pre, post)
    output, loss_fn = forward_step(counting(), chunk)
    assert len(consumed) == draws
    tokens, position_ids, mask, labels = chunk.calls[0]
    assert (tokens is not None) == pre and (position_ids is not None) == pre
    assert (labels is not None) == post and mask is None
    if post:
        loss_sum, num_tokens, report = loss_fn(output)
        assert loss_sum.item() == pytest.approx(2.0 * 6) and int(num_tokens) == 6
        assert report["lm loss"].tolist() == [12.0, 6.0]
        loss_sum.backward()
        assert chunk.weight.grad.item() == pytest.approx(12.0)


def test_forward_step_without_iterator_on_first_stage_is_a_clear_error():
    from megatron_app.train.step import forward_step

    with pytest.raises(ValueError, match="needs data"):
        forward_step(None, _StubChunk(True, False))


# --- logging -------------------------------------------------------------------------------------

def test_json_log_written_atomically(tmp_path):
    from megatron_app.train.report import write_json_atomic

    path = tmp_path / "sub" / "log.json"
    write_json_atomic(str(path), {"iterations": [1]})
    write_json_atomic(str(path), {"iterations": [1, 2]})
    assert json.loads(path.read_text()) == {"iterations": [1, 2]}
    assert os.listdir(path.parent) == ["log.json"]


def test_keyed_dropout_gives_back_the_generator_state_it_borrowed():
    """Layers draw keyed masks, and the default generator continues after the forward as if they had not run."""
    from megatron_app.runtime import keyed_randomness

    class Layer(torch.nn.Module):
        def __init__(self, layer_number):
            super().__init__()
            self.layer_number = layer_number

        def forward(self, x):
            return x + torch.rand(x.shape)

    class Chunk(torch.nn.Module):
        pre_process = False

        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([Layer(1), Layer(2)])

        def forward(self, x):
            for layer in self.decoder.layers:
                x = layer(x)
            return x

    chunk = Chunk()
    keyed_randomness.enable_keyed_randomness([chunk], seed=3)
    try:
        with keyed_randomness.microbatch_scope(0):
            torch.manual_seed(11)
            first = chunk(torch.zeros(4))
            after_forward = torch.rand(3)
            torch.manual_seed(99)
            again = chunk(torch.zeros(4))
    finally:
        keyed_randomness.disable_keyed_randomness()
    torch.manual_seed(11)
    assert torch.equal(after_forward, torch.rand(3))  # the outer stream is untouched by the layers' draws
    assert torch.equal(first, again)                   # the masks are keyed, not drawn from the outer stream
