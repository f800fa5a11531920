"""Merge per-rank trace files into a Chrome/Perfetto trace, compute pipeline metrics, check causality.

    python tools/process_trace.py --pipeline_parallel P --model_chunks V [--trace-dir D] [--iteration K|last|all]
                                  [--out-dir O] [--strict] [--tolerance-us T]
    python tools/process_trace.py D [...]          # P and V, when not given, are the chosen run's own

Reads the newest complete run of that shape under D (default traces/: traces/latest first) and says which.
Writes trace_pipeline_<P>_model_chunks_<V>.json (open in ui.perfetto.dev), ..._metrics.json, ..._metrics.csv
beside the traces (or in O) and prints a summary. Exit codes: 0 ok, 1 causality violations with --strict, 2 bad input.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from megatron_app.trace.causality import check_causality
from megatron_app.trace.chrome import chrome_trace
from megatron_app.trace.cli import OutputSet, base_parser, iteration_choice, output_stem, read_chosen_run
from megatron_app.trace.metrics import CSV_COLUMNS, IterationMetrics, csv_rows, iteration_metrics
from megatron_app.trace.prediction import format_report as format_prediction, prediction_report

PROG = "process_trace.py"
EXIT_VIOLATIONS = 1
MAX_VIOLATIONS_SHOWN = 20


def parse_args(argv):
    parser = base_parser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--iteration", type=iteration_choice, default="last",
                        help="iteration to analyse: a number, 'last' (last complete, default) or 'all'")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the causality check finds violations")
    parser.add_argument("--tolerance-us", "--tolerance_us", dest="tolerance_us", type=float, default=0.0,
                        help="clock-alignment slack for the causality check, in microseconds (default 0)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    run, out_dir = read_chosen_run(args)
    iterations = run.select_iterations(args.iteration)
    metrics = [iteration_metrics(run, k) for k in iterations]
    predictions = [report for k in iterations
                   if (report := prediction_report(k, [e for rank in run.ranks for e in rank.events_of(k)]))]
    violations = check_causality(run, iterations, tolerance_us=args.tolerance_us)
    stem = output_stem(args.pipeline_parallel, args.model_chunks)
    summary = {
        "trace_dir": str(run.trace_dir), "pipeline_parallel": run.pipeline_parallel,
        "model_chunks": run.model_chunks, "policy": run.policy,
        "source": run.source, "ranks": len(run.ranks), "iterations": [m.to_dict() for m in metrics],
        "causality_violations": [v.to_dict() for v in violations],
        "predicted_vs_measured": [report.to_dict() for report in predictions],
    }
    with OutputSet(out_dir) as outputs:
        _write_json(outputs.temp_path(f"{stem}.json"), chrome_trace(run, iterations))
        _write_json(outputs.temp_path(f"{stem}_metrics.json"), summary)
        with open(outputs.temp_path(f"{stem}_metrics.csv"), "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(csv_rows(metrics))
        written = outputs.commit()

    print(format_summary(run, metrics))
    for report in predictions:
        print(format_prediction(report))
    if violations:
        print(f"causality: {len(violations)} violation(s)")
        for violation in violations[:MAX_VIOLATIONS_SHOWN]:
            print(f"  {violation.describe()}")
        if len(violations) > MAX_VIOLATIONS_SHOWN:
            print(f"  ... {len(violations) - MAX_VIOLATIONS_SHOWN} more in {stem}_metrics.json")
    else:
        print("causality: ok (no task started before its input was produced)")
    print("wrote " + ", ".join(str(p) for p in written))
    return EXIT_VIOLATIONS if (violations and args.strict) else 0


def format_summary(run, metrics: list[IterationMetrics]) -> str:
    lines = [f"pipeline_parallel={run.pipeline_parallel} model_chunks={run.model_chunks} "
             f"policy={run.policy or '-'} source={run.source} ranks={len(run.ranks)}"]
    header = (f"{'rank':>5} {'pp':>3} {'tasks':>5} {'compute ms':>11} {'idle ms':>9} {'bubble':>7} "
              f"{'wait ms':>9} {'gap us':>7} {'host-bound':>10} {'gc ms':>6} {'sends':>5} {'peak act':>8} "
              f"{'peak MiB':>8}")
    for it in metrics:
        extra = f", iteration time {it.iteration_time_us / 1e3:.3f} ms" if it.iteration_time_us is not None else ""
        bound = "n/a" if it.lower_bound_us is None else f"{it.lower_bound_us / 1e3:.3f} ms"
        lines.append(f"iteration {it.iteration}: {it.microbatches} microbatches, makespan {it.makespan_us / 1e3:.3f} "
                     f"ms, lower bound {bound} (x bound {_ratio(it.makespan_over_lower_bound)}; busiest rank's "
                     f"compute {it.ideal_us / 1e3:.3f} ms), mean bubble {it.mean_bubble_ratio:.1%}{extra}")
        lines.append(header)
        for r in it.ranks:
            lines.append(f"{r.global_rank:>5} {r.pp_rank:>3} {r.tasks:>5} {r.compute_us / 1e3:>11.3f} "
                         f"{r.idle_us / 1e3:>9.3f} {r.bubble_ratio:>7.1%} {r.comm_wait_us / 1e3:>9.3f} "
                         f"{'-' if r.task_gap_us is None else f'{r.task_gap_us:.1f}':>7} "
                         f"{_share(r.host_bound_us, r.compute_us):>10} "
                         f"{'-' if r.gc_us is None else f'{r.gc_us / 1e3:.1f}':>6} "
                         f"{r.max_sends_in_flight:>5} {r.peak_activations:>8} "
                         f"{'-' if r.peak_memory_mib is None else f'{r.peak_memory_mib:.0f}':>8}")
    return "\n".join(lines)


def _share(part: float | None, whole: float) -> str:
    return "-" if part is None or whole <= 0 else f"{min(1.0, part / whole):.1%}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(obj, handle, separators=(",", ":"), allow_nan=False)

