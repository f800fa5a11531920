#!/usr/bin/env python3
"""Token counts of a real text corpus, one per line, for `python -m megatron_app.sim --lengths-file`.

    python tools/corpus_lengths.py --output lengths.txt [--input-dir /usr/share/common-licenses] [--vocab-size 1000]

Documents are the paragraphs (megatron_app.data.corpus.paragraphs) of every file under --input-dir (default: Debian's license texts,
present on every Debian system: a natural length distribution, from a few tokens to several hundred). They are
tokenised by a byte-level BPE trained on the same text (the Hugging Face `tokenizers` library), as a small model's
own tokenizer would be. Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_app.data.corpus import CorpusError
from megatron_app.data.lengths import DEFAULT_INPUT, paragraph_token_counts


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
    try:
        counts = paragraph_token_counts(directory, args.vocab_size)
    except CorpusError as exc:
        print(f"corpus_lengths.py: error: {exc}", file=sys.stderr)
        return 2
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
