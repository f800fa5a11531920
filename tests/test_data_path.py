"""The trainer's --data-path side: dataset checks, vocabulary size from the tokenizer or the data, --split, and the
train/validation datasets built by megatron-core's BlendedMegatronDatasetBuilder."""

from __future__ import annotations

import shutil

import numpy
import pytest

from megatron_app.train.args import UsageError, parse_args
from test_preprocess_data import build_tiny_corpus

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed", "ignore::UserWarning")

DOCUMENTS = 200


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tiny corpus, preprocessed with its own BPE (vocabulary 300, ids < 300)."""
    from megatron_app.data.preprocess import TokenizerSpec, preprocess

    directory = tmp_path_factory.mktemp("data")
    corpus = build_tiny_corpus(directory, documents=DOCUMENTS)
    spec = TokenizerSpec(vocab_file=str(corpus["vocab"]), merge_file=str(corpus["merges"]))
    _, prefixes = preprocess(str(corpus["corpus"]), str(directory / "tiny"), spec, append_eod=True)
    corpus["prefix"] = prefixes["text"]
    return corpus


def _parse(*argv, world="1"):
    return parse_args([str(a) for a in argv], environ={"WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1"})


def _bad(*argv, world="1"):
    with pytest.raises(UsageError) as info:
        _parse(*argv, world=world)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_vocab_size_comes_from_the_data_or_the_tokenizer_padded_like_megatron(data):
    from megatron_app.data.indexed_data import inspect_indexed_dataset

    info = inspect_indexed_dataset(data["prefix"])
    assert info.documents == DOCUMENTS and 250 < info.max_token_id < 300
    assert _parse("--data-path", data["prefix"]).vocab_size == 384           # max id + 1, up to 128
    assert _parse("--data-path", data["prefix"], "--tensor_parallel", "2", "--num-attention-heads", "4",
                  world="2").vocab_size == 512                               # up to 128 x T
    assert _parse("--data-path", data["prefix"], "--make-vocab-size-divisible-by", "1").vocab_size == \
        info.max_token_id + 1
    from_tokenizer = _parse("--data-path", data["prefix"], "--vocab-file", data["vocab"], "--merge-file",
                            data["merges"], "--make-vocab-size-divisible-by", "1")
    assert from_tokenizer.vocab_size == 300                                  # the tokenizer's size wins
    assert _parse("--tokenizer-json", data["tokenizer_json"]).vocab_size == 384  # mock data, real vocabulary
    assert _parse().vocab_size == 1024                                       # mock data default
    assert _parse("--data-path", data["prefix"], "--vocab-size", "300").vocab_size == 300


def test_a_vocab_size_below_the_data_is_refused(data):
    message = _bad("--data-path", data["prefix"], "--vocab-size", "256")
    assert "--vocab-size 256 is smaller than the data's largest token id" in message
    message = _bad("--vocab-file", data["vocab"], "--merge-file", data["merges"], "--vocab-size", "64")
    assert message == "--vocab-size 64 is smaller than the tokenizer's vocabulary (300)"
    assert "--merge-file" in _bad("--vocab-file", data["vocab"])


def _copy_dataset(data, tmp_path, name):
    target = tmp_path / name
    for suffix in (".bin", ".idx"):
        shutil.copy(data["prefix"] + suffix, str(target) + suffix)
    return target


def test_an_idx_and_bin_that_disagree_are_refused(data, tmp_path):
    truncated = _copy_dataset(data, tmp_path, "truncated")
    with open(f"{truncated}.bin", "r+b") as handle:
        handle.truncate(1000)
    message = _bad("--data-path", truncated)
    assert f"{truncated}.bin has 1000 bytes" in message and "does not belong together" in message

    garbage = _copy_dataset(data, tmp_path, "garbage")
    with open(f"{garbage}.idx", "r+b") as handle:
        handle.write(b"NOTANIDX!")
    assert f"{garbage}.idx is not a readable Megatron index" in _bad("--data-path", garbage)

    (tmp_path / "half.idx").write_bytes(open(data["prefix"] + ".idx", "rb").read())
    assert "half.bin does not exist" in _bad("--data-path", tmp_path / "half")


def test_split_is_checked_against_the_data(data):
    assert "must be up to three non-negative numbers" in _bad("--data-path", data["prefix"], "--split", "a,b")
    assert "TRAIN > 0" in _bad("--data-path", data["prefix"], "--split", "0,1,0")
    message = _bad("--data-path", data["prefix"], "--split", "1,0,0", "--eval-interval", "5")
    assert "gives the validation split no share" in message
    # 0.1% of 200 documents rounds to none: Megatron's dataset would spin forever on that split.
    message = _bad("--data-path", data["prefix"], "--split", "999,1,0", "--eval-interval", "5")
    assert "leaves the validation split of" in message and "200 documents" in message
    # Without evaluation the validation split is never read, so it may be empty.
    assert _parse("--data-path", data["prefix"], "--split", "999,1,0").split == "999,1,0"
    assert "--eval-iters must be a positive integer" in _bad("--eval-interval", "2", "--eval-iters", "0")
    assert "--save-interval needs --save DIR" in _bad("--save-interval", "5")


def test_train_and_validation_datasets_come_from_their_own_documents(data):
    from megatron_app.train.data import build_data_iterators, build_datasets

    args = _parse("--data-path", data["prefix"], "--seq-length", "32", "--global-batch-size", "8",
                  "--micro-batch-size", "2", "--iters", "20", "--eval-interval", "10", "--eval-iters", "3")
    train, valid = build_datasets(args)
    assert len(train) >= 20 * 8 and len(valid) >= 3 * 8
    # Megatron's builder rounds the split bookends: documents [0, 190) train, [190, 200) validate.
    assert (train.indices.min(), train.indices.max()) == (0, 189)
    assert (valid.indices.min(), valid.indices.max()) == (190, 199)
    batch = next(build_data_iterators(args, 1, dp_rank=0, dataset=valid, num_samples=24))
    assert batch["tokens"].shape == (2, 32) and int(batch["tokens"].max()) < args.vocab_size
    assert (batch["labels"][:, :-1] == batch["tokens"][:, 1:]).all()

    no_eval = _parse("--data-path", data["prefix"], "--seq-length", "32", "--iters", "2")
    assert build_datasets(no_eval)[1] is None


def test_weighted_blend_draws_from_both_datasets(data, tmp_path):
    from megatron_app.train.data import build_datasets

    other = _copy_dataset(data, tmp_path, "other")
    args = _parse("--data-path", "1", data["prefix"], "3", other, "--seq-length", "32", "--global-batch-size", "8",
                  "--micro-batch-size", "2", "--iters", "50")
    train, _ = build_datasets(args)
    shares = numpy.bincount(train.dataset_index[:400], minlength=2) / 400
    assert shares[1] == pytest.approx(0.75, abs=0.05)
    assert "weight 'x' is not a number" in _bad("--data-path", "x", data["prefix"], "1", other)


def _damaged(data, tmp_path, name, damage):
    target = _copy_dataset(data, tmp_path, name)
    damage(target)
    return target


def _truncate(suffix, size):
    def damage(target):
        with open(f"{target}{suffix}", "r+b") as handle:
            handle.truncate(size)
    return damage


def _pair_with_other_index(data, tmp_path):
    """A .bin with the .idx of another (smaller) corpus: both files whole, but they do not belong together."""
    from megatron_app.data.preprocess import TokenizerSpec, preprocess

    other = tmp_path / "other"
    other.mkdir()
    corpus = build_tiny_corpus(other, documents=20)
    spec = TokenizerSpec(vocab_file=str(corpus["vocab"]), merge_file=str(corpus["merges"]))
    _, prefixes = preprocess(str(corpus["corpus"]), str(other / "tiny"), spec, append_eod=True)

    def damage(target):
        shutil.copy(prefixes["text"] + ".idx", f"{target}.idx")
    return damage


@pytest.mark.parametrize("case", ["truncated-idx-header", "truncated-idx-arrays", "empty-bin", "empty-idx",
                                  "mismatched-pair"])
def test_a_damaged_pair_ends_in_one_line_naming_the_file_and_nothing_after(data, tmp_path, case):
    """Through the real entry point: the run's stderr is our one line; megatron-core's IndexedDataset.__del__ on a
    half-built reader used to add 'Exception ignored ... AttributeError' tracebacks after it."""
    import os
    import subprocess
    import sys

    damage, file_named, fragment = {
        "truncated-idx-header": (_truncate(".idx", 20), ".idx", "truncated header"),
        "truncated-idx-arrays": (_truncate(".idx", 200), ".idx", "is truncated: its header counts"),
        "empty-bin": (_truncate(".bin", 0), ".bin", "is empty"),
        "empty-idx": (_truncate(".idx", 0), ".idx", "truncated header, 0 bytes"),
        "mismatched-pair": (_pair_with_other_index(data, tmp_path) if case == "mismatched-pair" else None, ".bin",
                            "does not belong together"),
    }[case]
    prefix = _damaged(data, tmp_path, case, damage)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, WORLD_SIZE="1", PYTHONPATH=repo, PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", "--data-path", str(prefix),
                             "--check-config"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{prefix}{file_named}" in lines[0] and fragment in lines[0], lines[0]


# --- read as Megatron-Core reads them, without importing it ------------------------------------------------------

@pytest.mark.parametrize("dtype", [numpy.uint16, numpy.int32, numpy.int64])
def test_the_index_reads_as_megatrons_reader_reads_it(data, tmp_path, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    from megatron_app.data.indexed_data import _read_index

    prefixes = [data["prefix"]]
    if dtype is not numpy.uint16:        # another token type, documents of several sequences, an empty sequence
        built = str(tmp_path / f"built_{numpy.dtype(dtype).name}")
        builder = IndexedDatasetBuilder(built + ".bin", dtype=dtype)
        rng = numpy.random.default_rng(3)
        for document in range(7):
            for _ in range(1 + document % 3):
                builder.add_item(torch_tensor(rng.integers(0, 5000, size=int(rng.integers(0, 40))), dtype))
            builder.end_document()
        builder.finalize(built + ".idx")
        prefixes.append(built)
    for prefix in prefixes:
        theirs = IndexedDataset(prefix, mmap=True).index
        ours = _read_index(prefix)
        assert ours.dtype == theirs.dtype
        for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
            assert numpy.array_equal(getattr(ours, name), getattr(theirs, name)), (prefix, name)


def torch_tensor(values, dtype):
    import torch

    return torch.from_numpy(numpy.asarray(values, dtype=dtype))


@pytest.mark.parametrize("split", ["949,50,1", "99,1,0", "1,0,0", "1", "2,1", "0.9,0.1", ".5/.25/.25", "3, 3, 3",
                                   "1000,1,1", "7/0/3", "1,2,3"])
def test_the_split_matrix_is_megatrons(split):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    from megatron_app.data.indexed_data import split_matrix_of

    assert split_matrix_of(split) == convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def test_a_split_megatron_would_read_otherwise_is_refused(data):
    # Megatron takes every run of digits and dots: "1e-3" would be 1 and 3, not a thousandth
    assert "must be up to three non-negative numbers" in _bad("--data-path", data["prefix"], "--split", "1e-3")


@pytest.mark.parametrize("blend", [["a"], ["a", "b", "c"], ["1", "a", "3", "b"], ["0.5", " a ", "2", "b"],
                                   ["x", "a"], ["a", "b"]])
def test_the_blends_prefixes_are_megatrons(blend):
    from megatron.core.datasets.utils import get_blend_from_list

    from megatron_app.data.indexed_data import blend_prefixes

    assert blend_prefixes(blend) == get_blend_from_list(blend)[0]


def test_checking_a_data_path_imports_no_megatron_core(data):
    """--check-config with --data-path (what every launcher runs before the ranks): no megatron-core import, which
    took 12-16 s of each launch on an H200 host."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys\nfrom megatron_app.train.__main__ import main\n"
            f"main(['--data-path', {data['prefix']!r}, '--split', '99,1,0', '--eval-interval', '5', "
            "'--check-config'])\nprint(sorted(m for m in sys.modules if m.startswith('megatron.')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, WORLD_SIZE="1", PYTHONPATH=repo, PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr
    assert "config ok" in result.stdout and result.stdout.strip().splitlines()[-1] == "[]", result.stdout
