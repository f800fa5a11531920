#!/usr/bin/env python3
"""What a launch saves by not importing what it does not use: `--check-config` without torch (device_choice reads
torch's build and the CUDA driver) and a rank's imports with megatron-core's jit_fuser compiling at first call
(lazy_fusers) and torch's varlen attention looked up at first CUDA use, each against the way before.

    python tools/bench_launch_imports.py [--repeats 5] [--json out.json]

Each repeat starts one fresh interpreter per variant, alternating:
  check-config   `python -c` running main(['--check-config', '--pipeline_parallel', '2']) (WORLD_SIZE=2): the
                 launcher's check of a two-stage run, wall time from here; `torch first` imports torch and asks
                 torch.cuda.is_available() before it, as the check did
  rank imports   what a rank imports (torch, megatron-core, the runtime, the training loop) with the collector
                 paused as main() pauses it, timed inside: `deferred` through lazy_fusers.import_megatron_core,
                 `eager` importing megatron-core directly and torch.nn.attention.varlen, as the rank did
Prints medians and ratios. Exit 2 on a bad flag.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_app.bench.fresh_interpreters import load_line, medians_of, parse_repeats, write_json

REPO = Path(__file__).resolve().parents[1]
CHECK = """
import sys
if sys.argv[1] == "torch first":
    import torch
    torch.cuda.is_available()
from megatron_app.train.__main__ import main
main(["--check-config", "--pipeline_parallel", "2"])
"""
IMPORTS = """
import sys, time, warnings
warnings.simplefilter("ignore")
from megatron_app.train import gc_phases
gc_phases.pause_collections_while_importing()
started = time.perf_counter()
if sys.argv[1] == "deferred":
    from megatron_app.lazy_fusers import import_megatron_core
    import_megatron_core()
else:
    import torch.nn.attention.varlen
import torch, megatron.core, megatron_app.runtime, megatron_app.train.loop
print(time.perf_counter() - started)
"""
# measure: (child's code, (variant now, variant before), whether the child prints its own seconds; else the wall time
# of the whole process is taken)
MEASURES = {"check-config": (CHECK, ("no torch", "torch first"), False),
            "rank imports": (IMPORTS, ("deferred", "eager"), True)}


def one_process(code: str, variant: str, child_timed: bool) -> float:
    """Seconds: the child's own print for the imports, the process's wall time for the check."""
    env = dict(os.environ, PYTHONPATH=str(REPO), WORLD_SIZE="2")
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code, variant], check=True, timeout=300, env=env,
                            capture_output=True, text=True)
    wall = time.perf_counter() - started
    return float(result.stdout.strip()) if child_timed else wall


def main(argv=None) -> int:
    args = parse_repeats(__doc__.split("\n\n")[0], argv)
    seconds = {measure: {variant: [] for variant in variants} for measure, (_, variants, _) in MEASURES.items()}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for measure, (code, variants, child_timed) in MEASURES.items():
            for variant in variants:
                seconds[measure][variant].append(one_process(code, variant, child_timed))
    medians = medians_of(seconds)
    ratios = {}
    for measure, (_, (now, before), _) in MEASURES.items():
        ratios[measure] = medians[measure][now] / medians[measure][before]
        print(f"{measure}: {now} {medians[measure][now]:.3f} s, {before} {medians[measure][before]:.3f} s "
              f"({ratios[measure]:.2f}x; medians of {args.repeats})")
    print(load_line(load_before))
    write_json(args.json, "bench_launch_imports", seconds, medians, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
