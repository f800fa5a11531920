#!/usr/bin/env python3
"""Draw one traced iteration: the seed's spreadsheet picture (.xlsx) and a true-time timeline (.png).

    python tools/visualize_trace.py --pipeline_parallel P --model_chunks V [--trace-dir D] [--iteration K|last]
                                    [--out-dir O]

Reads the newest complete run of that shape under D (default traces/: traces/latest first) and says which.
Writes trace_pipeline_<P>_model_chunks_<V>.xlsx and .png beside the traces (or in O).
Exit codes: 0 ok, 2 bad input.
"""

import sys

from megatron_app.trace.visualize_trace import PROG, main
from megatron_app.trace.cli import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(PROG, main))
