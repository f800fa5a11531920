"""Schedules head to head on emulated compute: megatron_app's runtime (dfc, bfc, adaptive, Megatron's interleaved
and 1f1b orders) and torch.distributed.pipelining (Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble), same process count, same per-task durations, in one run.

    python tools/bench_schedule.py [--pipeline_parallel 4 --model_chunks 2 --microbatches 8 --fwd-ms 10 --bwd-ms 20]
                                   [--iters 5 --warmup 2 --repeats 1] [--scenarios ...] [--schedules ...]
                                   [--json FILE] [--png FILE] [--work-dir DIR] [--quick]
    python tools/bench_schedule.py --replay-trace TRACE_DIR [--policy NAME]   # simulator vs a traced run
    python tools/bench_schedule.py [same flags] --analyse-only WORK_DIR/benchXXXX  # re-analyse a kept run

Scenarios: homogeneous; one rank 1.5x slower; per-task jitter +-30%; stragglers (10% of tasks 3x); one slow link
(messages between the two middle ranks posted in the first 30 forward-times of an iteration arrive 1.2 forward-times
late). On request, `--scenarios variable-length`: microbatch lengths drawn per iteration from a real corpus's token
counts (--lengths-file, default tools/corpus_lengths.py's), every task scaled by the simulator's f(tokens),
activations sized by tokens, the lengths told to the schedule; rows average over iterations, add peak activation
tokens per rank, and skip torch.distributed.pipelining (one shape per stage). Compute is emulated by timed waits
(megatron_app.emulation), so P ranks share 2 cores without CPU contention. Prints a table (iteration time = median of the measured iterations, bubble ratio, peak activations per
rank, the simulator's prediction from the same cost model, its lower bound, its error when fed with the run's
measured task durations, and the measured makespan over the lower bound of those measured durations: "own bound"),
then the issue's targets, pass or fail. 1f1b rows run with one chunk per rank and each task V times longer (the same model).

Composition (issue 23), on request: `--scenarios copyright-2048,copyright-8192` draw m x 2 whole documents per
iteration from the copyright corpus's token counts (docs/results/lengths/), and the rows differ in which documents
form each microbatch (COMPOSITION_ROWS: Megatron's interleaved order on the loader's groups padded = the baseline,
the same groups packed, a DpBalanced-style loader-order packer, ours = balanced + planned); the variable-length
scenario runs them too when --schedules names them (one document a loader microbatch). Their rows add the microbatch
count, padding share, peak activation tokens per rank over the baseline's, and a simulator prediction from
megatron_app.sim's composition rows. With composition rows the run also measures the runtime's host cost per task
once (bench.schedule.analysis.measure_host_cost) and every row's simulator prediction adds it; --host-ms gives it
instead (and applies it to any run).
Bad options print one line and exit 2; a failed worker exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

from megatron_app.bench.schedule.plan import build_plan, last_error, run_workers
from megatron_app.bench.schedule.report import format_checks, format_composition_rows, format_table, machine, write_png
from megatron_app.bench.schedule.replay import replay_main
from megatron_app.bench.schedule.rows import COMPOSITION_ROWS, DEFAULT_SCHEDULE_KEYS, SCHEDULES, runs_torch
from megatron_app.bench.schedule.scenarios import (ALL_SCENARIO_KEYS, FIXED_SHAPE_NOTE, HOST_PROBE, REPO,
                                                   SCENARIO_KEYS, VARIABLE_LENGTH, VARIABLE_LENGTH_KEY)
from megatron_app.trace import TraceError
from megatron_app.trace.cli import OneLineArgumentParser, non_negative_int, number, positive_int

PROG = "bench_schedule.py"
EXIT_WORKER_FAILED = 1
# Full run and --quick defaults (P, V, m, fwd, bwd, iters, warmup).
FULL = dict(pipeline_parallel=4, model_chunks=2, microbatches=8, fwd_ms=10.0, bwd_ms=20.0, iters=5, warmup=2)
QUICK = dict(pipeline_parallel=2, model_chunks=2, microbatches=4, fwd_ms=2.0, bwd_ms=4.0, iters=2, warmup=1)


class UsageError(ValueError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--pipeline_parallel", "--pipeline-parallel", "-P", dest="pipeline_parallel", type=positive_int,
        help="ranks P (4; --quick 2)")
    add("--model_chunks", "--model-chunks", "-V", dest="model_chunks", type=positive_int, help="chunks per rank (2)")
    add("--microbatches", "-m", type=positive_int, help="microbatches per iteration (8; --quick 4)")
    add("--fwd-ms", "--fwd_ms", dest="fwd_ms", type=number(0, inclusive=False, finite=True), help="forward of one chunk (10; --quick 2)")
    add("--bwd-ms", "--bwd_ms", dest="bwd_ms", type=number(0, inclusive=False, finite=True), help="backward of one chunk (20; --quick 4)")
    add("--iters", type=positive_int, help="measured iterations (5; --quick 2)")
    add("--repeats", type=positive_int, default=1,
        help="run the whole plan this many times, round robin, and pool the measured iterations (1): spreads bursts "
             "of other load on a shared machine over every schedule")
    add("--warmup", type=non_negative_int, help="iterations before measuring (2; --quick 1)")
    add("--scenarios", default=",".join(SCENARIO_KEYS),
        help=f"comma list of {', '.join(ALL_SCENARIO_KEYS)} (default: all but {VARIABLE_LENGTH_KEY})")
    add("--schedules", default=None,
        help=f"comma list of {', '.join(SCHEDULES)} (default: all but the composition rows "
             f"{', '.join(COMPOSITION_ROWS)}, which are the copyright scenarios' default)")
    add("--planned-memory-factors", "--planned_memory_factors", dest="planned_memory_factors", default="1.0",
        metavar="X[,X...]", help="one planned row per factor (its --memory-factor: activation tokens a rank may hold, "
                                 "x Megatron's interleaved peak), e.g. 1.0,1.25 (1.0)")
    add("--lengths-file", "--lengths_file", dest="lengths_file", default=None, metavar="LENGTHS",
        help=f"the {VARIABLE_LENGTH_KEY} scenario's token counts, one per line (default: tools/corpus_lengths.py on "
             "Debian's license texts, made in the work directory)")
    add("--seed", type=non_negative_int, default=0, help="seed of the random durations (same for every schedule)")
    add("--link-delay", "--link_delay", dest="slow_link", default=None, metavar="A-B:START_MS-END_MS:DELAY_MS",
        help="the slow-link scenario's delay, the trainer's --link-delay (default: the middle ranks, 0..30*fwd ms, "
             "delay 1.2*fwd ms)")
    add("--slow-link", "--slow_link", dest="simulator_slow_link", default=None, help=argparse.SUPPRESS)
    add("--hidden-size", dest="hidden_size", type=positive_int, default=64)
    add("--seq-length", dest="seq_length", type=positive_int, default=64)
    add("--micro-batch-size", dest="micro_batch_size", type=positive_int, default=2)
    add("--host-ms", "--host_ms", dest="host_ms", type=number(0, finite=True), default=None,
        help="the runtime's own cost per task the simulator adds to every task (default: measured by a probe run when "
             "composition rows run, else none)")
    add("--sim-latency-us", dest="sim_latency_us", type=number(0, finite=True), default=0.0,
        help="per-message latency the simulator assumes (0)")
    add("--json", default=None, metavar="FILE", help="write all rows, predictions and target checks as JSON")
    add("--png", default=None, metavar="FILE", help="write a bar chart of iteration times")
    add("--work-dir", "--work_dir", dest="work_dir", default=None,
        help="keep traces and logs here (default: a temporary directory, removed afterwards)")
    add("--timeout", type=number(0, inclusive=False, finite=True), default=3600.0, help="seconds before the workers are stopped (3600)")
    add("--quick", action="store_true", help="smoke test: smaller m, shorter tasks, fewer iterations (< 60 s)")
    add("--replay-trace", "--replay_trace", dest="replay_trace", default=None, metavar="TRACE_DIR",
        help="instead of benchmarking: simulate a traced run (e.g. run_single.sh's traces/) from its measured task "
             "durations and compare with its measured makespans")
    add("--policy", default=None, help="with --replay-trace: the policy to simulate (default: the traced one)")
    add("--analyse-only", "--analyse_only", dest="analyse_only", default=None, metavar="RUN_DIR",
        help="instead of running: analyse the results a --work-dir run kept (RUN_DIR holds its plan.json); give the "
             "same shape and scenario flags as that run")
    args = parser.parse_args(argv)
    if args.replay_trace is not None:
        return args
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        _check(args)
    except UsageError as exc:
        parser.error(str(exc))
    return args


def _split_list(text: str, known, what: str) -> List[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in known]
    if unknown or not items:
        raise UsageError(f"unknown {what} {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    return items


def _check(args: argparse.Namespace) -> None:
    from megatron_app.schedule import PipelineShape, ScheduleConfigError, make_policy
    from megatron_app.sim.network import SlowLink

    P, V, m = args.pipeline_parallel, args.model_chunks, args.microbatches
    args.scenario_names = [ALL_SCENARIO_KEYS[key]
                           for key in _split_list(args.scenarios, ALL_SCENARIO_KEYS, "scenario")]
    args.schedule_keys = _split_list(args.schedules, SCHEDULES, "schedule") if args.schedules is not None else None
    try:
        args.memory_factors = [float(x) for x in args.planned_memory_factors.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--planned-memory-factors {args.planned_memory_factors!r} is not a comma list of numbers") \
            from None
    if not args.memory_factors or not all(x >= 1.0 for x in args.memory_factors):
        raise UsageError(f"--planned-memory-factors must be numbers >= 1, got {args.planned_memory_factors!r}")
    if args.lengths_file is not None:
        from megatron_app.sim.lengths import MicrobatchLengths

        try:
            MicrobatchLengths.from_file(args.lengths_file)
        except ScheduleConfigError as exc:
            raise UsageError(str(exc)) from None
    if P < 2:
        raise UsageError("--pipeline_parallel must be at least 2 (a pipeline)")
    if args.simulator_slow_link is not None:
        raise UsageError("--slow-link is the simulator's flag (a slowdown FACTOR); the slow-link scenario's delay "
                         "is --link-delay A-B:START_MS-END_MS:DELAY_MS, as the trainer's")
    if args.slow_link is None:
        args.slow_link = f"{P // 2 - 1}-{P // 2}:0-{30 * args.fwd_ms:g}:{1.2 * args.fwd_ms:g}"
    if args.warmup < 1 and runs_torch(args.schedule_keys or DEFAULT_SCHEDULE_KEYS):
        raise UsageError("--warmup must be >= 1 with torch schedules (their first step infers tensor shapes)")
    try:
        SlowLink.parse_delay(args.slow_link).check_ranks(P)
        shape = PipelineShape(P, V, m)
        make_policy("interleaved", shape, 0)   # Megatron's rules (m a multiple of P when V > 1)
    except ScheduleConfigError as exc:
        raise UsageError(str(exc)) from None


def make_corpus_lengths(work_dir: Path) -> str:
    """The variable-length scenario's default lengths: tools/corpus_lengths.py on its default real corpus (run as a
    command: corpus logic stays with the data tools, and nothing imports tools/)."""
    path = work_dir / "corpus_lengths.txt"
    if subprocess.run([sys.executable, str(REPO / "tools" / "corpus_lengths.py"), "--output", str(path)]).returncode:
        raise SystemExit(2)
    return str(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replay_trace is not None:
        try:
            return replay_main(args)
        except TraceError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
    from megatron_app.bench.schedule.analysis import analyse_plan, rows_to_json
    from megatron_app.bench.schedule.targets import check_targets

    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench_schedule_"))
    work_dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    load_before = os.getloadavg()[0]   # other work on the machine shows up as noise: say how much there was
    lengths_described = None
    try:
        if args.analyse_only is not None:
            plan = json.loads((Path(args.analyse_only) / "plan.json").read_text())
            args.lengths_file = next((run["lengths_file"] for run in plan["runs"] if run.get("lengths_file")),
                                     args.lengths_file)
            code = 0
        else:
            if VARIABLE_LENGTH in args.scenario_names and args.lengths_file is None:
                args.lengths_file = make_corpus_lengths(work_dir.resolve())
            elif args.lengths_file is not None:
                args.lengths_file = str(Path(args.lengths_file).resolve())
            plan = build_plan(args, work_dir.resolve())
            log_path = Path(plan["out_dir"]) / "worker.log"
            code = run_workers(plan, args.pipeline_parallel, log_path, args.timeout)
        if code != 0:
            print(f"{PROG}: error: the workers failed (exit {code}): {last_error(log_path)}"
                  + (f"; log: {log_path}" if args.work_dir else ""), file=sys.stderr)
            return EXIT_WORKER_FAILED
        try:
            rows = analyse_plan(plan)
            if VARIABLE_LENGTH in args.scenario_names:   # read now: a default lengths file lives in work_dir
                from megatron_app.sim.lengths import MicrobatchLengths

                lengths_described = MicrobatchLengths.from_file(args.lengths_file).describe()
        except (TraceError, ValueError, OSError) as exc:
            print(f"{PROG}: error: cannot analyse the results: {exc}", file=sys.stderr)
            return EXIT_WORKER_FAILED
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    host = next((row for row in rows if row.key == HOST_PROBE), None)
    rows = [row for row in rows if row.key != HOST_PROBE]
    checks = check_targets(rows)
    statistic = "median" if VARIABLE_LENGTH not in args.scenario_names else \
        "mean" if len(args.scenario_names) == 1 else "median (variable length: mean)"
    title = (f"P={args.pipeline_parallel} V={args.model_chunks} m={args.microbatches} f={args.fwd_ms:g} ms "
             f"b={args.bwd_ms:g} ms, {statistic} of {args.iters * args.repeats} iterations ({args.repeats} x {args.iters} "
             f"after {args.warmup} warm-up)")
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    if args.analyse_only is not None:
        load = f"re-analysed from {args.analyse_only} (its load: see that run's output)"
    print(f"{title}; {load}")
    print(format_table(rows))
    composed = [row for row in rows if row.composition]
    if composed:
        print(format_composition_rows(composed))
        print("composition rows: iter ms = the forward_backward call; plan ms = plan_microbatches before it (rank 0 "
              "plans, the pipeline waits for the broadcast), not in iter ms; sim ms = megatron_app.sim's composition "
              "rows on the same documents")
    if host is not None or args.host_ms is not None:
        print("simulator (sim ms, bound ms): every task plus the runtime's "
              + (f"host cost {args.host_ms:g} ms per task (--host-ms)" if host is None else host.host_note))
    if lengths_described is not None:
        described = lengths_described
        print(f"{VARIABLE_LENGTH}: lengths from {args.lengths_file} ({described['corpus_lengths']} documents, mean "
              f"{described['corpus_mean_tokens']:.1f} tokens), task cost x {described['cost']}; iter ms and sim ms "
              f"are means over the measured iterations (each draws other lengths, the same for every schedule); "
              f"peak tokens = activation tokens held per rank (each microbatch's sequence length)")
        if runs_torch(args.schedule_keys or DEFAULT_SCHEDULE_KEYS):
            print(f"{VARIABLE_LENGTH}: {FIXED_SHAPE_NOTE}")
    print(format_checks(checks))
    if args.quick:
        print("(--quick: tasks of a few ms are close to the runtime's ~0.5 ms per-task overhead, so the simulator "
              "checks are only meaningful at full size)")
    print(f"({time.perf_counter() - began:.0f} s)")
    if args.json:
        payload = {
            "schema": "megatron_app.bench_schedule/1",
            "date": datetime.date.today().isoformat(),
            "command": " ".join([Path(sys.argv[0]).name] + list(sys.argv[1:] if argv is None else argv)),
            "machine": dict(machine(), load_average_before=load_before, load_average_after=os.getloadavg()[0]),
            "config": {k: getattr(args, k) for k in ("pipeline_parallel", "model_chunks", "microbatches", "fwd_ms",
                                                     "bwd_ms", "iters", "warmup", "repeats", "seed", "slow_link",
                                                     "hidden_size", "seq_length", "micro_batch_size",
                                                     "sim_latency_us", "quick", "host_ms")},
            "host_cost": None if host is None else host.host_cost,
            "scenarios": args.scenario_names,
            "lengths_file": args.lengths_file,
            "planned_memory_factors": args.memory_factors,
            "rows": rows_to_json(rows),
            "targets": [check.__dict__ for check in checks],
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.png:
        write_png(rows, args.png, title)
    return 0

