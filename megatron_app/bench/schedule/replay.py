"""tools/bench_schedule.py --replay-trace: the simulator against a traced run, iteration by iteration."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_app.trace import TraceError


def replay_main(args) -> int:
    """--replay-trace: per complete iteration, measured makespan vs the simulator fed with its task durations."""
    from megatron_app.schedule import ScheduleConfigError
    from megatron_app.trace import read_trace_dir
    from megatron_app.trace.metrics import iteration_metrics
    from megatron_app.emulation.sim_replay import replay_trace_iteration

    run = read_trace_dir(args.replay_trace)
    policy = args.policy or run.policy
    rows = []
    try:
        for iteration in run.select_iterations("all"):
            measured = iteration_metrics(run, iteration).makespan_us / 1e3
            simulated = replay_trace_iteration(run, iteration, policy, latency_us=args.sim_latency_us)
            rows.append({"iteration": iteration, "microbatches": run.microbatches_of(iteration),
                         "measured_ms": measured, "sim_ms": simulated.makespan_us / 1e3,
                         "error": measured / (simulated.makespan_us / 1e3) - 1.0})
    except (ScheduleConfigError, ValueError) as exc:
        raise TraceError(str(exc)) from None
    print(f"{run.trace_dir}: P={run.pipeline_parallel} V={run.model_chunks}, simulated policy "
          f"{policy}, message latency {args.sim_latency_us:g} us")
    print(f"{'iteration':>9} {'m':>4} {'measured ms':>12} {'sim ms':>9} {'error':>8}")
    for row in rows:
        print(f"{row['iteration']:>9} {row['microbatches']:>4} {row['measured_ms']:>12.1f} {row['sim_ms']:>9.1f} "
              f"{row['error']:>+8.1%}")
    errors = sorted(abs(row["error"]) for row in rows)
    median = errors[len(errors) // 2]
    print(f"median |error| {median:.1%}: {'within' if median <= 0.15 else 'NOT within'} 15%")
    if args.json:
        Path(args.json).write_text(json.dumps({"trace_dir": str(run.trace_dir), "policy": policy,
                                               "iterations": rows, "median_abs_error": median}, indent=1))
    return 0
