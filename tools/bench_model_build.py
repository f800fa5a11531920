#!/usr/bin/env python3
"""What building a rank's model costs before and after Megatron's own draw of the initial weights was skipped and
ours spread over threads (train/weights.py), in fresh interpreters on a one-rank CPU job.

    python tools/bench_model_build.py [--repeats 3] [--json out.json] [-- model flags]

Each repeat starts two fresh interpreters, one per variant, alternating:
  now      build_model_chunks as the trainer calls it (Megatron allocates and tags; no draw, no master weights; ours
           on up to 8 threads)
  before   the same pieces as they ran before: Megatron's initialisation draws every weight into a master weight,
           then ours draws them all again on one thread
Both end with bit-identical weights (tests/test_weight_init.py). Measured: build_model_chunks' seconds (the model
alone, no optimizer or data). Model flags after `--` (default: 8 layers, hidden 2048, 16 heads, bf16: 411 M
parameters). Prints medians and the ratio. Exit 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
                 "--bf16"]
CHILD = """
import contextlib, json, os, sys, time, warnings
warnings.simplefilter("ignore")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from megatron_app.train.args import parse_args
from megatron_app.train.init import init_distributed, init_model_parallel
from megatron_app.train import model, weights
args = parse_args(["--pipeline_parallel", "1", "--model_chunks", "1", "--device", "cpu"] + json.loads(sys.argv[4]))
init_distributed("cpu", 10)
init_model_parallel(1, 1, 1, "cpu", 10)
if sys.argv[2] == "before":
    weights._MOST_DRAW_THREADS = 1
    model.megatron_draws_skipped = lambda config: contextlib.nullcontext()
started = time.perf_counter()
chunks = model.build_model_chunks(args)
seconds = time.perf_counter() - started
parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())
open(sys.argv[1], "w").write(json.dumps({"seconds": seconds, "parameters": parameters}))
"""
VARIANTS = ("now", "before")


def measure(variant: str, port: int, flags) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "result.json"
        subprocess.run([sys.executable, "-c", CHILD, str(target), variant, str(port), json.dumps(flags)], cwd=REPO,
                       check=True, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
        return json.loads(target.read_text())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT_MODEL
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the measurements here")
    args = parser.parse_args(own)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    seconds = {variant: [] for variant in VARIANTS}
    parameters = None
    for repeat in range(args.repeats):
        for index, variant in enumerate(VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]):
            result = measure(variant, 29600 + 2 * repeat + index, flags)
            seconds[variant].append(result["seconds"])
            parameters = result["parameters"]
            print(f"repeat {repeat + 1} {variant:<6} {result['seconds']:.2f} s", flush=True)
    medians = {variant: statistics.median(values) for variant, values in seconds.items()}
    ratio = medians["now"] / medians["before"]
    print(f"{parameters / 1e6:.0f} M parameters, {os.cpu_count()} cores: now {medians['now']:.2f} s, before "
          f"{medians['before']:.2f} s (median of {args.repeats}); now / before {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"flags": flags, "parameters": parameters, "seconds": seconds,
                                               "median_s": medians, "now_over_before": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
