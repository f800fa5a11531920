"""python -m megatron_app.sim.frontier: speed-up of `planned` over Megatron's interleaved order (data order) against
the activation memory it may hold (x Megatron's peak tokens per rank), for variable-length microbatches.

    python -m megatron_app.sim.frontier [--lengths-file LENGTHS] [--sigmas 0.3,0.6,1.0] [--factors 1.0,1.1,1.25]
        [--shapes 4x2x16,8x2x32] [--seeds 4] [--iterations 3] [--json FILE]

Per row: mean over seeds of interleaved/planned makespan (paired: the same lengths and durations), the worst
seed, planned's largest peak tokens / Megatron's on any rank, interleaved's makespan over the lower bound, and the
planning CPU time per iteration against the simulated iteration. Costs: f = 10 ms, b = 20 ms at the mean length,
scaled by (0.7x + 0.3x^2)/(0.7 + 0.3), x = tokens / mean (lengths.py).
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import List, Optional

from megatron_app.schedule import PipelineShape, ScheduleConfigError
from megatron_app.trace.cli import EXIT_BAD_INPUT, OneLineArgumentParser, positive_int

from .costs import ComputeCosts
from .lengths import MicrobatchLengths
from .simulator import SimConfig, simulate

PROG = "python -m megatron_app.sim.frontier"
FORWARD_US, BACKWARD_US = 10_000.0, 20_000.0


def _floats(text: str) -> List[float]:
    return [float(part) for part in text.split(",") if part]


def _shapes(text: str) -> List[PipelineShape]:
    shapes = []
    for part in text.split(","):
        P, V, m = (int(v) for v in part.split("x"))
        shapes.append(PipelineShape(P, V, m))
    return shapes


def frontier_rows(shape: PipelineShape, sources, factors, seeds, iterations) -> List[dict]:
    rows = []
    costs = ComputeCosts.uniform(shape, FORWARD_US, BACKWARD_US)
    for label, lengths in sources:
        base = {seed: simulate(SimConfig(shape, costs, lengths=lengths, iterations=iterations, seed=seed),
                               "interleaved") for seed in seeds}
        for factor in factors:
            ratios, peaks, planning, iteration = [], [], [], []
            for seed in seeds:
                config = SimConfig(shape, costs, lengths=lengths, iterations=iterations, seed=seed,
                                   memory_factor=factor)
                result = simulate(config, "planned")
                ratios.append(base[seed].makespan_us / result.makespan_us)
                peaks.append(result.peak_tokens_over_megatron)
                planning.append(result.planning_s)
                iteration.append(result.makespan_us / 1e6)
            rows.append({
                "shape": f"P={shape.num_stages} V={shape.num_chunks} m={shape.num_microbatches}", "lengths": label,
                "memory_factor": factor, "speedup_mean": sum(ratios) / len(ratios), "speedup_min": min(ratios),
                "peak_over_megatron_max": max(peaks),
                "interleaved_over_bound": sum(b.makespan_us / b.lower_bound_us for b in base.values()) / len(base),
                "planning_ms": 1e3 * sum(planning) / len(planning),
                "planning_share": sum(p / i for p, i in zip(planning, iteration)) / len(planning)})
    return rows


def format_rows(rows: List[dict]) -> str:
    lines = [f"{'shape':<16} {'lengths':<14} {'mem x':>5} {'speed-up':>8} {'worst':>6} {'peak/Meg':>8} "
             f"{'Meg/bound':>9} {'plan ms':>8} {'plan/iter':>9}"]
    for r in rows:
        lines.append(f"{r['shape']:<16} {r['lengths']:<14} {r['memory_factor']:>5.2f} {r['speedup_mean']:>8.3f} "
                     f"{r['speedup_min']:>6.3f} {r['peak_over_megatron_max']:>8.3f} {r['interleaved_over_bound']:>9.3f} "
                     f"{r['planning_ms']:>8.1f} {r['planning_share']:>9.2%}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths-file", default=None, help="also rows with lengths drawn from this file")
    parser.add_argument("--sigmas", default="0.3,0.6,1.0", help="lognormal log-sds (comma list; '' for none)")
    parser.add_argument("--factors", default="1.0,1.1,1.25", help="memory factors (comma list)")
    parser.add_argument("--shapes", default="4x2x16,8x2x32", help="PxVxm (comma list)")
    parser.add_argument("--seeds", type=positive_int, default=4)
    parser.add_argument("--iterations", type=positive_int, default=3)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    try:
        sigmas, factors, shapes = _floats(args.sigmas), _floats(args.factors), _shapes(args.shapes)
        sources = [(f"sigma {s:g}", MicrobatchLengths(sigma=s)) for s in sigmas]
        if args.lengths_file:
            sources.append(("corpus", MicrobatchLengths.from_file(args.lengths_file)))
        rows = []
        for shape in shapes:
            new = frontier_rows(shape, sources, factors, range(args.seeds), args.iterations)
            print(format_rows(new), flush=True)
            rows += new
        if args.json_path:
            with open(args.json_path, "w", encoding="utf-8") as handle:
                json.dump(rows, handle, indent=1)
    except (ValueError, ScheduleConfigError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
