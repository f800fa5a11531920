"""Peak memory and iteration time of activation recomputation (none, selective, full) at P=2, measured side by side.

Each run is a fresh gloo group of 2 processes on this host (a 2-stage pipeline) training a few iterations of one fp32
model on mock data, with dropout so its masks are kept too (megatron_app.bench.peak_memory). Modes: `none`;
`selective` (--recompute-activations: core attention recomputed); `full` (--recompute-granularity full
--recompute-method uniform --recompute-num-layers 1: every layer rerun from its input). Within each repeat the modes
run one after another, so a drifting machine affects all alike. A mode's peak is the largest over its ranks, its
iteration time the median from the 2nd iteration on (the 1st warms up); both are medians over the repeats.

On CPU the resident memory is the process's whole peak: interpreter, libraries, model, optimizer state and
activations. Only the activations change between modes, so the difference from `none` (the saved MiB), not the ratio,
is what recomputation saves; the ratio understates it by the fixed part.

The defaults make activations dominate: eight heads over 512 tokens give attention scores (heads x seq^2 a sequence)
far larger than the 128-wide layers' weights, and two microbatches of four sequences are both in flight on the first
stage. One run takes about 20 s (none) to 27 s (full) on 2 loaded CPU cores, so --repeats 1 about 70 s and the
default 2 about 2.5 min.

    python tools/bench_recompute.py [--num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 512
        --micro-batch-size 4 --global-batch-size 8 --iters 3 --repeats 2] [--json out.json] [-- more trainer flags]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from megatron_app.bench.peak_memory import run_once

PIPELINE_STAGES = 2
MODES = {
    "none": [],
    "selective": ["--recompute-activations"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}


def model_flags(opts: argparse.Namespace) -> list:
    """The trainer flags every mode shares: the model, fp32 on CPU, dropout (its masks are activations too)."""
    flags = ["--pipeline-model-parallel-size", PIPELINE_STAGES, "--num-layers", opts.num_layers,
             "--hidden-size", opts.hidden_size, "--num-attention-heads", opts.num_attention_heads,
             "--seq-length", opts.seq_length, "--vocab-size", opts.vocab_size,
             "--micro-batch-size", opts.micro_batch_size, "--global-batch-size", opts.global_batch_size,
             "--hidden-dropout", 0.1, "--attention-dropout", 0.1, "--iters", opts.iters,
             "--device", "cpu", "--no-trace", *opts.extra]
    return [str(flag) for flag in flags]


def mode_flags(shared: list) -> dict:
    """{mode: the trainer's flags for it}."""
    return {mode: shared + added for mode, added in MODES.items()}


def summarise(peaks: dict, iteration_ms: dict) -> dict:
    """``peaks[mode]``: each repeat's peak MiB (max over ranks); ``iteration_ms[mode]``: each repeat's iteration times,
    first iteration first. -> {mode: medians, and ratios and saved MiB against `none`}."""
    medians = {}
    for mode in peaks:
        medians[mode] = {"peak_rss_mib": statistics.median(peaks[mode]),
                         "iteration_ms": statistics.median(statistics.median(times[1:])
                                                           for times in iteration_ms[mode])}
    base = medians["none"]
    return {mode: {**row, "memory_ratio": row["peak_rss_mib"] / base["peak_rss_mib"],
                   "saved_mib": base["peak_rss_mib"] - row["peak_rss_mib"],
                   "time_ratio": row["iteration_ms"] / base["iteration_ms"]}
            for mode, row in medians.items()}


def format_table(summary: dict) -> str:
    lines = [f"{'mode':<10} {'peak MiB':>9} {'vs none':>8} {'saved MiB':>10} {'iteration ms':>13} {'vs none':>8}"]
    for mode, row in summary.items():
        lines.append(f"{mode:<10} {row['peak_rss_mib']:>9.0f} {row['memory_ratio']:>7.2f}x {row['saved_mib']:>10.0f} "
                     f"{row['iteration_ms']:>13.1f} {row['time_ratio']:>7.2f}x")
    return "\n".join(lines)


def parse_options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=3, help="iterations a run, the first a warm-up (default 3)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("extra", nargs="*", help="more trainer flags, after --")
    opts = parser.parse_args(argv)
    if opts.iters < 2:
        parser.error("--iters must be at least 2: the 1st iteration warms up and is not timed")
    if opts.repeats < 1:
        parser.error("--repeats must be at least 1")
    return opts


def main(argv=None) -> int:
    opts = parse_options(argv)
    flags = mode_flags(model_flags(opts))
    runs = {mode: [] for mode in flags}
    for repeat in range(opts.repeats):
        for mode, run_flags in flags.items():
            run = run_once(run_flags, PIPELINE_STAGES)
            runs[mode].append(run)
            print(f"repeat {repeat + 1}: {mode} peak {run.max_peak_rss_mib:.0f} MiB, iterations "
                  f"{', '.join(f'{ms:.0f}' for ms in run.iteration_ms)} ms", flush=True)
    peaks = {mode: [run.max_peak_rss_mib for run in done] for mode, done in runs.items()}
    peaks_per_rank = {mode: [list(run.peak_rss_mib) for run in done] for mode, done in runs.items()}
    iteration_ms = {mode: [list(run.iteration_ms) for run in done] for mode, done in runs.items()}
    summary = summarise(peaks, iteration_ms)
    print(format_table(summary))
    if opts.json:
        result = {"flags": flags, "peak_rss_mib": peaks, "peak_rss_mib_per_rank": peaks_per_rank,
                  "iteration_ms": iteration_ms, "summary": summary}
        with open(opts.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
