"""A real text corpus with a natural document-length distribution, built from text that ships with the system.

Sources (nothing is downloaded):
- ``licenses``: Debian's license texts, /usr/share/common-licenses/* (package base-files, on every Debian system);
- ``copyright``: every package's /usr/share/doc/*/copyright file, each file WHOLE as one document (a long tail:
  most are a few KB, some tens of KB; issue 23's long-document corpus);
- ``pydoc``: the Python help topics of the running interpreter's standard library (``pydoc_data.topics``, Debian
  package libpython3.X-stdlib).
Each paragraph (text between blank lines) is one document; exact duplicates are dropped (the GPL family shares
paragraphs) and the documents are shuffled with a fixed seed so that Megatron's contiguous train/valid split draws
from the same length distribution. A byte-level BPE is trained on the documents (Hugging Face tokenizers) and
saved both as tokenizer.json and as GPT-2 vocab.json/merges.txt; tools/preprocess_data.py turns the jsonl into a
Megatron indexed dataset.
"""

from __future__ import annotations

import glob
import json
import math
import os
import random
import re
from dataclasses import dataclass
from typing import Dict, List, Sequence

from .text_tokenizers import DEFAULT_EOD_TOKEN

LICENSES_DIR = "/usr/share/common-licenses"
COPYRIGHT_GLOB = "/usr/share/doc/*/copyright"
SOURCES = ("licenses", "pydoc", "copyright")
# Sources whose files are documents as they are (not split into paragraphs).
WHOLE_DOCUMENT_SOURCES = ("copyright",)
DEFAULT_VOCAB_SIZE = 1000
SHUFFLE_SEED = 1234
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


class CorpusError(ValueError):
    """A corpus that cannot be built; the message is one line meant for the user."""


def paragraphs(text: str) -> List[str]:
    """Non-blank paragraphs of ``text``, stripped; a paragraph without a letter or digit is dropped."""
    found = (part.strip() for part in _PARAGRAPH_BREAK.split(text.replace("\r\n", "\n")))
    return [part for part in found if any(ch.isalnum() for ch in part)]


def license_texts(directory: str = LICENSES_DIR) -> List[str]:
    """Each license file once (several names are symlinks to the same text), in name order."""
    seen, texts = set(), []
    for path in sorted(glob.glob(os.path.join(directory, "*"))):
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(real):
            continue
        seen.add(real)
        with open(real, encoding="utf-8", errors="replace") as handle:
            texts.append(handle.read())
    if not texts:
        raise CorpusError(f"no license texts in {directory} (source 'licenses' needs Debian's base-files)")
    return texts


def pydoc_texts() -> List[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise CorpusError("this Python has no pydoc_data.topics (source 'pydoc')") from None
    return [topics[name] for name in sorted(topics)]


def copyright_texts(pattern: str = COPYRIGHT_GLOB) -> List[str]:
    """Each package's copyright file once (many are symlinks to a shared one), in path order."""
    seen, texts = set(), []
    for path in sorted(glob.glob(pattern)):
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(real):
            continue
        seen.add(real)
        with open(real, encoding="utf-8", errors="replace") as handle:
            text = handle.read().strip()
        if text:
            texts.append(text)
    if not texts:
        raise CorpusError(f"no files match {pattern} (source 'copyright' needs Debian's /usr/share/doc)")
    return texts


def collect_documents(sources: Sequence[str], seed: int = SHUFFLE_SEED) -> List[str]:
    """Documents of the named sources (paragraphs, or whole files for WHOLE_DOCUMENT_SOURCES), deduplicated, in a
    seeded random order."""
    readers = {"licenses": license_texts, "pydoc": pydoc_texts, "copyright": copyright_texts}
    documents: Dict[str, None] = {}
    for source in sources:
        if source not in readers:
            raise CorpusError(f"unknown corpus source {source!r}; choose from {', '.join(SOURCES)}")
        for text in readers[source]():
            for document in ([text] if source in WHOLE_DOCUMENT_SOURCES else paragraphs(text)):
                documents.setdefault(document, None)
    ordered = list(documents)
    random.Random(seed).shuffle(ordered)
    return ordered


def build_bpe(documents: Sequence[str], vocab_size: int, eod_token: str = DEFAULT_EOD_TOKEN):
    """A byte-level BPE (Hugging Face tokenizers) trained on ``documents``, the end-of-document token included: the
    tokenizer a small model trained on this text would have."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eod_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def train_bpe(documents: Sequence[str], vocab_size: int, directory: str,
              eod_token: str = DEFAULT_EOD_TOKEN) -> Dict[str, str]:
    """build_bpe, saved: writes tokenizer.json, vocab.json and merges.txt into ``directory``."""
    tokenizer = build_bpe(documents, vocab_size, eod_token)
    tokenizer.model.save(directory)
    tokenizer_json = os.path.join(directory, "tokenizer.json")
    tokenizer.save(tokenizer_json)
    return {"tokenizer_json": tokenizer_json, "vocab_file": os.path.join(directory, "vocab.json"),
            "merge_file": os.path.join(directory, "merges.txt")}


def write_jsonl(documents: Sequence[str], path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for index, text in enumerate(documents):
            handle.write(json.dumps({"id": index, "text": text}) + "\n")


@dataclass(frozen=True)
class LengthStats:
    """Token counts per document."""

    documents: int
    tokens: int
    minimum: int
    p10: int
    median: int
    mean: float
    p90: int
    maximum: int
    log_sd: float      # standard deviation of log(length): the sigma of a lognormal fit

    @classmethod
    def of(cls, lengths: Sequence[int]) -> "LengthStats":
        if not lengths:
            raise CorpusError("the corpus has no documents")
        ordered = sorted(lengths)
        n = len(ordered)

        def quantile(q: float) -> int:
            return ordered[min(n - 1, int(q * n))]

        logs = [math.log(max(length, 1)) for length in ordered]
        mean_log = sum(logs) / n
        return cls(documents=n, tokens=sum(ordered), minimum=ordered[0], p10=quantile(0.1), median=quantile(0.5),
                   mean=sum(ordered) / n, p90=quantile(0.9), maximum=ordered[-1],
                   log_sd=math.sqrt(sum((x - mean_log) ** 2 for x in logs) / n))

    def line(self) -> str:
        return (f"{self.documents} documents, {self.tokens} tokens; tokens per document: min {self.minimum}, "
                f"p10 {self.p10}, median {self.median}, mean {self.mean:.1f}, p90 {self.p90}, max {self.maximum}, "
                f"sd of log length {self.log_sd:.2f}")


def indexed_document_lengths(prefix: str) -> List[int]:
    """Token count of every document of a Megatron indexed dataset (reads the .idx only)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)   # keep it alive: its lengths are a view of its memory map
    return [int(length) for length in dataset.sequence_lengths]
