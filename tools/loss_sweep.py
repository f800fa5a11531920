#!/usr/bin/env python3
"""Train the tiny GPT under packet loss and compare with the lossless run (megatron_app.bench.loss_sweep: the grid,
the outputs and every flag are described there and in --help).

    python tools/loss_sweep.py [--out-dir loss_sweep] [--iters 80] [--quick] [--markdown]
"""

import sys

from megatron_app.bench.loss_sweep import main

if __name__ == "__main__":
    sys.exit(main())
