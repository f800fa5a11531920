#!/usr/bin/env python3
"""How long a process of the trainer takes to end after its last atexit handler: with its objects frozen first
(train/fast_exit.py, what the package's commands do) against the interpreter's default finalization.

    python tools/bench_exit.py [--repeats 5] [--json out.json]

Each repeat starts two fresh interpreters, one per variant, alternating, that import what a rank imports (torch,
megatron-core, the training loop), note the time in their last atexit handler and exit; the time to the process's
end is measured here. Prints the median per variant and their ratio. Exit 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import atexit, sys, time, warnings
warnings.simplefilter("ignore")
import megatron.core, megatron_app.train.loop
if sys.argv[2] == "frozen":
    from megatron_app.train.fast_exit import skip_final_collections_at_exit
    skip_final_collections_at_exit()
# registered last, so it runs first: every later handler (gc.freeze, torch's) is counted in the exit
atexit.register(lambda: open(sys.argv[1], "w").write(repr(time.time())))
"""
VARIANTS = ("frozen", "default")


def one_exit(variant: str, scratch: Path) -> float:
    mark = scratch / f"{variant}.time"
    subprocess.run([sys.executable, "-c", CHILD, str(mark), variant], check=True, timeout=300,
                   env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ended = time.time()
    return ended - float(mark.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    seconds = {variant: [] for variant in VARIANTS}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeats):
            for variant in VARIANTS:
                seconds[variant].append(one_exit(variant, Path(scratch)))
    medians = {variant: statistics.median(values) for variant, values in seconds.items()}
    for variant in VARIANTS:
        print(f"{variant:>8}: {medians[variant]:.3f} s from the last atexit handler to the end (median of "
              f"{args.repeats}; {', '.join(f'{s:.3f}' for s in seconds[variant])})")
    print(f"frozen / default: {medians['frozen'] / medians['default']:.2f}x; load average (1 min) before/after: "
          f"{load_before:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "bench_exit", "seconds": seconds, "median": medians},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
