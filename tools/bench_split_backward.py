"""What a split backward costs on one Megatron-Core GPTModel chunk: whole backward vs B (input gradient) + W (weight
gradients) as runtime/split_backward.py runs them, timed side by side in one process (alternating, medians).

    .venv/bin/python tools/bench_split_backward.py [--layers 4 --hidden 512 --seq 256 --batch 2 --repeats 10]

A middle chunk (no embedding, no loss: the chunks whose B has an input gradient to send). Also measures memory: the
bytes the forward saves for its backward (a whole backward frees them) against the bytes a pending W keeps after B.
Prints one table and, with --json, writes the numbers.
"""

import sys

from megatron_app.bench.split_backward import main

if __name__ == "__main__":
    sys.exit(main())
