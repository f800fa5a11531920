"""Token counts of a text corpus, one per document, for the simulator and the benchmarks' variable-length scenario
(`python -m megatron_app.sim --lengths-file`): the paragraphs of every file under a directory (corpus.paragraphs),
counted by a byte-level BPE trained on them (corpus.build_bpe), as a small model's own tokenizer would count them.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

from .corpus import CorpusError, build_bpe, paragraphs

DEFAULT_INPUT = "/usr/share/common-licenses"


def directory_paragraphs(directory: Path) -> List[str]:
    """Every paragraph of every readable file under ``directory``, in path order (duplicates kept: each occurrence
    is a document of the length distribution)."""
    found = []
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        found += paragraphs(text)
    return found


def paragraph_token_counts(directory: Path, vocab_size: int) -> List[int]:
    """Token count of each paragraph under ``directory`` (empty encodings left out)."""
    documents = directory_paragraphs(directory)
    if not documents:
        raise CorpusError(f"no text under {directory}")
    tokenizer = build_bpe(documents, vocab_size)
    return [count for count in (len(e.ids) for e in tokenizer.encode_batch(documents)) if count > 0]
