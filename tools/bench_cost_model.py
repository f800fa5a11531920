#!/usr/bin/env python3
"""What each feature of the learnt cost model buys, replayed online over real traces (megatron_app.bench.cost_model_replay).

    python tools/bench_cost_model.py traces/run_a traces/run_b --json out.json

Each trace directory is one real run told its microbatches' lengths (--variable-seq-lengths, tracing on). Exit 2 on
a bad flag or an unreadable trace.
"""

import sys

from megatron_app.bench.cost_model_replay import main

if __name__ == "__main__":
    sys.exit(main())
