"""python -m megatron_app.sim: simulate schedule policies under a cost model and print a comparison table.

    python -m megatron_app.sim --pipeline_parallel 4 --model_chunks 2 --microbatches 8 --policy all \
        --fwd-ms 10 --bwd-ms 20 [--slow-rank 1 --slow-factor 1.5] [--jitter 0.3] \
        [--straggler-prob 0.1 --straggler-factor 3] [--link-latency-us 20 --link-gbps 100 --tensor-bytes 16777216] \
        [--slow-link 1-2:0-300:10] [--memory-cap N] [--iterations 3] [--seed 0] [--trace-dir D] [--json FILE]
        [--length-sigma 1.0 | --lengths-file LENGTHS] [--length-cost 0.7,0.3] [--memory-factor 1.1]
    python -m megatron_app.sim --pipeline_parallel 4 --model_chunks 2 --microbatches 16 \
        --lengths-file docs/results/lengths/copyright_2048.txt --documents-per-microbatch 2 [--host-ms 0.4]

With variable lengths (--length-sigma: lognormal; --lengths-file: one token count per line, e.g. a corpus's
documents) each microbatch's tasks cost --fwd-ms/--bwd-ms x (a x + b x^2)/(a + b), x = tokens / mean tokens, and its
activations are sized by its tokens; the table adds the peak activation tokens against Megatron's data-order peak.
With --documents-per-microbatch K the lengths are documents and each loader microbatch holds K of them: the table
compares compositions instead of policies (sim/composition.py: loader padded, loader packed, a loader-order packer
to a token budget as Megatron's, and the balanced planner), each task paying --host-ms of runtime overhead.

Bad options print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import List, Optional

from megatron_app.quiet import silence_third_party_warnings
from megatron_app.schedule import POLICY_NAMES, PipelineShape, ScheduleConfigError, policies_for
from megatron_app.schedule.planned import DEFAULT_MEMORY_FACTOR
from megatron_app.trace.cli import EXIT_BAD_INPUT, OneLineArgumentParser, non_negative_int, number, positive_int

from .costs import ComputeCosts, ComputePerturbations
from .lengths import MicrobatchLengths
from .network import US_PER_MS, LinkCosts, SlowLink
from .simulator import SimConfig, SimResult, simulate

PROG = "python -m megatron_app.sim"
ALL = "all"
# Up to this many ranks the table lists every rank's peak activations; beyond, only the largest.
MAX_LISTED_RANKS = 8
POLICY_WIDTH = max(12, *map(len, POLICY_NAMES))   # the tables' policy column


def _slow_link(text: str) -> SlowLink:
    try:
        return SlowLink.parse(text)
    except ScheduleConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _length_cost(text: str):
    try:
        linear, quadratic = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A,B (two numbers), got {text!r}") from None
    if not (linear >= 0 and quadratic >= 0 and linear + quadratic > 0):
        raise argparse.ArgumentTypeError(f"A and B must be >= 0 and not both 0, got {text!r}")
    return linear, quadratic


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--pipeline_parallel", "--pipeline-parallel", dest="pipeline_parallel", type=positive_int, required=True,
        help="pipeline stages P")
    add("--model_chunks", "--model-chunks", dest="model_chunks", type=positive_int, default=1,
        help="model chunks per rank V (default 1)")
    add("--microbatches", type=positive_int, required=True, help="microbatches per iteration m")
    add("--microbatch-group-size", "--microbatch_group_size", dest="microbatch_group_size", type=positive_int,
        default=None, help="Megatron's microbatch_group_size_per_vp_stage (default P)")
    add("--policy", choices=POLICY_NAMES + (ALL,), default=ALL, help="policy to simulate (default all)")
    add("--fwd-ms", "--fwd_ms", dest="fwd_ms", type=number(0.0), default=10.0,
        help="forward time of one chunk, ms (default 10)")
    add("--bwd-ms", "--bwd_ms", dest="bwd_ms", type=number(0.0), default=20.0,
        help="backward time of one chunk, ms (default 20)")
    add("--split-backward", "--split_backward", dest="split_backward", action="store_true",
        help="each backward as B (input gradient) + W (weight gradients), W = --weight-share of --bwd-ms")
    add("--weight-share", "--weight_share", dest="weight_share", type=number(0.0), default=0.5,
        help="with --split-backward: W's share of a backward (default 0.5)")
    add("--slow-rank", "--slow_rank", dest="slow_rank", type=non_negative_int, default=None,
        help="rank whose every task is --slow-factor times longer")
    add("--slow-factor", "--slow_factor", dest="slow_factor", type=number(1.0), default=None,
        help="slowdown of --slow-rank (>= 1, default 1.5)")
    add("--jitter", type=number(0.0), default=0.0, help="each task takes U(1-x, 1+x) times its cost, 0 <= x < 1")
    add("--straggler-prob", "--straggler_prob", dest="straggler_prob", type=number(0.0), default=0.0,
        help="probability that a task is a straggler")
    add("--straggler-factor", "--straggler_factor", dest="straggler_factor", type=number(1.0), default=3.0,
        help="slowdown of a straggler task (default 3)")
    add("--link-latency-us", "--link_latency_us", dest="link_latency_us", type=number(0.0), default=0.0,
        help="latency of every message, us (default 0)")
    add("--link-gbps", "--link_gbps", dest="link_gbps", type=number(0.0, inclusive=False), default=math.inf,
        help="link bandwidth, gigabits/s (default: unlimited)")
    add("--tensor-bytes", "--tensor_bytes", dest="tensor_bytes", type=non_negative_int, default=0,
        help="bytes per message (default 0)")
    add("--slow-link", "--slow_link", dest="slow_links", type=_slow_link, action="append", default=[],
        help="A-B:START_MS-END_MS:FACTOR, both directions between ranks A and B; repeatable")
    add("--memory-cap", "--memory_cap", dest="memory_cap", type=positive_int, default=None,
        help="activations a rank may hold (default: Megatron's interleaved peak per rank)")
    lengths = parser.add_mutually_exclusive_group()
    lengths.add_argument("--length-sigma", "--length_sigma", dest="length_sigma", type=number(0.0), default=None,
                         help="microbatch lengths lognormal with this log-sd (variable-length scenario)")
    lengths.add_argument("--lengths-file", "--lengths_file", dest="lengths_file", default=None,
                         help="draw microbatch lengths from this file (one token count per line)")
    add("--median-tokens", "--median_tokens", dest="median_tokens", type=positive_int, default=256,
        help="median microbatch length for --length-sigma (default 256)")
    add("--length-cost", "--length_cost", dest="length_cost", type=_length_cost, default=(0.7, 0.3),
        help="A,B: a microbatch costs (A x + B x^2)/(A + B) times the base, x = tokens / mean (default 0.7,0.3)")
    add("--memory-factor", "--memory_factor", dest="memory_factor", type=number(1.0), default=None,
        help="planned: activation tokens a rank may hold, x Megatron's data-order peak (default 1.0)")
    add("--documents-per-microbatch", "--documents_per_microbatch", dest="documents_per_microbatch",
        type=positive_int, default=None,
        help="compare compositions: lengths are documents, K per loader microbatch (needs --lengths-file)")
    add("--data-parallel", "--data_parallel", dest="data_parallel", type=positive_int, default=1,
        help="with --documents-per-microbatch: data-parallel replicas D, each m x K documents of the global batch; "
             "the iteration is the slowest replica plus --allreduce-ms (default 1)")
    add("--allreduce-ms", "--allreduce_ms", dest="allreduce_ms", type=number(0.0), default=0.0,
        help="with --data-parallel: the gradient all-reduce after the slowest replica, ms (default 0)")
    add("--slow-replica", "--slow_replica", dest="slow_replica", type=non_negative_int, default=None,
        help="with --data-parallel: this replica's every task is --replica-slowdown times longer; adds a "
             "speed-blind balanced row")
    add("--replica-slowdown", "--replica_slowdown", dest="replica_slowdown", type=number(1.0), default=1.3,
        help="slowdown of --slow-replica (>= 1, default 1.3)")
    add("--cost-curves", "--cost_curves", dest="cost_curves", default=None, metavar="FILE",
        help="with --documents-per-microbatch: task costs fitted on a real trace (python -m "
             "megatron_app.sim.cost_curves) instead of --fwd-ms/--bwd-ms and --length-cost")
    add("--num-layers", "--num_layers", dest="num_layers", type=positive_int, default=8,
        help="with --cost-curves: the model's transformer layers, spread over P x V chunks (default 8)")
    add("--host-ms", "--host_ms", dest="host_ms", type=number(0.0), default=None,
        help="with --documents-per-microbatch: the runtime's own time per task, ms (default 0.4, measured; a "
             "traced run's process_trace 'gap us' column measures the runtime's time between tasks)")
    add("--iterations", type=positive_int, default=1, help="iterations, separated by a barrier (default 1)")
    add("--seed", type=non_negative_int, default=0, help="seed of the random perturbations (default 0)")
    add("--trace-dir", "--trace_dir", dest="trace_dir", default=None,
        help="write trace_rank<r>.jsonl files here (with --policy all: one sub-directory per policy)")
    add("--json", dest="json_path", default=None, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.slow_factor is not None and args.slow_rank is None:
        parser.error("--slow-factor needs --slow-rank")
    if args.cost_curves is not None and args.documents_per_microbatch is None:
        parser.error("--cost-curves needs --documents-per-microbatch (the curves cost composed microbatches; "
                     "without it they were ignored)")
    if args.data_parallel > 1 and args.documents_per_microbatch is None:
        parser.error("--data-parallel needs --documents-per-microbatch (it compares compositions across replicas)")
    if args.slow_replica is not None and args.slow_replica >= args.data_parallel:
        parser.error(f"--slow-replica {args.slow_replica} is not a replica of --data-parallel {args.data_parallel}")
    if args.straggler_prob > 1:
        parser.error(f"argument --straggler-prob: expected a probability in [0, 1], got {args.straggler_prob:g}")
    return args


def build_config(args: argparse.Namespace) -> SimConfig:
    shape = PipelineShape(args.pipeline_parallel, args.model_chunks, args.microbatches,
                          microbatch_group_size=args.microbatch_group_size, split_backward=args.split_backward)
    perturbations = ComputePerturbations(
        slow_rank=args.slow_rank, slow_factor=1.5 if args.slow_factor is None else args.slow_factor,
        jitter=args.jitter, straggler_prob=args.straggler_prob, straggler_factor=args.straggler_factor)
    links = LinkCosts(latency_us=args.link_latency_us, gbps=args.link_gbps, tensor_bytes=args.tensor_bytes,
                      slow_links=tuple(args.slow_links))
    lengths = None
    linear, quadratic = args.length_cost
    if args.lengths_file is not None:
        lengths = MicrobatchLengths.from_file(args.lengths_file, linear=linear, quadratic=quadratic)
    elif args.length_sigma is not None:
        lengths = MicrobatchLengths(sigma=args.length_sigma, median_tokens=args.median_tokens, linear=linear,
                                    quadratic=quadratic)
    compute = ComputeCosts.uniform(shape, args.fwd_ms * US_PER_MS, args.bwd_ms * US_PER_MS)
    compute = ComputeCosts(compute.forward_us, compute.backward_us, weight_share=args.weight_share)
    return SimConfig(shape, compute,
                     links=links, perturbations=perturbations, iterations=args.iterations, seed=args.seed,
                     memory_cap=args.memory_cap, lengths=lengths, memory_factor=args.memory_factor)


def policies_to_run(choice: str, shape: PipelineShape) -> List[str]:
    if choice != ALL:
        return [choice]
    return list(policies_for(shape))


def format_table(config: SimConfig, results: List[SimResult]) -> str:
    shape = config.shape
    lines = [f"P={shape.num_stages} V={shape.num_chunks} m={shape.num_microbatches} "
             f"iterations={config.iterations} seed={config.seed}"]
    variable = config.lengths is not None
    header = (f"{'policy':<{POLICY_WIDTH}} {'makespan ms':>12} {'lower bound ms':>15} {'x bound':>8} {'bubble':>7}  "
              + (f"{'tokens/Megatron':>15} {'plan ms':>8}  peak activation tokens per rank" if variable
                 else "peak activations per rank"))
    lines.append(header)
    for result in results:
        peaks = result.peak_activations
        extra = ""
        if variable:
            peaks = [int(round(p)) for p in result.peak_activation_tokens]
            extra = f"{result.peak_tokens_over_megatron:>15.3f} {result.planning_s * 1e3:>8.1f}  "
        peak_text = (",".join(map(str, peaks)) if len(peaks) <= MAX_LISTED_RANKS
                     else f"max {max(peaks)} (rank {peaks.index(max(peaks))})")
        ratio = result.makespan_us / result.lower_bound_us if result.lower_bound_us > 0 else math.nan
        lines.append(f"{result.policy:<{POLICY_WIDTH}} {result.makespan_us / US_PER_MS:>12.3f} "
                     f"{result.lower_bound_us / US_PER_MS:>15.3f} {ratio:>8.3f} {result.bubble_ratio:>7.1%}  "
                     f"{extra}{peak_text}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    with warnings.catch_warnings():
        # megatron-core (imported for its static orders) warns that optional CUDA extensions are missing.
        silence_third_party_warnings()
        return _run(args)


def _run_compositions(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .cost_curves import CostCurves
    from .composition import (BALANCED_ROW, COMPOSITION_ROWS, DATA_PARALLEL_ROWS, DEFAULT_HOST_US,
                              CompositionSimConfig, format_composition_table, simulate_composition)

    linear, quadratic = args.length_cost
    lengths = MicrobatchLengths.from_file(args.lengths_file, linear=linear, quadratic=quadratic)
    curves = None if args.cost_curves is None else CostCurves.load(args.cost_curves)
    if curves is not None:   # the simulator's model is the traced one at --num-layers: say which, once
        print(curves.replay_note(args.num_layers), file=sys.stderr, flush=True)
    config = CompositionSimConfig(
        args.pipeline_parallel, args.model_chunks, args.microbatches, args.documents_per_microbatch, lengths,
        forward_us=args.fwd_ms * US_PER_MS, backward_us=args.bwd_ms * US_PER_MS,
        host_us=DEFAULT_HOST_US if args.host_ms is None else args.host_ms * US_PER_MS,
        iterations=max(args.iterations, 2), seed=args.seed, memory_factor=args.memory_factor or DEFAULT_MEMORY_FACTOR,
        data_parallel=args.data_parallel, allreduce_us=args.allreduce_ms * US_PER_MS,
        cost_curves=curves, num_layers=args.num_layers,
        replica_speeds=None if args.slow_replica is None else tuple(
            1.0 / args.replica_slowdown if r == args.slow_replica else 1.0 for r in range(args.data_parallel)))
    results = [simulate_composition(config, row)
               for row in (DATA_PARALLEL_ROWS if args.data_parallel > 1 else COMPOSITION_ROWS)]
    if args.slow_replica is not None:
        blind = simulate_composition(replace(config, speed_aware=False), BALANCED_ROW)
        blind.row = "balanced-blind"
        results.append(blind)
    print(format_composition_table(config, results))
    if args.json_path is not None:
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump({"config": {"pipeline_parallel": config.num_stages, "model_chunks": config.num_chunks,
                                  "microbatches": config.loader_microbatches,
                                  "documents_per_microbatch": config.documents_per_microbatch,
                                  "host_us": config.host_us, "lengths": lengths.describe(), "seed": config.seed,
                                  "iterations": config.iterations, "data_parallel": config.data_parallel,
                                  "replica_speeds": list(config.speeds), "allreduce_us": config.allreduce_us,
                                  "cost_curves": args.cost_curves, "num_layers": config.num_layers,
                                  "traced_model": None if curves is None else curves.model},
                       "results": [r.to_dict() for r in results]}, handle, indent=1)
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.documents_per_microbatch is not None:
        if args.lengths_file is None:
            print(f"{PROG}: error: --documents-per-microbatch needs --lengths-file", file=sys.stderr)
            return EXIT_BAD_INPUT
        try:
            return _run_compositions(args)
        except (ScheduleConfigError, OSError) as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        config = build_config(args)
        names = policies_to_run(args.policy, config.shape)
        results, skipped = [], []
        for name in names:
            trace_dir = None
            if args.trace_dir is not None:
                trace_dir = Path(args.trace_dir) / name if args.policy == ALL else Path(args.trace_dir)
            try:
                results.append(simulate(config, name, trace_dir=trace_dir))
            except ScheduleConfigError as exc:
                if args.policy != ALL:
                    raise
                skipped.append(f"{name}: skipped ({exc})")   # e.g. a static order above --memory-cap
        print("\n".join([format_table(config, results)] + skipped))
        if args.json_path is not None:
            with open(args.json_path, "w", encoding="utf-8") as handle:
                json.dump({"config": config.describe(), "results": [r.to_dict() for r in results]}, handle,
                          indent=1)
    except (ScheduleConfigError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0
