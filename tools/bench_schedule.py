#!/usr/bin/env python3
"""Schedules head to head on emulated compute: the command line of megatron_app.bench.schedule (see its cli module
for the scenarios, rows and output).

    python tools/bench_schedule.py [--pipeline_parallel 4 --model_chunks 2 --microbatches 8 --fwd-ms 10 --bwd-ms 20]
                                   [--iters 5 --warmup 2 --repeats 1] [--scenarios ...] [--schedules ...]
                                   [--json FILE] [--png FILE] [--work-dir DIR] [--quick]
    python tools/bench_schedule.py --replay-trace TRACE_DIR [--policy NAME]   # simulator vs a traced run
    python tools/bench_schedule.py [same flags] --analyse-only WORK_DIR/benchXXXX  # re-analyse a kept run
"""

import sys

from megatron_app.bench.schedule.cli import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
