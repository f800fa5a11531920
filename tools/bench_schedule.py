#!/usr/bin/env python3
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
once (bench_schedule_analysis.measure_host_cost) and every row's simulator prediction adds it; --host-ms gives it
instead (and applies it to any run).
Bad options print one line and exit 2; a failed worker exits 1.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List

_root = Path(__file__).resolve().parent.parent
for _path in (_root, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from megatron_app.schedule import POLICIES  # noqa: E402
from megatron_app.schedule.composition import BALANCED, DP_BALANCED, LOADER, PACKED  # noqa: E402
from megatron_app.trace import TraceError  # noqa: E402
from megatron_app.trace.cli import (OneLineArgumentParser, non_negative_int, number,  # noqa: E402
                                    positive_int)

PROG = "bench_schedule.py"
EXIT_WORKER_FAILED = 1
WORKER = Path(__file__).resolve().parent / "bench_schedule_worker.py"

def _runtime_schedules() -> Dict[str, tuple]:
    """One row per policy of the registry: adaptive rules run as the `app` schedule, static orders (Megatron-Core's,
    and ZB-H1 with a split backward) as schedules of their own."""
    rows = {}
    for name, entry in POLICIES.items():
        if entry.split_only:
            rows[name] = (f"{name} split backward (our runtime)", "app", name, "dfc", False, name)
            continue
        if entry.static:
            label = f"Megatron {name}{' V=1' if entry.single_chunk else ''} (our runtime)"
            rows[name] = (label, "app", name, "dfc", entry.single_chunk, name)
        else:
            rows[name] = (f"APP {name}", "app", "app", name, False, name)
    return rows


# torch's interleaved zero-bubble action lists (tools/torch_schedule_csv.py) run by our runtime (--schedule-file)
TORCH_ZB_ORDER = "torch-zb-order"
# Rows that run each backward as B + W (--split-backward): every split-only registry entry, and adaptive split.
SPLIT_BACKWARD_KEYS = frozenset({"app-adaptive-split", "app-planned-split", TORCH_ZB_ORDER,
                                 *(name for name, e in POLICIES.items() if e.split_only)})
# key -> (label, system, schedule, policy, one chunk per rank, simulator policy)
SCHEDULES: Dict[str, tuple] = {
    **_runtime_schedules(),
    "app-adaptive-split": ("APP adaptive, split backward", "app", "app", "adaptive", False, "adaptive"),
    "app-planned-split": ("APP planned, split backward", "app", "app", "planned", False, "planned"),
    TORCH_ZB_ORDER: ("torch ZeroBubble order (our runtime)", "app", "app", None, False, None),
    "torch-1f1b": ("torch Schedule1F1B V=1", "torch", "torch-1F1B", None, True, "1f1b"),
    "torch-interleaved": ("torch ScheduleInterleaved1F1B", "torch", "torch-Interleaved1F1B", None, False,
                          "interleaved"),
    "torch-zb": ("torch ScheduleInterleavedZeroBubble", "torch", "torch-InterleavedZeroBubble", None, False, None),
}
# Composition rows (issue 23): key -> (label, the schedule key whose order runs it, composition of its microbatches)
COMPOSITION_ROWS: Dict[str, tuple] = {
    "loader-padded": ("Megatron interleaved, loader groups padded", "interleaved", LOADER),
    "loader-packed": ("Megatron interleaved, loader groups packed", "interleaved", PACKED),
    "dp-balanced": ("Megatron interleaved, DpBalanced-style packer", "interleaved", DP_BALANCED),
    "balanced": ("APP planned, balanced composition", "planned", BALANCED),
}
SCHEDULES.update({key: (label, *SCHEDULES[order][1:]) for key, (label, order, _) in COMPOSITION_ROWS.items()})
DEFAULT_SCHEDULE_KEYS = [key for key in SCHEDULES if key not in COMPOSITION_ROWS]
SCENARIO_KEYS = {"homogeneous": "homogeneous", "slow-rank": "slow rank 1.5x", "jitter": "jitter +-30%",
                 "stragglers": "stragglers 10% x3", "slow-link": "slow link"}
# Run only when asked (--scenarios variable-length): microbatch lengths drawn from a real corpus's token counts.
VARIABLE_LENGTH_KEY, VARIABLE_LENGTH = "variable-length", "variable length"
# Run only when asked: whole documents of the copyright corpus, several a loader microbatch, composed per row.
# scenario key -> (name, lengths file, documents per loader microbatch)
LENGTHS_DIR = _root / "docs" / "results" / "lengths"
COMPOSITION_SCENARIOS = {
    "copyright-2048": ("copyright 2048", LENGTHS_DIR / "copyright_2048.txt", 2),
    "copyright-8192": ("copyright 8192", LENGTHS_DIR / "copyright_8192.txt", 2),
}
COMPOSITION_SCENARIO_NAMES = {name for name, _, _ in COMPOSITION_SCENARIOS.values()}
ALL_SCENARIO_KEYS = {**SCENARIO_KEYS, VARIABLE_LENGTH_KEY: VARIABLE_LENGTH,
                     **{key: name for key, (name, _, _) in COMPOSITION_SCENARIOS.items()}}
# torch.distributed.pipelining's PipelineStage (torch 2.13, stage.py) sets up its receive buffers once, on the first
# step, from one input/output shape per stage (given, or inferred from the first microbatch), and receives every
# later microbatch into them: its schedules cannot run microbatches of different lengths.
FIXED_SHAPE_NOTE = ("torch.distributed.pipelining skipped: its PipelineStage receives every microbatch into buffers "
                    "of one shape per stage, fixed on the first step")
# The host-cost probe: a run of near-zero compute (forward, backward ms) whose time is the runtime's own per task.
HOST_PROBE, HOST_PROBE_COMPUTE = "host cost probe", "0.1,0.2"
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
    add("--slow-link", "--slow_link", dest="slow_link", default=None, metavar="A-B:START_MS-END_MS:DELAY_MS",
        help="the slow-link scenario's link (default: the middle ranks, 0..30*fwd ms, delay 1.2*fwd ms)")
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
    if args.slow_link is None:
        args.slow_link = f"{P // 2 - 1}-{P // 2}:0-{30 * args.fwd_ms:g}:{1.2 * args.fwd_ms:g}"
    if args.warmup < 1 and any(SCHEDULES[key][1] == "torch" for key in args.schedule_keys or DEFAULT_SCHEDULE_KEYS):
        raise UsageError("--warmup must be >= 1 with torch schedules (their first step infers tensor shapes)")
    try:
        SlowLink.parse_delay(args.slow_link).check_ranks(P)
        shape = PipelineShape(P, V, m)
        make_policy("interleaved", shape, 0)   # Megatron's rules (m a multiple of P when V > 1)
    except ScheduleConfigError as exc:
        raise UsageError(str(exc)) from None


def scenario_flags(name: str, args) -> dict:
    return {
        "homogeneous": {},
        "slow rank 1.5x": {"slow_rank": 1, "slow_factor": 1.5},
        "jitter +-30%": {"jitter": 0.3},
        "stragglers 10% x3": {"straggler_prob": 0.1, "straggler_factor": 3.0},
        "slow link": {"slow_link": args.slow_link},
        VARIABLE_LENGTH: {"lengths_file": args.lengths_file},
        HOST_PROBE: {},
        **{scenario: {"lengths_file": str(path), "documents_per_microbatch": documents}
           for scenario, path, documents in COMPOSITION_SCENARIOS.values()},
    }[name]


def scenario_schedule_keys(scenario: str, args) -> List[str]:
    """The rows a scenario runs: --schedules, or by default the composition rows on the copyright corpus and the
    others elsewhere; composition rows need documents of known lengths, torch's schedules one shape per stage."""
    composing = scenario in COMPOSITION_SCENARIO_NAMES
    keys = args.schedule_keys or (list(COMPOSITION_ROWS) if composing else DEFAULT_SCHEDULE_KEYS)
    has_lengths = composing or scenario == VARIABLE_LENGTH
    return [key for key in keys if (has_lengths or key not in COMPOSITION_ROWS)
            and not (has_lengths and SCHEDULES[key][1] == "torch")]


def planned_variants(key: str, args) -> List[tuple]:
    """(row key, label suffix, memory factor) of each row a schedule key gives: planned one per memory factor."""
    if key != "planned":
        return [(key, "", None)]
    return [("planned" if factor == 1.0 else f"planned-x{factor:g}", "" if factor == 1.0 else f" mem {factor:g}x",
             factor) for factor in args.memory_factors]


def build_plan(args, work_dir: Path) -> dict:
    """Every run of the benchmark (repeats round robin); results go to a fresh directory under work_dir."""
    job_id = f"bench{uuid.uuid4().hex[:8]}"
    runs = []
    for repeat in range(args.repeats):
        for scenario in args.scenario_names:
            for key in scenario_schedule_keys(scenario, args):
                for row_key, suffix, factor in planned_variants(key, args):
                    run = plan_run(args, f"run{len(runs):03d}", repeat, scenario, key)
                    run.update(key=row_key, label=run["label"] + suffix, memory_factor=factor)
                    runs.append(run)
        if any(run.get("composition") for run in runs) and args.host_ms is None:
            # once a repeat, like every row, so bursts of other load spread over the probe too
            runs.append(host_probe_run(args, f"run{len(runs):03d}", repeat))
    out_dir = work_dir / job_id
    out_dir.mkdir(parents=True)
    if TORCH_ZB_ORDER in (args.schedule_keys or DEFAULT_SCHEDULE_KEYS):
        from torch_schedule_csv import action_lists

        path = out_dir / "torch_zb_order.csv"
        with open(path, "w", newline="") as handle:
            csv.writer(handle).writerows(action_lists("InterleavedZeroBubble", args.pipeline_parallel,
                                                      args.model_chunks, args.microbatches))
        for run in runs:
            if run["key"] == TORCH_ZB_ORDER:
                run["schedule_file"] = str(path)
    return {"job_id": job_id, "out_dir": str(out_dir), "runs": runs, "host_ms": args.host_ms}


def host_probe_run(args, run_id: str, repeat: int) -> dict:
    """The run that measures the runtime's own cost per task (bench_schedule_analysis.measure_host_cost): Megatron's
    interleaved order, near-zero emulated compute, same pipeline."""
    run = plan_run(args, run_id, repeat, HOST_PROBE, "interleaved")
    run.update(key=HOST_PROBE, label=HOST_PROBE, emulate_compute=HOST_PROBE_COMPUTE, host_probe=True)
    return run


def plan_run(args, run_id: str, repeat: int, scenario: str, key: str) -> dict:
    flags = scenario_flags(scenario, args)
    label, system, schedule, policy, single_chunk, sim_policy = SCHEDULES[key]
    V = 1 if single_chunk else args.model_chunks
    scale = args.model_chunks if single_chunk else 1      # the same model: a V=1 chunk is V chunks' work
    compute = f"{args.fwd_ms * scale:g},{args.bwd_ms * scale:g}"
    if flags.get("jitter"):
        compute += f",{flags['jitter']:g}"
    run = {
        "id": run_id, "repeat": repeat, "scenario": scenario, "label": label, "key": key, "system": system,
        "schedule": schedule, "policy": policy or "dfc", "sim_policy": sim_policy,
        "pipeline_parallel": args.pipeline_parallel, "model_chunks": V, "microbatches": args.microbatches,
        "micro_batch_size": args.micro_batch_size, "seq_length": args.seq_length, "hidden_size": args.hidden_size,
        "vocab_size": 1024, "seed": args.seed, "iterations": args.warmup + args.iters, "warmup": args.warmup,
        "emulate_compute": compute, "sim_latency_us": args.sim_latency_us, "notes": [],
        **{k: v for k, v in flags.items() if k != "jitter"},
    }
    if single_chunk and args.model_chunks > 1:
        run["notes"].append(f"one chunk per rank, tasks {scale}x longer (its random draws differ)")
    if key in SPLIT_BACKWARD_KEYS:
        run["split_backward"] = True
        run["notes"].append("split backward (B + W, W 50% of each backward wait)")
    if key in COMPOSITION_ROWS:
        run["composition"] = COMPOSITION_ROWS[key][2]
    if key == "torch-zb":
        run["notes"].append("backward split 50/50 into input- and weight-gradient waits; no simulator policy for "
                            "ZeroBubble")
    if system == "torch" and sim_policy == "interleaved":
        run["notes"].append("sim column: Megatron's interleaved order")
    return run


# ---- running the workers -------------------------------------------------------------------------------------
def run_workers(plan: dict, nproc: int, log_path: Path, timeout_s: float) -> int:
    """torchrun the worker on nproc ranks; progress lines go to stderr, everything to log_path."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(_root))
    env.pop("MEGATRON_APP_JOB_ID", None)
    plan_path = Path(plan["out_dir"]) / "plan.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max_restarts", "0", str(WORKER), str(plan_path)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        timer = threading.Timer(timeout_s, lambda: os.killpg(process.pid, signal.SIGTERM))
        timer.start()
        try:
            for line in process.stdout:
                log.write(line)
                if line.startswith("[bench]"):
                    print(line.rstrip(), file=sys.stderr, flush=True)
            return process.wait()
        finally:
            timer.cancel()


def _last_error(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()
             if "Error" in line or "error:" in line]
    return lines[-1][:300] if lines else "no error line in the log"


# ---- output --------------------------------------------------------------------------------------------------
def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def format_table(rows) -> str:
    header = (f"{'scenario':<18} {'schedule':<42} {'iter ms':>8} {'bubble':>7} {'sim ms':>7} {'sim err':>8} "
              f"{'bound ms':>8} {'replay err':>10} {'own bound':>9}  peak activations per rank"
              + ("  [peak tokens per rank; sim]" if any(row.peak_tokens for row in rows) else ""))
    lines = [header, "-" * len(header)]
    previous = None
    for row in rows:
        if previous is not None and row.scenario != previous:
            lines.append("")
        previous = row.scenario
        lines.append(f"{row.scenario:<18} {row.label:<42} {row.iteration_ms:>8.1f} {row.bubble_ratio:>7.1%} "
                     f"{_fmt(row.sim_ms, '7.1f'):>7} {_fmt(row.sim_error, '+8.1%'):>8} {_fmt(row.bound_ms, '8.1f'):>8} "
                     f"{_fmt(row.replay_error, '+10.1%'):>10} {_fmt(row.own_bound_error, '+9.1%'):>9}  "
                     f"{','.join(map(str, row.peak_activations))}"
                     + (f"  [{','.join(map(str, row.peak_tokens))}; {','.join(map(str, row.sim_peak_tokens or []))}]"
                        if row.peak_tokens else ""))
    return "\n".join(lines)


def format_composition_rows(rows) -> str:
    """The composition rows' own columns; x baseline = the scenario's loader-padded row (Megatron's order)."""
    header = (f"{'scenario':<18} {'composition row':<48} {'m':>5} {'iter ms':>8} {'x base':>7} {'sim ms':>7} "
              f"{'sim err':>8} {'own bound':>9} {'padding':>8} {'tokens/base':>11} {'plan ms':>8}  "
              "peak activation tokens per rank")
    lines = [header, "-" * len(header)]
    for row in rows:
        base = next((r for r in rows if r.scenario == row.scenario and r.key == "loader-padded"), None)
        speedup = None if base is None else base.iteration_ms / row.iteration_ms
        lines.append(f"{row.scenario:<18} {row.label:<48} {row.num_microbatches:>5.1f} {row.iteration_ms:>8.1f} "
                     f"{_fmt(speedup, '7.3f'):>7} {_fmt(row.sim_ms, '7.1f'):>7} {_fmt(row.sim_error, '+8.1%'):>8} "
                     f"{_fmt(row.own_bound_error, '+9.1%'):>9} {row.padding_share:>8.1%} "
                     f"{_fmt(row.peak_tokens_over_base, '11.3f'):>11} {_fmt(row.planning_ms, '8.1f'):>8}  "
                     f"{','.join(map(str, row.peak_tokens))}")
    return "\n".join(lines)


def format_checks(checks) -> str:
    lines = ["targets:"]
    for check in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[check.passed]
        lines.append(f"  [{verdict}] {check.scenario}: {check.target}: {check.measured}")
    return "\n".join(lines)


def write_png(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(row.scenario for row in rows))
    labels = list(dict.fromkeys(row.label for row in rows))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(scenarios)), 5.5))
    colors = plt.get_cmap("tab10")
    for j, label in enumerate(labels):
        xs, ys, sims = [], [], []
        for i, scenario in enumerate(scenarios):
            row = next((r for r in rows if r.scenario == scenario and r.label == label), None)
            if row is not None:
                xs.append(i + (j - (len(labels) - 1) / 2) * width)
                ys.append(row.iteration_ms)
                sims.append(row.sim_ms)
        ax.bar(xs, ys, width, label=label, color=colors(j % 10))
        sim_points = [(x, s) for x, s in zip(xs, sims) if s is not None]
        if sim_points:
            ax.hlines([p[1] for p in sim_points], [p[0] - width / 2 for p in sim_points],
                      [p[0] + width / 2 for p in sim_points], colors="black", zorder=3)
    for i, scenario in enumerate(scenarios):
        bound = next((r.bound_ms for r in rows if r.scenario == scenario and r.model_chunks == max(
            x.model_chunks for x in rows)), None)
        if bound is not None:
            ax.hlines(bound, i - 0.45, i + 0.45, colors="red", linestyles="dashed", zorder=4)
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios)
    ax.set_ylabel("iteration time, ms (median)")
    ax.set_title(title + "\nblack tick: simulator prediction; red dashes: lower bound", fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.07))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


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
            rows.append({"iteration": iteration, "measured_ms": measured, "sim_ms": simulated.makespan_us / 1e3,
                         "error": measured / (simulated.makespan_us / 1e3) - 1.0})
    except (ScheduleConfigError, ValueError) as exc:
        raise TraceError(str(exc)) from None
    print(f"{run.trace_dir}: P={run.pipeline_parallel} V={run.model_chunks} m={run.microbatches}, simulated policy "
          f"{policy}, message latency {args.sim_latency_us:g} us")
    print(f"{'iteration':>9} {'measured ms':>12} {'sim ms':>9} {'error':>8}")
    for row in rows:
        print(f"{row['iteration']:>9} {row['measured_ms']:>12.1f} {row['sim_ms']:>9.1f} {row['error']:>+8.1%}")
    errors = sorted(abs(row["error"]) for row in rows)
    median = errors[len(errors) // 2]
    print(f"median |error| {median:.1%}: {'within' if median <= 0.15 else 'NOT within'} 15%")
    if args.json:
        Path(args.json).write_text(json.dumps({"trace_dir": str(run.trace_dir), "policy": policy,
                                               "iterations": rows, "median_abs_error": median}, indent=1))
    return 0


def make_corpus_lengths(work_dir: Path) -> str:
    """The variable-length scenario's default lengths: tools/corpus_lengths.py on its default real corpus."""
    import corpus_lengths

    path = work_dir / "corpus_lengths.txt"
    if corpus_lengths.main(["--output", str(path)]) != 0:
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
    from bench_schedule_analysis import analyse_plan, check_targets, rows_to_json

    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench_schedule_"))
    work_dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    load_before = os.getloadavg()[0]   # other work on the machine shows up as noise: say how much there was
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
            print(f"{PROG}: error: the workers failed (exit {code}): {_last_error(log_path)}"
                  + (f"; log: {log_path}" if args.work_dir else ""), file=sys.stderr)
            return EXIT_WORKER_FAILED
        try:
            rows = analyse_plan(plan)
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
    if VARIABLE_LENGTH in args.scenario_names:
        from megatron_app.sim.lengths import MicrobatchLengths

        described = MicrobatchLengths.from_file(args.lengths_file).describe()
        print(f"{VARIABLE_LENGTH}: lengths from {args.lengths_file} ({described['corpus_lengths']} documents, mean "
              f"{described['corpus_mean_tokens']:.1f} tokens), task cost x {described['cost']}; iter ms and sim ms "
              f"are means over the measured iterations (each draws other lengths, the same for every schedule); "
              f"peak tokens = activation tokens held per rank (each microbatch's sequence length)")
        if any(SCHEDULES[key][1] == "torch" for key in args.schedule_keys or DEFAULT_SCHEDULE_KEYS):
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


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
