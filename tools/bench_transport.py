#!/usr/bin/env python3
"""Benchmark our transport's backends against gloo, a raw TCP socket and a single-thread memcpy: the command line of
megatron_app.bench.transport (see its cli module for the sections and output).

    python tools/bench_transport.py                          # every section
    python tools/bench_transport.py --backends tcp --rate 1gbit
    python tools/bench_transport.py --backends shm --loss-compare --repeats 9
    python tools/bench_transport.py --quick --json out.json  # a few seconds per section
"""

import sys

from megatron_app.bench.transport.cli import main

if __name__ == "__main__":
    sys.exit(main())
