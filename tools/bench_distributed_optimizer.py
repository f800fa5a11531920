"""Peak memory of a data-parallel rank with and without --use-distributed-optimizer, measured side by side.

Each run is a fresh gloo group of D processes on this host (P=1) training a few iterations of one model in bf16; every
rank reports its peak resident memory (getrusage's ru_maxrss) at the end, and the run's figure is the largest. Runs
alternate (plain, distributed, plain, ...) so a drifting machine affects both alike. On CPU the resident memory
holds everything a GPU would hold in device memory (parameters, gradients, optimizer state, activations) beside
the interpreter and its libraries, so the difference, not the ratio, is what the optimizer saves.

    python tools/bench_distributed_optimizer.py [--hidden-size 1024 --num-layers 8 --data-parallel 2 --repeats 2]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from megatron_app.bench.peak_memory import run_once


def parameter_count(hidden: int, layers: int, vocab: int, seq: int) -> int:
    """The trainer's GPT (tied output layer): embeddings, layers (4h MLP, biases, two norms), final norm."""
    return vocab * hidden + seq * hidden + layers * (12 * hidden * hidden + 13 * hidden) + 2 * hidden


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--data-parallel", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    model = ["--num-layers", opts.num_layers, "--hidden-size", opts.hidden_size, "--num-attention-heads", 16,
             "--seq-length", opts.seq_length, "--vocab-size", opts.vocab_size, "--micro-batch-size", 1,
             "--global-batch-size", 2 * opts.data_parallel, "--iters", opts.iters, "--bf16", "--no-trace",
             "--device", "cpu"]
    flags = {"plain": [str(item) for item in model],
             "distributed": [str(item) for item in model] + ["--use-distributed-optimizer"]}
    peaks = {name: [] for name in flags}
    for repeat in range(opts.repeats):
        for name, run_flags in flags.items():
            peaks[name].append(run_once(run_flags, opts.data_parallel).max_peak_rss_mib)
            print(f"repeat {repeat + 1}: {name} peak {peaks[name][-1]:.0f} MiB", flush=True)
    parameters = parameter_count(opts.hidden_size, opts.num_layers, opts.vocab_size, opts.seq_length)
    plain, distributed = statistics.median(peaks["plain"]), statistics.median(peaks["distributed"])
    expected = 12 * parameters * (1 - 1 / opts.data_parallel) / 2 ** 20
    result = {"parameters": parameters, "data_parallel": opts.data_parallel, "peak_rss_mib": peaks,
              "saved_mib": plain - distributed, "expected_saving_mib": expected,
              "distributed_over_plain": distributed / plain}
    print(f"{parameters:,} parameters, D={opts.data_parallel}: peak {plain:.0f} MiB plain, {distributed:.0f} MiB "
          f"distributed (medians): {plain - distributed:.0f} MiB saved a rank; the optimizer state's share would be "
          f"{expected:.0f} MiB (12 bytes a parameter x (1 - 1/D))")
    if opts.json:
        with open(opts.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
