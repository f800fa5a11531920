"""Draw one traced iteration: the seed's spreadsheet picture (.xlsx) and a true-time timeline (.png).

    python tools/visualize_trace.py --pipeline_parallel P --model_chunks V [--trace-dir D] [--iteration K|last]
                                    [--out-dir O]

Reads the newest complete run of that shape under D (default traces/: traces/latest first) and says which.
Writes trace_pipeline_<P>_model_chunks_<V>.xlsx and .png beside the traces (or in O).
Exit codes: 0 ok, 2 bad input.
"""

from __future__ import annotations


from megatron_app.trace import TraceError
from megatron_app.trace.cli import OutputSet, base_parser, iteration_choice, output_stem, read_chosen_run
from megatron_app.trace.column_layout import layout_columns
from megatron_app.trace.dependencies import InputSources
from megatron_app.trace.metrics import iteration_metrics
from megatron_app.trace.schema import COMPUTE_KINDS
from megatron_app.trace.timeline_plot import write_timeline_png
from megatron_app.trace.xlsx_sheet import write_pipeline_xlsx

PROG = "visualize_trace.py"


def parse_args(argv):
    parser = base_parser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("--iteration", type=iteration_choice, default="last",
                        help="iteration to draw: a number or 'last' (last complete, default)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.iteration == "all":
        raise TraceError("--iteration all is not supported here: the pictures show one iteration "
                         "(give a number or 'last')")
    run, out_dir = read_chosen_run(args)
    (iteration,) = run.select_iterations(args.iteration)
    stages = run.pipeline_view()
    metrics = iteration_metrics(run, iteration)
    info = {"pipeline_parallel": run.pipeline_parallel, "model_chunks": run.model_chunks,
            "microbatches": run.microbatches_of(iteration), "policy": run.policy or "-", "iteration": iteration,
            "source": run.source}
    sources = InputSources(run.pipeline_parallel, run.model_chunks, run.microbatches)
    rows = layout_columns([stage.events_of(iteration, COMPUTE_KINDS) for stage in stages], sources)

    stem = output_stem(args.pipeline_parallel, args.model_chunks)
    with OutputSet(out_dir) as outputs:
        write_pipeline_xlsx(outputs.temp_path(f"{stem}.xlsx"), rows, info, metrics)
        write_timeline_png(outputs.temp_path(f"{stem}.png"), stages, iteration, info, metrics)
        written = outputs.commit()
    bound = "n/a" if metrics.lower_bound_us is None else f"{metrics.lower_bound_us / 1e3:.3f} ms"
    print(f"iteration {iteration}: {metrics.microbatches} microbatches, makespan {metrics.makespan_us / 1e3:.3f} ms, "
          f"lower bound {bound}, mean bubble {metrics.mean_bubble_ratio:.1%}")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0

