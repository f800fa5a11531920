#!/usr/bin/env python3
"""Token counts of a real text corpus, one per line, for `python -m megatron_app.sim --lengths-file`.

    python tools/corpus_lengths.py --output lengths.txt [--input-dir /usr/share/common-licenses] [--vocab-size 1000]

Documents are the blank-line separated paragraphs of every file under --input-dir (default: Debian's license texts,
present on every Debian system: a natural length distribution, from a few tokens to several hundred). They are
tokenised by a byte-level BPE trained on the same text (the Hugging Face `tokenizers` library), as a small model's
own tokenizer would be. Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

DEFAULT_INPUT = "/usr/share/common-licenses"


def read_paragraphs(directory: Path) -> List[str]:
    paragraphs = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        paragraphs += [block.strip() for block in text.split("\n\n") if block.strip()]
    return paragraphs


def token_counts(paragraphs: List[str], vocab_size: int) -> List[int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(paragraphs, trainer=trainer)
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(paragraphs)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="corpus_lengths.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-dir", default=DEFAULT_INPUT, help=f"corpus directory (default {DEFAULT_INPUT})")
    parser.add_argument("--output", required=True, help="write one token count per line here")
    parser.add_argument("--vocab-size", type=int, default=1000, help="BPE vocabulary size (default 1000)")
    args = parser.parse_args(argv)
    directory = Path(args.input_dir)
    if not directory.is_dir():
        print(f"corpus_lengths.py: error: {directory} is not a directory", file=sys.stderr)
        return 2
    if args.vocab_size < 257:
        print(f"corpus_lengths.py: error: --vocab-size must be >= 257 (the byte alphabet), got {args.vocab_size}",
              file=sys.stderr)
        return 2
    paragraphs = read_paragraphs(directory)
    if not paragraphs:
        print(f"corpus_lengths.py: error: no text under {directory}", file=sys.stderr)
        return 2
    counts = [c for c in token_counts(paragraphs, args.vocab_size) if c > 0]
    try:
        Path(args.output).write_text("".join(f"{c}\n" for c in counts), encoding="utf-8")
    except OSError as exc:
        print(f"corpus_lengths.py: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    counts.sort()
    print(f"{len(counts)} documents, tokens min {counts[0]} median {counts[len(counts) // 2]} max {counts[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
