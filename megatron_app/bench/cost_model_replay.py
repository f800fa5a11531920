"""What each feature of the learnt cost model buys, measured on real traces: the model is replayed online over a
traced run (it learns iteration i's tasks, then predicts iteration i+1's pipeline) in variants that switch features
off, and each prediction is compared with the measured pipeline.

For each iteration of each pipeline replica, the prediction is the plan evaluator's (plan_search.predicted_makespan)
on the orders every rank actually ran, with durations from the model as it stood before that iteration, and the
iteration's own microbatches (tokens and squared tokens from the trace); measured is the first compute start to the
last compute end on that replica's ranks. Variants (length_costs.LengthCostModel's switches):

  rank 0 only, plain fit     what the planner had before: the planning rank's own tasks, one fit per (kind, chunk),
                             unconstrained least squares over every sample;
  rank 0 only, nn fit        the same samples, non-negative terms, the recent window;
  all ranks pooled           every rank's tasks, still one fit per (kind, chunk);
  per rank                   every rank's tasks, one fit per (kind, chunk, pipeline rank);
  per rank, growth aside     the same, with a microbatch larger than any its fit saw before (a growth sample) set
                             aside while the others determine the fit (length_costs._Fit);
  per rank, growth aside, gaps (now)
                             the same, with each rank's time between its tasks added to every task of it
                             (length_costs.observe_gap; here from the trace as the runtime learns it: the mean
                             time from a task's end to the next's start where the rank waited for no input).
The first four fit growth samples like the others, as the model did before that was added; only the last adds gaps.

    python tools/bench_cost_model.py TRACE_DIR [TRACE_DIR ...] [--warmup 2] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from megatron_app.schedule import KIND_OF_TRACE_NAME, PipelineShape, Task
from megatron_app.schedule.composition_plan import PLANNED_KINDS
from megatron_app.schedule.length_costs import LengthCostModel, by_kind
from megatron_app.schedule.plan_search import predicted_makespan
# name -> (LengthCostModel switches, learns from every rank)
_BEFORE_GAPS = dict(task_gaps=False)
_BEFORE_GROWTH = dict(set_aside_growth=False, **_BEFORE_GAPS)
VARIANTS = {
    "rank 0 only, plain fit": (dict(per_rank=False, non_negative=False, window=None, **_BEFORE_GROWTH), False),
    "rank 0 only, nn fit": (dict(per_rank=False, **_BEFORE_GROWTH), False),
    "all ranks pooled": (dict(per_rank=False, **_BEFORE_GROWTH), True),
    "per rank": (dict(_BEFORE_GROWTH), True),
    "per rank, growth aside": (dict(_BEFORE_GAPS), True),
    "per rank, growth aside, gaps (now)": (dict(), True),
}


@dataclass
class VariantResult:
    variant: str
    errors: List[float] = field(default_factory=list)     # predicted / measured - 1, per evaluated iteration

    @property
    def median_abs(self) -> Optional[float]:
        return statistics.median(abs(e) for e in self.errors) if self.errors else None

    @property
    def max_abs(self) -> Optional[float]:
        return max(abs(e) for e in self.errors) if self.errors else None

    @property
    def bias(self) -> Optional[float]:
        return statistics.median(self.errors) if self.errors else None


def _iteration_tasks(ranks, iteration: int):
    """Per pipeline rank: its compute events of the iteration in the order they ran (forward/backward only)."""
    return [sorted((e for e in rank.events_of(iteration) if e.kind in KIND_OF_TRACE_NAME
                    and KIND_OF_TRACE_NAME[e.kind] in PLANNED_KINDS and "tokens" in e.extra),
                   key=lambda e: e.start) for rank in ranks]


def _gap_seconds(rank, iteration: int, tasks) -> Optional[float]:
    """A rank's mean time from one task's end to the next's start where it waited for no input in between (what
    the runtime learns per call, executor.py), None without such a pair."""
    waits = [e for e in rank.events_of(iteration) if e.kind == "wait"]
    gaps = [after.start - before.end for before, after in zip(tasks, tasks[1:])
            if not any(w.start < after.start and w.end > before.end for w in waits)]
    return max(0.0, sum(gaps) / len(gaps)) / 1e6 if gaps else None


def replay(run, warmup: int = 2) -> Dict[str, VariantResult]:
    """Every variant over every pipeline replica of a trace run (trace.reader.TraceRun); iterations before the
    `warmup`-th predicted one are learnt from but not scored."""
    P, V = run.pipeline_parallel, run.model_chunks
    results = {name: VariantResult(name) for name in VARIANTS}
    for ranks in run.pipelines():
        models = {name: LengthCostModel(**switches) for name, (switches, _) in VARIANTS.items()}
        for position, iteration in enumerate(run.complete_iterations()):
            events = _iteration_tasks(ranks, iteration)
            if any(not rank_events for rank_events in events):
                continue
            m = 1 + max(e.microbatch for rank_events in events for e in rank_events)
            tokens, squared = [0.0] * m, [0.0] * m
            for rank_events in events:
                for e in rank_events:
                    tokens[e.microbatch] = float(e.extra["tokens"])
                    squared[e.microbatch] = float(e.extra.get("squared_tokens", tokens[e.microbatch] ** 2))
            shape = PipelineShape(P, V, m)
            orders = [[Task(KIND_OF_TRACE_NAME[e.kind], e.chunk, e.microbatch) for e in rank_events]
                      for rank_events in events]
            measured = (max(e.end for r in events for e in r) - min(e.start for r in events for e in r)) / 1e6
            for name, model in models.items():
                if position >= warmup and model.calibrated:
                    table = model.duration_table(PLANNED_KINDS, V, tokens, squared, num_stages=P)
                    predicted = predicted_makespan(shape, orders, by_kind(table))
                    results[name].errors.append(predicted / measured - 1.0)
                learns_all = VARIANTS[name][1]
                for pp_rank, rank_events in enumerate(events):
                    if pp_rank and not learns_all:
                        continue
                    gap = _gap_seconds(ranks[pp_rank], iteration, rank_events)
                    if gap is not None:
                        model.observe_gap(gap, rank=pp_rank, warmup=position == 0)
                    for e in rank_events:
                        model.observe(KIND_OF_TRACE_NAME[e.kind], e.chunk, tokens[e.microbatch], e.duration / 1e6,
                                      squared[e.microbatch], rank=pp_rank, warmup=position == 0)
    return results


def format_table(label: str, results: Dict[str, VariantResult]) -> str:
    lines = [f"{label}", f"  {'variant':<36} {'n':>3} {'median |err|':>13} {'max |err|':>10} {'median err':>11}"]
    for result in results.values():
        if not result.errors:
            lines.append(f"  {result.variant:<36} {0:>3} {'-':>13} {'-':>10} {'-':>11}")
            continue
        lines.append(f"  {result.variant:<36} {len(result.errors):>3} {100 * result.median_abs:>12.1f}% "
                     f"{100 * result.max_abs:>9.1f}% {100 * result.bias:>+10.1f}%")
    return "\n".join(lines)


def write_json(path: str, by_trace: Dict[str, Dict[str, VariantResult]]) -> None:
    payload = {trace: [{**asdict(r), "median_abs": r.median_abs, "max_abs": r.max_abs, "bias": r.bias}
                       for r in results.values()] for trace, results in by_trace.items()}
    with open(path, "w") as out:
        json.dump(payload, out, indent=1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_app.trace.cli import EXIT_BAD_INPUT, OneLineArgumentParser
    from megatron_app.trace.reader import read_trace_dir
    from megatron_app.trace.schema import TraceError

    parser = OneLineArgumentParser(prog="bench_cost_model", description=__doc__.splitlines()[0])
    parser.add_argument("trace_dirs", nargs="+", help="trace directories of real runs told their lengths")
    parser.add_argument("--warmup", type=int, default=2,
                        help="iterations learnt from before predictions are scored (default 2)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the model needs one iteration to learn from)")
    by_trace = {}
    for trace_dir in args.trace_dirs:
        try:
            run = read_trace_dir(trace_dir)
        except (TraceError, OSError) as error:
            print(f"bench_cost_model: {error}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        by_trace[trace_dir] = replay(run, args.warmup)
        print(format_table(f"{trace_dir} (P={run.pipeline_parallel} V={run.model_chunks}, "
                           f"{len(run.pipelines())} replica(s))", by_trace[trace_dir]), flush=True)
    if args.json:
        write_json(args.json, by_trace)
    return 0
