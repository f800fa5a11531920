"""The frame of an A/B measured in fresh interpreters (tools/bench_gc_phases.py, tools/bench_launch_imports.py): the
repeat and JSON flags, the medians, the load line and the JSON file each of them writes."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path


def parse_repeats(description: str, argv=None, default: int = 5) -> argparse.Namespace:
    """--repeats N (at least 1; exit 2 otherwise) and --json PATH."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=default)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def medians_of(seconds: dict) -> dict:
    """{a: {b: [s, ...]}} -> {a: {b: median}}."""
    return {outer: {inner: statistics.median(values) for inner, values in row.items()}
            for outer, row in seconds.items()}


def load_line(load_before: float) -> str:
    return (f"load average (1 min) before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
            f"on {os.cpu_count()} CPUs")


def write_json(path, benchmark: str, seconds: dict, medians: dict, ratios: dict) -> None:
    if path:
        Path(path).write_text(json.dumps({"benchmark": benchmark, "seconds": seconds, "median": medians,
                                          "ratios": ratios}, indent=1))
