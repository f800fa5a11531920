#!/usr/bin/env python3
"""Build a real text corpus with natural document lengths for variable-length training (no download).

    python tools/make_corpus.py --output-dir data/corpus [--sources licenses pydoc] [--vocab-size 1000]
    python tools/make_corpus.py --output-dir data/copyright --sources copyright --lengths-truncate 2048 8192

Documents are the paragraphs of Debian's license texts (/usr/share/common-licenses) and of Python's help topics
(pydoc_data.topics), or (source copyright) the whole /usr/share/doc/*/copyright files, deduplicated and shuffled
with a fixed seed. Writes into --output-dir:
  corpus.jsonl                      one {"id", "text"} document per line
  tokenizer.json, vocab.json, merges.txt   a byte-level BPE trained on the documents (<|endoftext|> included)
  corpus_text_document.bin/.idx     the Megatron indexed dataset (tools/preprocess_data.py's engine, --append-eod)
  stats.json                        document-length statistics in tokens
  lengths_<N>.txt                   with --lengths-truncate N: each document's tokens (from the indexed dataset),
                                    truncated to N, one per line (python -m megatron_app.sim --lengths-file)
and prints the flags to train on it, e.g.
  bash run_single.sh --pipeline_parallel 2 --model_chunks 2 --variable-seq-lengths --seq-length 256 \\
      --data-path data/corpus/corpus_text_document --tokenizer-json data/corpus/tokenizer.json
Exit codes: 0 done, 2 bad flags or input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from megatron_app.data.corpus import (
    DEFAULT_VOCAB_SIZE, SHUFFLE_SEED, SOURCES, CorpusError, LengthStats, collect_documents,
    indexed_document_lengths, train_bpe, write_jsonl)

from megatron_app.trace.cli import OneLineArgumentParser

PROG = "make_corpus.py"
DEFAULT_SOURCES = ("licenses", "pydoc")      # the paragraph corpus; copyright is asked for by name


def _fail(message: str, status: int = 2):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def build_parser() -> argparse.ArgumentParser:
    description, _, epilog = __doc__.partition("\n\n")
    parser = OneLineArgumentParser(prog=PROG, description=description.strip(), epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, help="created if missing")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(DEFAULT_SOURCES),
                        help=f"text sources (default: {' '.join(DEFAULT_SOURCES)})")
    parser.add_argument("--lengths-truncate", nargs="*", type=int, default=[], metavar="N",
                        help="also write lengths_<N>.txt: document token counts truncated to N")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help=f"BPE vocabulary size, <|endoftext|> included (default: {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--shuffle-seed", type=int, default=SHUFFLE_SEED, help="document order seed")
    return parser


def main(argv=None) -> int:
    from megatron_app.quiet import silence_third_party_warnings

    silence_third_party_warnings()   # before megatron-core's import: Apex / Transformer Engine are absent on CPU
    args = build_parser().parse_args(argv)
    if args.vocab_size < 300:
        _fail(f"--vocab-size must be at least 300 (256 byte tokens + the end-of-document token), "
              f"got {args.vocab_size}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from megatron_app.data.preprocess import PreprocessError, TokenizerSpec, preprocess
    from megatron_app.data.text_tokenizers import TokenizerError

    out = Path(args.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _fail(f"cannot create --output-dir {out}: {exc.strerror}")
    try:
        documents = collect_documents(args.sources, seed=args.shuffle_seed)
        files = train_bpe(documents, args.vocab_size, str(out))
        corpus = out / "corpus.jsonl"
        write_jsonl(documents, str(corpus))
        _stats, prefixes = preprocess(str(corpus), str(out / "corpus"), TokenizerSpec(
            tokenizer_json=files["tokenizer_json"]), keys=["text"], append_eod=True, workers=1)
    except (CorpusError, PreprocessError, TokenizerError) as exc:
        _fail(str(exc))
    prefix = prefixes["text"]
    lengths = LengthStats.of(indexed_document_lengths(prefix))
    summary = {"sources": args.sources, "vocab_size": args.vocab_size, "shuffle_seed": args.shuffle_seed,
               "data_path": prefix, "tokens_per_document": dataclasses.asdict(lengths),
               "note": "lengths include the appended end-of-document token"}
    (out / "stats.json").write_text(json.dumps(summary, indent=1) + "\n")
    for truncate in args.lengths_truncate:
        if truncate < 1:
            _fail(f"--lengths-truncate must be >= 1, got {truncate}")
        counts = [min(int(n), truncate) for n in indexed_document_lengths(prefix)]
        (out / f"lengths_{truncate}.txt").write_text("".join(f"{c}\n" for c in counts))
    print(f"{PROG}: {lengths.line()} (end-of-document token included)")
    print(f"{PROG}: train with --data-path {prefix} --tokenizer-json {files['tokenizer_json']} "
          "--variable-seq-lengths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
