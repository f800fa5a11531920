#!/usr/bin/env python3
"""Straggler and jitter on real compute: `planned` against `planned-fixed` (run-time reordering off) and Megatron's
`interleaved` order, real GPT training on CPU with one pipeline rank slowed by a competing busy process that the
benchmark starts and stops (megatron_app.bench.straggler: rows, pinning, slowdown modes).

    python tools/bench_straggler.py --straggler steady --slow-rank 1 --rounds 2 --json out.json
    python tools/bench_straggler.py --straggler intermittent --jitter-period-ms 300 --iters 6

--data-dir is tools/make_corpus.py's output, built with `--sources copyright` when missing. Exit 2 on bad flags,
1 when a run fails (its last line is printed), 130 when interrupted; the competitor never outlives the benchmark.
"""

import sys

from megatron_app.bench.straggler import main

if __name__ == "__main__":
    sys.exit(main())
