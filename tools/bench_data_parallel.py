#!/usr/bin/env python3
"""Compositions across data-parallel replicas, real runtime on emulated compute, runs alternated, the simulator's
prediction beside each row (megatron_app.bench.data_parallel).

    python tools/bench_data_parallel.py -P 2 -V 2 -D 2 --microbatches 16 --iters 5 --rounds 2 \\
        [--slow-replica 1 --slow-factor 1.3] [--compositions loader,dp-balanced,balanced-local,balanced]

Exit 2 on bad flags, 1 when a run fails (its last line is printed).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_app.bench.data_parallel import format_rows, launcher_flags, row_flags, simulated_ms
from megatron_app.bench.real_composition import run_alternated, summarise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-P", "--pipeline-parallel", type=int, default=2)
    parser.add_argument("-V", "--model-chunks", type=int, default=2)
    parser.add_argument("-D", "--data-parallel", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=16, help="loader microbatches a replica (default 16)")
    parser.add_argument("--documents-per-microbatch", type=int, default=2)
    parser.add_argument("--lengths-file", default="docs/results/lengths/copyright_2048.txt")
    parser.add_argument("--fwd-ms", type=float, default=10.0)
    parser.add_argument("--bwd-ms", type=float, default=20.0)
    parser.add_argument("--host-ms", type=float, default=1.0,
                        help="the simulator's runtime cost per task for its prediction (default 1.0; measure it)")
    parser.add_argument("--slow-replica", type=int, default=None)
    parser.add_argument("--slow-factor", type=float, default=1.3)
    parser.add_argument("--iters", type=int, default=5, help="iterations per run, the first a warm-up")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compositions", default="loader,dp-balanced,balanced-local,balanced",
                        help="rows: compositions, and balanced-blind (balanced with --no-replica-speeds)")
    parser.add_argument("--json")
    parser.add_argument("extra", nargs="*", help="more trainer flags, after --")
    args = parser.parse_args(argv)
    if args.iters < 2 or args.rounds < 1:
        parser.error("--iters must be >= 2 (the first is a warm-up) and --rounds >= 1")
    shape = dict(pipeline_parallel=args.pipeline_parallel, model_chunks=args.model_chunks,
                 data_parallel=args.data_parallel, microbatches=args.microbatches,
                 documents_per_microbatch=args.documents_per_microbatch, lengths_file=args.lengths_file,
                 fwd_ms=args.fwd_ms, bwd_ms=args.bwd_ms, iters=args.iters, slow_replica=args.slow_replica,
                 slow_factor=args.slow_factor)
    flags = launcher_flags(**shape, extra=["--no-trace", *args.extra])
    compositions = [name.strip() for name in args.compositions.split(",") if name.strip()]
    try:
        runs = run_alternated(compositions, args.rounds, [f for f in flags if f != "--no-trace"], warmup=1,
                              row_flags=row_flags)
    except RuntimeError as error:
        print(f"bench_data_parallel: {error}", file=sys.stderr)
        return 1
    simulated = {name: simulated_ms(name, host_ms=args.host_ms, **shape) for name in compositions}
    print(format_rows(runs, compositions[0], simulated))
    if args.json:
        summaries = summarise(runs, compositions[0])
        with open(args.json, "w") as handle:
            json.dump({"launcher_flags": flags, "simulated_ms": simulated,
                       "runs": [vars(run) for run in runs],
                       "summaries": [{"composition": s.composition, "median_iteration_ms": s.median_iteration_ms,
                                      "speedup_over_baseline": s.speedup_over_baseline} for s in summaries]},
                      handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
