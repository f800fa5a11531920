#!/usr/bin/env python3
"""What the package's commands gain from pausing Python's garbage collector while they import and freezing their
objects at exit (train/gc_phases.py), against the interpreter's defaults.

    python tools/bench_gc_phases.py [--repeats 5] [--json out.json]

Each repeat starts two fresh interpreters, one per variant, alternating. Each imports what a rank imports (torch,
megatron-core, the runtime, the training loop) and exits: `gc_phases` through train/gc_phases.py's calls as main()
and the trainer make them, `default` without. Measured: the imports (from before the first to after the last) and
the exit (from the last atexit handler to the process's end, seen from here). Prints medians and ratios. Exit 2 on
a bad flag.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_app.bench.fresh_interpreters import load_line, medians_of, parse_repeats, write_json

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import atexit, json, sys, time, warnings
warnings.simplefilter("ignore")
from megatron_app.train import gc_phases
if sys.argv[2] == "gc_phases":
    gc_phases.pause_collections_while_importing()
started = time.perf_counter()
import torch, megatron.core, megatron_app.runtime, megatron_app.train.loop
imports = time.perf_counter() - started
if sys.argv[2] == "gc_phases":
    gc_phases.resume_collections()
# registered last, so it runs first: every later handler (gc.freeze, torch's) is counted in the exit
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps([imports, time.time()])))
"""
VARIANTS = ("gc_phases", "default")


def one_process(variant: str, scratch: Path) -> tuple:
    mark = scratch / f"{variant}.times"
    subprocess.run([sys.executable, "-c", CHILD, str(mark), variant], check=True, timeout=300,
                   env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ended = time.time()
    imports, last_handler = json.loads(mark.read_text())
    return imports, ended - last_handler


def main(argv=None) -> int:
    args = parse_repeats(__doc__.split("\n\n")[0], argv)
    seconds = {variant: {"imports": [], "exit": []} for variant in VARIANTS}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeats):
            for variant in VARIANTS:
                imports, exit_s = one_process(variant, Path(scratch))
                seconds[variant]["imports"].append(imports)
                seconds[variant]["exit"].append(exit_s)
    medians = medians_of(seconds)
    for variant in VARIANTS:
        print(f"{variant:>9}: imports {medians[variant]['imports']:.3f} s, exit {medians[variant]['exit']:.3f} s "
              f"(medians of {args.repeats})")
    ratios = {phase: medians["gc_phases"][phase] / medians["default"][phase] for phase in ("imports", "exit")}
    print(f"gc_phases / default: imports {ratios['imports']:.2f}x, exit {ratios['exit']:.2f}x; "
          f"{load_line(load_before)}")
    write_json(args.json, "bench_gc_phases", seconds, medians, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
