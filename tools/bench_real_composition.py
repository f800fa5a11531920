#!/usr/bin/env python3
"""Tokens/s of real GPT training on CPU per composition (loader padded, packed, dp-balanced, balanced), runs
alternated (megatron_app.bench.real_composition).

    python tools/bench_real_composition.py --data-dir data/copyright -P 4 -V 2 --seq-length 2048 \\
        --micro-batch-size 2 --global-batch-size 32 --iters 5 --rounds 2 --json out.json [--trace-dir DIR]

--data-dir is tools/make_corpus.py's output (corpus_text_document.{bin,idx}, tokenizer.json); it is built with
`--sources copyright` when missing. Exit 2 on bad flags, 1 when a run fails (its last line is printed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from megatron_app.bench.real_composition import REPO_ROOT, format_table, run_alternated, summarise, write_json


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/copyright")
    parser.add_argument("-P", "--pipeline-parallel", type=int, default=4)
    parser.add_argument("-V", "--model-chunks", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5, help="iterations per run, the first a warm-up")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compositions", default="loader,packed,dp-balanced,balanced")
    parser.add_argument("--json")
    parser.add_argument("--trace-dir", help="trace every run under DIR/ROW-roundN (python tools/bench_cost_model.py "
                        "replays the cost model over them); default untraced")
    parser.add_argument("extra", nargs="*", help="more trainer flags, after --")
    args = parser.parse_args(argv)
    if args.iters < 2 or args.rounds < 1:
        parser.error("--iters must be >= 2 (the first is a warm-up) and --rounds >= 1")
    data_dir = Path(args.data_dir)
    prefix = data_dir / "corpus_text_document"
    if not prefix.with_suffix(".idx").exists():
        print(f"building the copyright corpus in {data_dir}", flush=True)
        subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "make_corpus.py"), "--output-dir", str(data_dir),
                        "--sources", "copyright"], check=True)
    flags = ["--pipeline_parallel", str(args.pipeline_parallel), "--model_chunks", str(args.model_chunks),
             "--variable-seq-lengths", "--seq-length", str(args.seq_length), "--data-path", str(prefix.resolve()),
             "--tokenizer-json", str((data_dir / "tokenizer.json").resolve()), "--micro-batch-size",
             str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size), "--iters",
             str(args.iters), *args.extra]
    compositions = [name.strip() for name in args.compositions.split(",") if name.strip()]
    try:
        runs = run_alternated(compositions, args.rounds, flags, warmup=1, trace_root=args.trace_dir)
    except RuntimeError as error:
        print(f"bench_real_composition: {error}", file=sys.stderr)
        return 1
    summaries = summarise(runs, compositions[0])
    print(format_table(summaries, compositions[0]))
    if args.json:
        write_json(args.json, summaries, flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
