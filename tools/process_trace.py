#!/usr/bin/env python3
"""Merge per-rank trace files into a Chrome/Perfetto trace, compute pipeline metrics, check causality.

    python tools/process_trace.py --pipeline_parallel P --model_chunks V [--trace-dir D] [--iteration K|last|all]
                                  [--out-dir O] [--strict] [--tolerance-us T]
    python tools/process_trace.py D [...]          # P and V, when not given, are the chosen run's own

Reads the newest complete run of that shape under D (default traces/: traces/latest first) and says which.
Writes trace_pipeline_<P>_model_chunks_<V>.json (open in ui.perfetto.dev), ..._metrics.json, ..._metrics.csv
beside the traces (or in O) and prints a summary. Exit codes: 0 ok, 1 causality violations with --strict, 2 bad input.
"""

import sys

from megatron_app.trace.process_trace import PROG, main
from megatron_app.trace.cli import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(PROG, main))
