"""--variable-seq-lengths: the real corpus, one document per sample, padding to each microbatch's longest sample,
and the lengths the trainer tells the schedule."""

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_app.train.args import UsageError, parse_args
from megatron_app.data.corpus import LengthStats, indexed_document_lengths, paragraphs
from real_corpus import TOOL

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")


def test_paragraphs_split_on_blank_lines_and_drop_rules():
    text = "First para\nstill first.\n\n  \n-----\n\nSecond one.\r\n\r\nThird.\n"
    assert paragraphs(text) == ["First para\nstill first.", "Second one.", "Third."]


def test_length_stats_of_known_lengths():
    stats = LengthStats.of([1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    assert (stats.documents, stats.tokens, stats.minimum, stats.maximum) == (10, 1023, 1, 512)
    assert stats.median == 32 and stats.p10 == 2 and stats.p90 == 512
    assert stats.log_sd == pytest.approx(math.log(2) * math.sqrt(8.25), rel=1e-9)   # sd of 0..9, times ln 2


def test_make_corpus_writes_a_real_length_distribution(real_corpus):
    stats = json.loads((real_corpus["dir"] / "stats.json").read_text())["tokens_per_document"]
    lengths = indexed_document_lengths(real_corpus["data_path"])
    assert stats["documents"] == len(lengths) > 2000
    assert stats["maximum"] == max(lengths) and stats["minimum"] == min(lengths) >= 2
    # a heavy-tailed natural distribution, not a constant or a narrow band
    assert stats["maximum"] > 20 * stats["median"] and stats["log_sd"] > 0.8
    assert "--data-path" in real_corpus["output"]
    first = json.loads((real_corpus["dir"] / "corpus.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "text"} and first["text"].strip()


def test_make_corpus_refuses_a_bad_vocabulary_size(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), "--output-dir", str(tmp_path), "--vocab-size", "10"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--vocab-size" in result.stderr


def test_variable_seq_lengths_needs_data_and_implies_per_token_loss(real_corpus):
    with pytest.raises(UsageError, match="--variable-seq-lengths needs --data-path"):
        parse_args(["--variable-seq-lengths"], environ={})
    args = parse_args(["--variable-seq-lengths", "--data-path", real_corpus["data_path"],
                       "--tokenizer-json", real_corpus["tokenizer_json"]], environ={})
    assert args.calculate_per_token_loss
    assert not parse_args([], environ={}).calculate_per_token_loss


def _args(corpus, **overrides):
    values = dict(seq_length=48, vocab_size=1024, seed=1234, iters=3, global_batch_size=8, micro_batch_size=2,
                  data_parallel=1, num_microbatches=4, data_path=[corpus["data_path"]], split="949,50,1",
                  eval_interval=None, eval_iters=1, variable_seq_lengths=True)
    values.update(overrides)
    values["num_microbatches"] = values["global_batch_size"] // (values["micro_batch_size"] * values["data_parallel"])
    return SimpleNamespace(**values)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_microbatches_are_padded_to_their_longest_document_and_told_in_data_order(real_corpus, dp_size):
    from megatron_app.train.data import build_data_iterators, build_datasets, global_batch_tokens, microbatch_lengths
    from megatron_app.data.document_data import DocumentDataset

    args = _args(real_corpus, data_parallel=dp_size)
    dataset = build_datasets(args)[0]
    assert isinstance(dataset, DocumentDataset)
    seen = set()
    real_tokens = [0] * args.iters
    for dp_rank in range(dp_size):
        batches = build_data_iterators(args, 1, dp_rank, dataset=dataset)
        for iteration in range(args.iters):
            told = microbatch_lengths(args, dataset, dp_rank, iteration * args.global_batch_size)
            assert len(told) == args.num_microbatches
            for length in told:
                batch = next(batches)
                assert batch["tokens"].shape == batch["labels"].shape == (args.micro_batch_size, length)
                real = batch["loss_mask"].sum(dim=1).long()
                real_tokens[iteration] += real.sum().item()
                assert real.max().item() == length <= args.seq_length
                for row, count in enumerate(real.tolist()):
                    assert batch["loss_mask"][row, :count].all() and not batch["loss_mask"][row, count:].any()
                    assert (batch["tokens"][row, 1:count] == batch["labels"][row, :count - 1]).all()
                    seen.add(tuple(batch["tokens"][row, :count].tolist()))
    assert len(seen) > args.iters * args.global_batch_size // 2   # distinct documents, not one repeated
    assert real_tokens == [global_batch_tokens(args, dataset, it * args.global_batch_size) for it in range(args.iters)]


def test_a_sample_is_one_document_truncated_at_seq_length(real_corpus):
    from megatron_app.train.data import build_datasets

    args = _args(real_corpus)
    dataset = build_datasets(args)[0]
    document_lengths = indexed_document_lengths(real_corpus["data_path"])
    truncated = 0
    for index in range(len(dataset)):
        document = int(dataset.sample_documents[index])
        expected = min(document_lengths[document], args.seq_length + 1) - 1
        assert dataset.sample_length(index) == expected
        truncated += document_lengths[document] > args.seq_length + 1
    sample = dataset[0]
    ids = dataset.dataset.get(int(dataset.sample_documents[0]))
    assert sample["tokens"].tolist() == ids[:sample["tokens"].numel()].tolist()
    assert 0 < truncated < len(dataset)


def test_fixed_length_data_tells_nothing_so_lengths_told_by_an_embedding_loop_stand():
    from megatron_app.runtime import set_microbatch_lengths, take_microbatch_lengths
    from megatron_app.train.data import microbatch_lengths
    from megatron_app.runtime.next_call import call_plan_of
    from megatron_app.train.forward_backward import with_told_lengths

    args = SimpleNamespace(seq_length=64, num_microbatches=3, variable_seq_lengths=False)
    assert microbatch_lengths(args, None, 0, 0) is None
    set_microbatch_lengths([5, 9, 7])
    loader = iter([])
    assert with_told_lengths("app", loader, microbatch_lengths(args, None, 0, 0)) is loader
    assert take_microbatch_lengths(3) == (5, 9, 7)
    assert call_plan_of(with_told_lengths("app", [loader, None], [4, 8, 6])).tokens == (4, 8, 6)
    assert with_told_lengths("megatron", loader, [4, 8, 6]) is loader


def test_padding_does_not_change_the_real_tokens_outputs():
    """Causal attention in the CPU attention module: a sample's logits are the same alone and padded."""
    from megatron_app.train.attention import SdpaCoreAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0,
                               use_cpu_initialization=True)
    attention = SdpaCoreAttention(config, 1, AttnMaskType.causal, "self")
    torch.manual_seed(0)
    q, k, v = (torch.randn(5, 1, 2, 8) for _ in range(3))
    alone = attention(q, k, v, None)
    padded = attention(*(torch.cat([t, torch.randn(3, 1, 2, 8)]) for t in (q, k, v)), None)
    assert torch.allclose(padded[:5], alone, atol=1e-6)


@pytest.mark.parametrize("composition", ["loader", "packed"])
def test_train_step_tells_the_schedule_the_tokens_of_the_microbatches_it_then_feeds(real_corpus, monkeypatch,
                                                                                    composition):
    """The composition is planned before the call (which tells the schedule each microbatch's tokens: rows x
    longest padded, the documents' sum packed) and the call gets exactly those microbatches."""
    import contextlib

    from megatron_app.runtime.job import current_job
    from megatron_app.runtime.next_call import call_plan_of
    from megatron_app.train import loop
    from megatron_app.train.data import build_datasets, global_batch_tokens

    args = _args(real_corpus, schedule="app", dump_grads=None, model_chunks=1, composition=composition)
    dataset = build_datasets(args)[0]
    told, fed = [], []
    monkeypatch.setattr(loop, "with_told_lengths", lambda schedule, it, lengths: pytest.fail("told twice"))
    monkeypatch.setattr(loop, "reduce_lm_loss", lambda entries: None)
    monkeypatch.setattr(loop, "optimizer_span", lambda schedule, iteration: contextlib.nullcontext())

    def forward_backward(*, data_iterator, num_microbatches, **_):
        # what the runtime takes: the plan the call's data iterator carries, nothing waiting on the job
        assert current_job().next_call.take(num_microbatches) is None
        told.append(list(call_plan_of(data_iterator).check_count(num_microbatches).tokens))
        batches = [next(data_iterator) for _ in range(num_microbatches)]
        assert next(data_iterator, None) is None
        fed.append(batches)
        return []

    optimizer = SimpleNamespace(zero_grad=lambda set_to_none: None, step=lambda: True, param_groups=[{"lr": 1e-3}])
    scheduler = SimpleNamespace(optimizer=optimizer, step=lambda increment: None)
    trainer = loop.Trainer(args, [], optimizer, scheduler, None, forward_backward, reporter=None,
                           train_dataset=dataset, dp_rank=0)
    for iteration in range(1, args.iters + 1):
        loop.train_step(trainer, iteration)
    assert told == [[batch["tokens"].numel() for batch in batches] for batches in fed] and len(told) == args.iters
    assert len({length for lengths in told for length in lengths}) > 2   # the lengths really vary
    for iteration, batches in enumerate(fed):   # every document token of the global batch, once
        assert sum(batch["loss_mask"].sum().item() for batch in batches) == \
            global_batch_tokens(args, dataset, iteration * args.global_batch_size)
        assert all(batch["tokens"].shape[0] == (1 if composition == "packed" else args.micro_batch_size)
                   for batch in batches)


def test_composition_flag_needs_variable_lengths_and_defaults_to_balanced_except_under_megatrons_schedule(
        real_corpus):
    data = ["--data-path", real_corpus["data_path"], "--tokenizer-json", real_corpus["tokenizer_json"]]
    with pytest.raises(UsageError, match="--composition needs --variable-seq-lengths"):
        parse_args(["--composition", "packed"] + data, environ={})
    assert parse_args(["--variable-seq-lengths"] + data, environ={}).composition == "balanced"
    assert parse_args(["--variable-seq-lengths", "--schedule", "megatron"] + data, environ={}).composition == "loader"
    assert parse_args(["--variable-seq-lengths", "--composition", "packed"] + data, environ={}).composition == "packed"
    with pytest.raises(UsageError, match="balanced needs our schedule"):
        parse_args(["--variable-seq-lengths", "--composition", "balanced", "--schedule", "megatron"] + data,
                   environ={})
