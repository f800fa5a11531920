"""How long the `balanced` composition planner takes against the iteration it plans, at scale (no ranks run).

    python -m megatron_app.bench.planning_scale --pipeline-parallel 64 --model-chunks 4 --documents 4096 \\
        --lengths-file docs/results/lengths/copyright_2048.txt --micro-batch-size 2 [--data-parallel D]

Draws the global batch's documents from a lengths file (seeded), teaches the cost model the simulator's cost of a
microbatch (forward 10 ms / backward 20 ms on a mean-length document, 0.7 T + 0.3 S with T tokens and S the squared
document lengths over the mean, as sim/composition.py), plans the whole job once (plan_iteration: with
--data-parallel D, --documents is the global batch of all replicas) and prints the planner's CPU time next to the
iteration it predicts for its own plan (the slowest replica; the share the runtime's 2% budget is about) and for the
loader's.

The small end, where a plan's few milliseconds are a share of a short iteration:

    python -m megatron_app.bench.planning_scale --pipeline-parallel 2 --model-chunks 2 --documents 32 \
        --lengths-file docs/results/lengths/corpus_256.txt --budget-ms 2.3 --repeats 20 [--composition packed]

--budget-ms plans under a fixed budget (the runtime's after a short iteration: 2% of the last one), and --repeats
plans that many times, the cost model taught once more before each (the runtime refits after every call), and
prints the median planning time.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from megatron_app.schedule.composition import BALANCED, PACKED
from megatron_app.schedule.iteration_plan import PipelineSpec, PlanRequest, plan_iteration
from megatron_app.schedule.length_costs import LengthCostModel
from megatron_app.schedule.tasks import Kind

FORWARD_S, BACKWARD_S = 0.010, 0.020


def taught_costs(num_chunks: int, mean_tokens: float, costs: LengthCostModel = None) -> LengthCostModel:
    """A cost model (`costs`, or a new one) that has observed the simulator's cost function at a spread of
    compositions."""
    costs = costs if costs is not None else LengthCostModel()
    for tokens in (0.25, 0.5, 1.0, 2.0, 4.0):
        for squared_share in (0.5, 1.0):
            t = tokens * mean_tokens
            s = squared_share * t * t
            factor = 0.7 * t / mean_tokens + 0.3 * s / (mean_tokens * mean_tokens)
            for chunk in range(num_chunks):
                costs.observe(Kind.FORWARD, chunk, t, FORWARD_S * factor, s)
                costs.observe(Kind.BACKWARD, chunk, t, BACKWARD_S * factor, s)
    return costs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline-parallel", type=int, default=64)
    parser.add_argument("--model-chunks", type=int, default=4)
    parser.add_argument("--documents", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--lengths-file", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--planning-share", type=float, default=0.02,
                        help="the runtime's planning budget, a share of the predicted iteration (default 0.02)")
    parser.add_argument("--unbounded", action="store_true", help="search without the budget")
    parser.add_argument("--budget-ms", type=float, default=None,
                        help="a fixed budget instead of --planning-share (the runtime's after a short iteration)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="plans, each after the cost model is taught once more; the median time is reported")
    parser.add_argument("--composition", choices=(BALANCED, PACKED), default=BALANCED,
                        help="packed: the loader's microbatches packed, only their order planned")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    corpus = np.loadtxt(args.lengths_file, dtype=np.int64, ndmin=1)
    lengths = np.random.default_rng(args.seed).choice(corpus, size=args.documents).tolist()
    costs = taught_costs(args.model_chunks, float(np.mean(corpus)))
    request = PlanRequest(tuple(int(v) for v in lengths), args.composition, args.micro_batch_size,
                          PipelineSpec(args.pipeline_parallel, args.model_chunks), num_replicas=args.data_parallel,
                          plan_order=args.composition == PACKED)
    times = []
    for repeat in range(args.repeats):
        if repeat:
            taught_costs(args.model_chunks, float(np.mean(corpus)), costs)   # new samples: every fit refits
        began = time.process_time()
        # The runtime's budget rule (runtime/composition.py): stop searching at this share of the predicted
        # iteration, or at a fixed budget.
        stop = None if args.unbounded else (
            (lambda _: time.process_time() - began > args.budget_ms / 1e3) if args.budget_ms is not None else
            (lambda predicted_s: time.process_time() - began > args.planning_share * predicted_s))
        plan = plan_iteration(request, costs, stop=stop)
        times.append(time.process_time() - began)
    planning_s = float(np.median(times))
    counts = [replica.num_microbatches for replica in plan.replicas]
    result = {"budget": None if args.unbounded else args.budget_ms / 1e3 if args.budget_ms is not None else
              args.planning_share, "repeats": args.repeats, "composition": args.composition,
              "pipeline_parallel": args.pipeline_parallel,
              "model_chunks": args.model_chunks, "data_parallel": args.data_parallel, "documents": args.documents,
              "microbatches": counts, "cross_replica": plan.cross_replica, "planning_cpu_s": planning_s,
              "predicted_iteration_s": plan.predicted_s, "predicted_loader_iteration_s": plan.predicted_loader_s,
              "planning_share": planning_s / plan.predicted_s}
    repeats = f" (median of {args.repeats})" if args.repeats > 1 else ""
    loader = "" if plan.predicted_loader_s is None else f" (loader's {plan.predicted_loader_s:.1f} s)"
    print(f"P={args.pipeline_parallel} V={args.model_chunks} D={args.data_parallel}, {args.documents} documents -> "
          f"{min(counts)}-{max(counts)} microbatches a replica: planning {planning_s:.4f} s CPU{repeats}, predicted "
          f"iteration {plan.predicted_s:.1f} s{loader}, planning {100 * result['planning_share']:.2f}% of it")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
