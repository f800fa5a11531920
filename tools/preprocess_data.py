#!/usr/bin/env python3
"""Tokenize a JSON-lines corpus into Megatron indexed datasets (.bin/.idx) for `--data-path`.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod --workers 4

One document per line: a JSON object whose --json-keys field(s) (default: text) hold the document's text. Each
key K gives <output-prefix>_K_document.bin/.idx (Megatron-LM's naming), written by megatron-core's own
IndexedDatasetBuilder, so Megatron-LM reads these files and this trainer reads Megatron-LM's.

Bad lines: a line that is not JSON, not an object, lacks a key or whose value is not a string stops the run with
its line number (exit 2) unless --skip-bad-lines is given; then such lines are skipped and counted in the summary.
Blank lines are ignored. Documents with no tokens are skipped and counted. Outputs are written under temporary
names and renamed at the very end (the .idx last), so an interrupted or failed run never leaves a .bin/.idx pair
that looks complete. Exit codes: 0 done, 2 bad input or flags, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_app.data.text_tokenizers import (
    DEFAULT_EOD_TOKEN, GPT2_BPE, HUGGING_FACE, TOKENIZER_TYPES, TokenizerError)

PROG = "preprocess_data.py"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # noqa: D401 - argparse API
        _fail(message)


def _fail(message: str, status: int = 2):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def build_parser() -> argparse.ArgumentParser:
    description, _, epilog = __doc__.partition("\n\n")
    parser = _OneLineParser(prog=PROG, description=description.strip(), epilog=epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("input")
    data.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    data.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                      help="field(s) holding the text (default: text); one output per key")
    data.add_argument("--skip-bad-lines", action="store_true",
                      help="skip (and count) lines that are not a JSON object with the keys, instead of failing")

    tok = parser.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                     help=f"{GPT2_BPE} (--vocab-file + --merge-file) or {HUGGING_FACE} (--tokenizer-json); "
                          "default: from the files given")
    tok.add_argument("--vocab-file", help="GPT-2 vocab.json")
    tok.add_argument("--merge-file", help="GPT-2 merges.txt")
    tok.add_argument("--tokenizer-json", help="a Hugging Face tokenizer.json")
    tok.add_argument("--eod-token", default=DEFAULT_EOD_TOKEN,
                     help=f"text of the end-of-document token (default: {DEFAULT_EOD_TOKEN})")
    tok.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")

    out = parser.add_argument_group("output")
    out.add_argument("--output-prefix", required=True,
                     help="writes <prefix>_<key>_document.bin/.idx; the directory must exist")

    run = parser.add_argument_group("runtime")
    run.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    run.add_argument("--log-interval", type=int, default=1000, metavar="DOCS",
                     help="print progress every DOCS documents (default: 1000)")
    return parser


def _progress(stats) -> None:
    print(f"{PROG}: processed {stats.rate_line()}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    from megatron_app.quiet import silence_third_party_warnings

    silence_third_party_warnings()   # before megatron-core's import: Apex / Transformer Engine are absent on CPU
    args = build_parser().parse_args(argv)
    if args.log_interval < 1:
        _fail(f"--log-interval must be a positive integer, got {args.log_interval}")
    # --workers is the parallelism knob: keep the Rust tokenizer from starting a thread pool per process.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from megatron_app.data.preprocess import PreprocessError, TokenizerSpec, preprocess

    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_json,
                         args.eod_token)
    try:
        stats, prefixes = preprocess(args.input, args.output_prefix, spec, keys=args.json_keys,
                                     append_eod=args.append_eod, workers=args.workers,
                                     skip_bad_lines=args.skip_bad_lines, progress=_progress,
                                     log_interval=args.log_interval)
    except (PreprocessError, TokenizerError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted; no output written", status=130)
    skipped = []
    if stats.bad_lines:
        skipped.append(f"{stats.bad_lines} bad lines")
    if stats.empty_documents:
        skipped.append(f"{stats.empty_documents} empty documents")
    print(f"{PROG}: done: {stats.rate_line()}, {stats.tokens} tokens"
          + (f"; skipped {', '.join(skipped)}" if skipped else ""))
    for key, prefix in prefixes.items():
        print(f"{PROG}: {key}: {prefix}.bin/.idx  (train with --data-path {prefix})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
