"""Turns bench_schedule.py's raw results into rows: iteration time, bubble ratio, peak activations, the simulator's
prediction and lower bound (targets.py checks the issue's targets on them).

Iteration time: from the first rank entering forward_backward (torch: schedule.step) to the last rank leaving it,
so a rank that starts late (the machine is shared) counts, and logging between iterations does not.
megatron_app rows: metrics from their traces (megatron_app.trace.metrics, the same code as process_trace.py).
torch rows: the same definitions applied to the compute spans the worker recorded (megatron_app.trace.intervals):
window = first compute start to last compute end over all ranks; a rank's bubble is the part of the window its own
compute does not cover; an activation is held from a forward's start to the end of its backward (for ZeroBubble, to
the end of its weight-gradient part).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from megatron_app.schedule import PipelineShape
from megatron_app.trace import read_trace_dir
from megatron_app.trace.intervals import max_concurrency, union_length
from megatron_app.trace.metrics import iteration_metrics
from megatron_app.trace.schema import FIRST_ITERATION
from megatron_app.emulation.sim_replay import (measured_durations, replay_trace_iteration, simulate_emulation,
                                               traced_shape)
from megatron_app.sim import lower_bounds
from megatron_app.emulation.spec import EmulationSpec
from megatron_app.sim.lengths import MicrobatchLengths
from megatron_app.sim.composition import CompositionSimConfig, simulate_composition
from megatron_app.sim.network import SlowLink
from megatron_app.trace.schema import BACKWARD, FORWARD, WEIGHT

COMPOSITION_BASELINE = "loader-padded"   # the composition row the others' peak tokens are compared with
MS_PER_PROBE_STEP = 1.0    # the host-cost probe's sensitivity step: every task 1 ms longer


@dataclass
class Row:
    scenario: str
    label: str
    key: str                             # bench_schedule.py's schedule key (dfc, interleaved, torch-zb, ...)
    system: str                          # "app" (our runtime) or "torch"
    schedule: str
    model_chunks: int
    iteration_ms: float                  # median over the measured iterations of first call in .. last call out
                                         # (variable lengths: the mean, paired iterations)
    iteration_ms_each: List[float]       # every measured iteration, repeats pooled
    makespan_ms: float                   # median first-compute-start .. last-compute-end
    bubble_ratio: float                  # mean over measured iterations of the mean over ranks
    peak_activations: List[int]          # per pipeline rank, max over measured iterations
    sim_policy: Optional[str]
    sim_ms: Optional[float] = None       # simulator fed with the same cost model, median over measured iterations
    bound_ms: Optional[float] = None     # its lower bound (every schedule), mean over measured iterations
    sim_error: Optional[float] = None    # measured iteration time / sim - 1
    replay_ms: Optional[float] = None    # simulator fed with the measured task durations (app rows)
    replay_error: Optional[float] = None  # measured makespan / replay - 1 (median over iterations)
    # measured makespan / the lower bound of the run's own measured task durations - 1 (median): how far the order
    # is from the best possible with the tasks as they really ran (the bound column uses the nominal durations)
    own_bound_error: Optional[float] = None
    notes: List[str] = field(default_factory=list)
    memory_factor: Optional[float] = None  # planned rows: activation tokens allowed, x Megatron's peak
    peak_tokens: List[int] = field(default_factory=list)       # variable lengths: per rank, activation tokens held
    sim_peak_tokens: List[int] = field(default_factory=list)   # the simulator's, same iterations
    composition: Optional[str] = None           # composition rows: which documents formed each microbatch
    num_microbatches: Optional[float] = None    # composition rows: mean microbatch count over measured iterations
    padding_share: Optional[float] = None       # composition rows: padding tokens / computed tokens
    planning_ms: Optional[float] = None         # composition rows: plan_microbatches per iteration (before the call)
    peak_tokens_over_base: Optional[float] = None  # max over ranks of peak tokens / the loader-padded row's
    host_cost: Optional[dict] = None            # the host-cost probe's row: measure_host_cost's numbers
    host_note: str = ""


def spec_of(run: dict) -> EmulationSpec:
    lengths = MicrobatchLengths.from_file(run["lengths_file"]) if run.get("lengths_file") else None
    return EmulationSpec.parse(run["emulate_compute"], slow_rank=run.get("slow_rank"),
                               slow_factor=run.get("slow_factor") or 1.0,
                               straggler_prob=run.get("straggler_prob") or 0.0,
                               straggler_factor=run.get("straggler_factor") or 1.0, seed=run["seed"],
                               lengths=lengths)


def peak_tokens_per_rank(trace, iteration: int, lengths) -> List[int]:
    """Per pipeline rank, the most activation tokens held at once in a traced iteration: a microbatch's tokens are
    held from its forward's start to the end of its backward, or of its W with a split backward (the trace's
    activation rule, weighted by length)."""
    peaks = {}
    for rank in trace.ranks:
        events = rank.events_of(iteration)
        releases = WEIGHT if any(e.kind == WEIGHT for e in events) else BACKWARD
        deltas = [(e.start, lengths[e.microbatch]) for e in events if e.kind == FORWARD]
        deltas += [(e.end, -lengths[e.microbatch]) for e in events if e.kind == releases]
        peaks[rank.meta.pp_rank] = max(peaks.get(rank.meta.pp_rank, 0), max_concurrency(deltas))
    return [peaks[r] for r in sorted(peaks)]


def shape_of(run: dict) -> PipelineShape:
    return PipelineShape(run["pipeline_parallel"], run["model_chunks"], run["microbatches"],
                         split_backward=bool(run.get("split_backward")))


def measured_iterations(run: dict) -> range:
    return range(run["warmup"], run["iterations"])


def is_composed(run: dict) -> bool:
    """A composition row, or documents several a microbatch: the trainer composed its microbatches per iteration
    (train/emulation.py) and logged them."""
    return run.get("composition") is not None or (run.get("documents_per_microbatch") or 1) > 1


def composed_iterations(run: dict, run_dir: Path, spec: EmulationSpec, shape: PipelineShape) -> List[dict]:
    """Per iteration (0-based): num_microbatches, microbatch_tokens, padding_tokens, as the trainer logged them; the
    loader's own single documents (nothing to compose: the trainer logs nothing) are the spec's draws, unpadded."""
    log = json.loads((run_dir / "log.json").read_text())
    return [entry.get("composed") or {"num_microbatches": shape.num_microbatches, "padding_tokens": 0,
                                      "microbatch_tokens": list(spec.microbatch_lengths(shape, k))}
            for k, entry in enumerate(log["iterations"])]


def microbatch_tokens_of(run: dict, run_dir: Path, spec: EmulationSpec, shape: PipelineShape) -> Dict[int, list]:
    """Iteration -> each microbatch's tokens (activation sizes), composed or drawn."""
    if is_composed(run):
        return dict(enumerate(entry["microbatch_tokens"] for entry in composed_iterations(run, run_dir, spec, shape)))
    return {k: spec.microbatch_lengths(shape, k) for k in range(run["iterations"])}


def _app_measurements(run: dict, run_dir: Path) -> dict:
    """Per measured iteration: times, makespans, bubble ratios, peaks per rank, and the replay of its durations.
    k counts from 0 as the emulation's draws do; the trace numbers the same iteration k + FIRST_ITERATION."""
    trace = read_trace_dir(run_dir / "trace", run["pipeline_parallel"], run["model_chunks"])
    measured = [(k, k + FIRST_ITERATION) for k in measured_iterations(run)]   # (draw index, trace iteration)
    metrics = [iteration_metrics(trace, traced) for _, traced in measured]
    slow_link = SlowLink.parse_delay(run["slow_link"]) if run.get("slow_link") else None
    spec, shape = spec_of(run), shape_of(run)
    tokens = microbatch_tokens_of(run, run_dir, spec, shape) if spec.lengths is not None else {}
    replayed = [replay_trace_iteration(trace, traced, run["sim_policy"], slow_link, run["sim_latency_us"],
                                       lengths=tokens.get(k),
                                       memory_factor=run.get("memory_factor"))
                for k, traced in measured] if run["sim_policy"] is not None else []
    replays = [r.makespan_us for r in replayed]
    own_bounds = [lower_bounds(traced_shape(trace, traced), measured_durations(trace, traced),
                               run["sim_latency_us"]).best_us
                  for _, traced in measured]
    extra = {}
    if spec.lengths is not None:
        extra["peak_tokens"] = [peak_tokens_per_rank(trace, traced, tokens[k]) for k, traced in measured]
    if is_composed(run):
        logged = composed_iterations(run, run_dir, spec, shape)
        extra["counts"] = [logged[k]["num_microbatches"] for k in measured_iterations(run)]
        extra["padding_shares"] = [logged[k]["padding_tokens"] / sum(logged[k]["microbatch_tokens"])
                                   for k in measured_iterations(run)]
        extra["planning_ms"] = [logged[k].get("wait_for_plan_ms", 0.0) for k in measured_iterations(run)]
    return {**extra, "times": [m.iteration_time_us / 1e3 for m in metrics], "makespans": [m.makespan_us / 1e3 for m in metrics],
            "bubbles": [m.mean_bubble_ratio for m in metrics],
            "peaks": [[r.peak_activations for r in sorted(m.ranks, key=lambda r: r.pp_rank)] for m in metrics],
            "own_bound_errors": [m.makespan_us / us - 1.0 for m, us in zip(metrics, own_bounds)],
            **({"replays": [us / 1e3 for us in replays],
                "replay_errors": [m.makespan_us / us - 1.0 for m, us in zip(metrics, replays)]} if replays else {})}


def torch_span_metrics(spans_by_rank: List[list], iteration: int) -> dict:
    """Makespan (us), mean bubble ratio and per-rank peak activations of one iteration from recorded spans
    (iteration, kind, chunk, microbatch, start_s, end_s)."""
    per_rank = [[s for s in spans if s[0] == iteration] for spans in spans_by_rank]
    every = [s for spans in per_rank for s in spans]
    if not every:
        raise ValueError(f"torch run recorded no compute in iteration {iteration}")
    start, end = min(s[4] for s in every), max(s[5] for s in every)
    window = end - start
    bubbles, peaks = [], []
    for spans in per_rank:
        busy = union_length([(s[4], s[5]) for s in spans])
        bubbles.append(1.0 - busy / window if window > 0 else 0.0)
        frees = "backward_weight" if any(s[1] == "backward_weight" for s in spans) else "backward"
        deltas = [(s[4], 1) for s in spans if s[1] == "forward"] + [(s[5], -1) for s in spans if s[1] == frees]
        peaks.append(max_concurrency(deltas))
    return {"makespan_us": window * 1e6, "bubble": sum(bubbles) / len(bubbles), "peaks": peaks}


def _torch_measurements(run: dict, run_dir: Path) -> dict:
    payloads = [json.loads((run_dir / f"torch_rank{r}.json").read_text()) for r in range(run["pipeline_parallel"])]
    steps = list(zip(*(p["steps"] for p in payloads)))    # per iteration, every rank's (start, end)
    times = [(max(e for _, e in ranks) - min(s for s, _ in ranks)) * 1e3 for ranks in steps][run["warmup"]:]
    spans = [p["spans"] for p in payloads]
    metrics = [torch_span_metrics(spans, k) for k in measured_iterations(run)]
    return {"times": times, "makespans": [m["makespan_us"] / 1e3 for m in metrics],
            "bubbles": [m["bubble"] for m in metrics], "peaks": [m["peaks"] for m in metrics]}


def analyse_runs(runs: List[dict], out_dir: Path, host_us: Optional[float] = None) -> Row:
    """One row from the repeats of one (scenario, schedule): measured iterations pooled over the repeats.
    host_us: the runtime's own cost per task the simulator adds to every task (None: none measured or given)."""
    pooled: Dict[str, list] = {}
    for run in runs:
        run_dir = out_dir / run["id"]
        measured = _app_measurements(run, run_dir) if run["system"] == "app" else _torch_measurements(run, run_dir)
        for name, values in measured.items():
            pooled.setdefault(name, []).extend(values)
    run = runs[0]
    # Variable lengths: each iteration draws other lengths (the same for every schedule), so iteration times differ
    # several-fold by design and a median would pick one arbitrary iteration; the mean (= total time) compares.
    average = statistics.fmean if run.get("lengths_file") else statistics.median
    row = Row(scenario=run["scenario"], label=run["label"], key=run["key"], system=run["system"],
              schedule=run["schedule"], model_chunks=run["model_chunks"],
              iteration_ms=average(pooled["times"]), iteration_ms_each=pooled["times"],
              makespan_ms=average(pooled["makespans"]), bubble_ratio=statistics.fmean(pooled["bubbles"]),
              peak_activations=[max(values) for values in zip(*pooled["peaks"])], sim_policy=run["sim_policy"],
              notes=list(run.get("notes", [])), memory_factor=run.get("memory_factor"))
    if "peak_tokens" in pooled:
        row.peak_tokens = [max(values) for values in zip(*pooled["peak_tokens"])]
    if "replays" in pooled:
        row.replay_ms = average(pooled["replays"])
        row.replay_error = statistics.median(pooled["replay_errors"])
    if "own_bound_errors" in pooled:
        row.own_bound_error = statistics.median(pooled["own_bound_errors"])
    if is_composed(run):
        _composition_columns(row, run, pooled, host_us)
        return row
    predicted = simulate_emulation(spec_of(run), shape_of(run), run["sim_policy"] or "interleaved",
                                   run["iterations"],
                                   SlowLink.parse_delay(run["slow_link"]) if run.get("slow_link") else None,
                                   run["sim_latency_us"], memory_factor=run.get("memory_factor"),
                                   host_us=host_us or 0.0)[run["warmup"]:]
    if predicted[0].peak_activation_tokens is not None:
        row.sim_peak_tokens = [int(round(max(values))) for values in zip(*(p.peak_activation_tokens
                                                                            for p in predicted))]
    row.bound_ms = statistics.fmean(p.lower_bound_us for p in predicted) / 1e3
    if run["sim_policy"] is not None:
        row.sim_ms = average(p.makespan_us for p in predicted) / 1e3
        row.sim_error = row.iteration_ms / row.sim_ms - 1.0
    return row


def _composition_columns(row: Row, run: dict, pooled: Dict[str, list], host_us: Optional[float]) -> None:
    """A composition row's microbatch count, padding share, and megatron_app.sim's composition row on the same
    documents (same draws, cost model and order; each task plus host_us)."""
    row.composition = run.get("composition") or "loader"
    row.num_microbatches = statistics.fmean(pooled["counts"])
    row.padding_share = statistics.fmean(pooled["padding_shares"])
    row.planning_ms = statistics.fmean(pooled["planning_ms"])
    forward_ms, backward_ms = (float(x) for x in run["emulate_compute"].split(",")[:2])
    config = CompositionSimConfig(run["pipeline_parallel"], run["model_chunks"], run["microbatches"],
                                  run.get("documents_per_microbatch") or 1, spec_of(run).lengths,
                                  forward_us=forward_ms * 1e3, backward_us=backward_ms * 1e3,
                                  host_us=host_us or 0.0, iterations=run["iterations"],
                                  warmup_iterations=run["warmup"], seed=run["seed"])
    simulated = simulate_composition(config, row.composition)
    row.sim_ms = simulated.makespan_us / 1e3
    row.bound_ms = simulated.lower_bound_us / 1e3
    row.sim_error = row.iteration_ms / row.sim_ms - 1.0
    row.sim_peak_tokens = [int(round(p)) for p in simulated.peak_tokens]
    if host_us is None:
        row.notes.append("sim column without a host cost per task (none measured or given)")


def measure_host_cost(probe: Row, run: dict) -> dict:
    """The runtime's own time per task (Python loop, Megatron's step functions, transport calls), from the probe:
    Megatron's interleaved order on near-zero emulated compute (scenarios.HOST_PROBE_COMPUTE).

        host_us = (measured iteration - simulated iteration at zero host cost) / critical-path tasks
        critical-path tasks = (simulated iteration with every task 1 ms longer - simulated iteration) / 1 ms

    i.e. how many task durations the schedule's longest path adds up (the simulator's own sensitivity to a cost
    paid by every task), so a simulator adding host_us to every task reproduces the measured iteration."""
    spec, shape = spec_of(run), shape_of(run)
    forward_ms, backward_ms = spec.forward_ms, spec.backward_ms

    def simulated_ms(extra_ms: float) -> float:
        slower = EmulationSpec(forward_ms + extra_ms, backward_ms + extra_ms, seed=run["seed"])
        predicted = simulate_emulation(slower, shape, "interleaved", run["iterations"])[run["warmup"]:]
        return statistics.median(p.makespan_us for p in predicted) / 1e3

    zero_host = simulated_ms(0.0)
    critical_tasks = (simulated_ms(MS_PER_PROBE_STEP) - zero_host) / MS_PER_PROBE_STEP
    host_ms = max(0.0, (probe.iteration_ms - zero_host) / critical_tasks)
    return {"host_ms": host_ms, "measured_iteration_ms": probe.iteration_ms, "simulated_zero_host_ms": zero_host,
            "critical_path_tasks": critical_tasks, "probe_compute_ms": [forward_ms, backward_ms]}


def analyse_plan(plan: dict) -> List[Row]:
    """Rows in plan order, one per (scenario, schedule key); the host-cost probe's row (if run) last, its
    measurement fed to every row's simulator prediction (plan["host_ms"], --host-ms, overrides it)."""
    groups: Dict[tuple, List[dict]] = {}
    for run in plan["runs"]:
        groups.setdefault((run["scenario"], run["key"]), []).append(run)
    out_dir = Path(plan["out_dir"])
    probe_key = next((key for key, runs in groups.items() if runs[0].get("host_probe")), None)
    probe = None
    host_us = None if plan.get("host_ms") is None else plan["host_ms"] * 1e3
    if probe_key is not None:
        probe_runs = groups.pop(probe_key)
        probe = analyse_runs(probe_runs, out_dir)
        probe.host_cost = measure_host_cost(probe, probe_runs[0])
        cost = probe.host_cost
        probe.host_note = (f"host cost {cost['host_ms']:.3f} ms per task, measured: (iteration "
                           f"{cost['measured_iteration_ms']:.1f} ms - simulated {cost['simulated_zero_host_ms']:.1f} ms at zero host cost) / "
                           f"{cost['critical_path_tasks']:.0f} tasks on the critical path, on "
                           f"{cost['probe_compute_ms'][0]:g},{cost['probe_compute_ms'][1]:g} ms tasks")
        host_us = cost["host_ms"] * 1e3
    rows = [analyse_runs(runs, out_dir, host_us) for runs in groups.values()]
    for row in rows:
        base = next((r for r in rows if r.scenario == row.scenario and r.key == COMPOSITION_BASELINE), None)
        if row.composition and base is not None and row.peak_tokens:
            row.peak_tokens_over_base = max(a / b for a, b in zip(row.peak_tokens, base.peak_tokens))
    return rows + ([probe] if probe is not None else [])


def rows_to_json(rows: List[Row]) -> List[dict]:
    return [asdict(row) for row in rows]
