"""tools/preprocess_data.py: JSON lines -> Megatron .bin/.idx through megatron-core's builder, with a BPE vocabulary
trained here at test time (Hugging Face tokenizers; nothing is downloaded).

Also home of build_tiny_corpus(), which the data and checkpoint tests share.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "preprocess_data.py"
EOD = "<|endoftext|>"
_WORDS = ("the a cat dog bird sat on mat ran to from house tree big small red blue green quickly slowly and but "
          "then saw heard under over near").split()


def tiny_documents(count: int, seed: int = 0):
    """Sentences from a small word list: learnable structure, a few hundred BPE tokens."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 9))]
            sentences.append(" ".join(words).capitalize() + ".")
        documents.append(" ".join(sentences))
    return documents


def build_tiny_corpus(directory: Path, documents: int = 200, vocab_size: int = 300) -> dict:
    """corpus.jsonl plus a byte-level BPE trained on it, saved as GPT-2 files and as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    texts = tiny_documents(documents)
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(texts)))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.model.save(str(directory))   # vocab.json + merges.txt, GPT-2's format
    tokenizer.save(str(directory / "tokenizer.json"))
    return {"corpus": corpus, "vocab": directory / "vocab.json", "merges": directory / "merges.txt",
            "tokenizer_json": directory / "tokenizer.json", "texts": texts}


def _load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _load_tool()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def _gpt2_flags(corpus):
    return ["--vocab-file", str(corpus["vocab"]), "--merge-file", str(corpus["merges"])]


def _run(tool, argv, capsys):
    """main() in-process: (exit status, stdout, stderr)."""
    try:
        status = tool.main([str(a) for a in argv])
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def _outputs(directory: Path, stem: str):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(stem))


def test_gpt2_files_and_tokenizer_json_load_the_same_bpe(corpus):
    from megatron_app.data.text_tokenizers import load_tokenizer

    gpt2 = load_tokenizer(vocab_file=str(corpus["vocab"]), merge_file=str(corpus["merges"]))
    hf = load_tokenizer(tokenizer_json=str(corpus["tokenizer_json"]))
    assert gpt2.kind == "GPT2BPETokenizer" and hf.kind == "HuggingFaceTokenizer"
    assert gpt2.vocab_size == hf.vocab_size == 300
    assert gpt2.eod == hf.eod == hf.backend.token_to_id(EOD)
    for text in corpus["texts"][:40]:
        ids = gpt2.encode(text)
        assert ids == hf.encode(text)
        assert len(ids) < len(text.encode())  # merges were learnt and used
        assert gpt2.decode(ids) == text       # byte-level BPE round-trips exactly


def test_preprocess_writes_a_megatron_indexed_dataset(tool, corpus, tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_app.data.text_tokenizers import load_tokenizer

    status, out, err = _run(tool, ["--input", corpus["corpus"], "--output-prefix", tmp_path / "c",
                                   *_gpt2_flags(corpus), "--append-eod", "--workers", 2, "--log-interval", 64],
                            capsys)
    assert status == 0, err
    prefix = tmp_path / "c_text_document"
    assert _outputs(tmp_path, "c") == ["c_text_document.bin", "c_text_document.idx"]  # no temporary files left
    assert f"--data-path {prefix}" in out
    assert "done: 200 documents" in out
    progress = [line for line in err.splitlines() if "processed" in line]
    assert len(progress) >= 3 and all("docs/s" in line and "MB/s" in line for line in progress)

    tokenizer = load_tokenizer(vocab_file=str(corpus["vocab"]), merge_file=str(corpus["merges"]))
    dataset = IndexedDataset(str(prefix))
    assert len(dataset) == 200 and len(dataset.document_indices) == 201
    assert dataset.index.dtype == numpy.uint16  # Megatron's choice for a vocabulary under 65500
    for i in (0, 1, 117, 199):
        ids = dataset[i].tolist()
        assert ids[-1] == tokenizer.eod
        assert ids[:-1] == tokenizer.encode(corpus["texts"][i])

    # One worker and a tokenizer.json give byte-identical files.
    status, _, err = _run(tool, ["--input", corpus["corpus"], "--output-prefix", tmp_path / "d",
                                 "--tokenizer-json", corpus["tokenizer_json"], "--append-eod"], capsys)
    assert status == 0, err
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"d_text_document{suffix}").read_bytes() == (tmp_path / f"c_text_document{suffix}").read_bytes()


def test_each_json_key_gets_its_own_dataset(tool, corpus, tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    source = tmp_path / "two_keys.jsonl"
    source.write_text("".join(json.dumps({"title": t.split(".")[0], "text": t}) + "\n" for t in corpus["texts"][:10]))
    status, out, err = _run(tool, ["--input", source, "--output-prefix", tmp_path / "k", "--json-keys", "title",
                                   "text", *_gpt2_flags(corpus)], capsys)
    assert status == 0, err
    titles, texts = IndexedDataset(str(tmp_path / "k_title_document")), IndexedDataset(str(tmp_path / "k_text_document"))
    assert len(titles) == len(texts) == 10
    assert all(len(titles[i]) < len(texts[i]) for i in range(10))


def _write_lines(path: Path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"text": "The cat sat on the mat."})


@pytest.mark.parametrize("case, fragment", [
    ("no_vocab", "GPT2BPETokenizer needs --vocab-file"),
    ("missing_vocab", "--vocab-file"),
    ("missing_merges", "--merge-file"),
    ("empty_input", "holds no documents"),
    ("blank_input", "holds no documents"),
    ("not_json", "bad.jsonl:3: not a JSON line"),
    ("not_object", "bad.jsonl:2: not a JSON object (found list)"),
    ("missing_key", "bad.jsonl:2: no 'text' field"),
    ("not_string", "bad.jsonl:2: field 'text' is int, not a string"),
    ("eod_not_in_vocab", "end-of-document token '<nope>' is not in the vocabulary"),
    ("no_input", "does not exist"),
    ("no_output_dir", "does not exist"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tool, corpus, tmp_path, capsys, case, fragment):
    source = tmp_path / "bad.jsonl"
    lines = {
        "not_json": [GOOD, GOOD, "{not json", GOOD],
        "not_object": [GOOD, "[1, 2]"],
        "missing_key": [GOOD, json.dumps({"body": "x"})],
        "not_string": [GOOD, json.dumps({"text": 7})],
        "empty_input": [],
        "blank_input": ["", "   "],
    }.get(case, [GOOD])
    _write_lines(source, lines)
    tokenizer_flags = {
        "no_vocab": [],
        "missing_vocab": ["--vocab-file", tmp_path / "absent.json", "--merge-file", corpus["merges"]],
        "missing_merges": ["--vocab-file", corpus["vocab"], "--merge-file", tmp_path / "absent.txt"],
        "eod_not_in_vocab": [*_gpt2_flags(corpus), "--eod-token", "<nope>"],
    }.get(case, _gpt2_flags(corpus))
    output = tmp_path / ("missing_dir/out" if case == "no_output_dir" else "out")
    argv = ["--input", tmp_path / "absent.jsonl" if case == "no_input" else source, "--output-prefix", output,
            "--append-eod", *tokenizer_flags]
    status, out, err = _run(tool, argv, capsys)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("preprocess_data.py: error: ") and fragment in lines[0], lines[0]
    assert _outputs(tmp_path, "out") == []  # neither final nor temporary files


def test_bad_lines_can_be_skipped_and_are_counted(tool, corpus, tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    source = _write_lines(tmp_path / "mixed.jsonl", [GOOD, "{oops", GOOD, json.dumps({"other": 1}), "", GOOD])
    status, out, err = _run(tool, ["--input", source, "--output-prefix", tmp_path / "m", *_gpt2_flags(corpus),
                                   "--skip-bad-lines"], capsys)
    assert status == 0, err
    assert "done: 3 documents" in out and "skipped 2 bad lines" in out
    assert len(IndexedDataset(str(tmp_path / "m_text_document"))) == 3


def test_a_failed_run_leaves_earlier_outputs_untouched(tool, corpus, tmp_path, capsys):
    argv = ["--output-prefix", tmp_path / "p", *_gpt2_flags(corpus), "--workers", 2]
    status, _, err = _run(tool, ["--input", corpus["corpus"], *argv], capsys)
    assert status == 0, err
    before = {name: (tmp_path / name).read_bytes() for name in _outputs(tmp_path, "p")}
    # Many good lines, then a bad one: the failure comes after output has been written to temporary files.
    broken = _write_lines(tmp_path / "broken.jsonl", corpus["corpus"].read_text().splitlines()[:150] + ["{cut"])
    status, _, err = _run(tool, ["--input", broken, *argv], capsys)
    assert status == 2 and "broken.jsonl:151" in err
    assert {name: (tmp_path / name).read_bytes() for name in _outputs(tmp_path, "p")} == before


def test_cli_reports_a_missing_merge_file_in_one_line(corpus, tmp_path):
    result = subprocess.run(
        [sys.executable, str(TOOL), "--input", str(corpus["corpus"]), "--output-prefix", str(tmp_path / "x"),
         "--vocab-file", str(corpus["vocab"])],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert result.returncode == 2
    assert result.stderr.strip() == "preprocess_data.py: error: GPT2BPETokenizer needs --merge-file"
    assert result.stdout == "" and list(tmp_path.iterdir()) == []
