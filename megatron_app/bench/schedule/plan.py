"""The runs of one tools/bench_schedule.py benchmark (scenarios x rows x repeats, plus the host-cost probe) and the
torchrun of the worker that runs them all in one process group."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import List

from megatron_app.bench.schedule.rows import (COMPOSITION_ROWS, DEFAULT_SCHEDULE_KEYS, MEGATRON_ROW, SCHEDULES,
                                              SPLIT_BACKWARD_KEYS, TORCH_ZB_ORDER)
from megatron_app.bench.schedule.scenarios import (COMPOSITION_SCENARIO_NAMES, HOST_PROBE, HOST_PROBE_COMPUTE, REPO,
                                                   VARIABLE_LENGTH, scenario_flags)
from megatron_app.bench.torch_action_lists import action_lists
from megatron_app.schedule import POLICIES

WORKER_MODULE = "megatron_app.bench.schedule.worker"


def scenario_schedule_keys(scenario: str, args) -> List[str]:
    """The rows a scenario runs: --schedules, or by default the composition rows on the copyright corpus and the
    others elsewhere; composition rows need documents of known lengths, torch's schedules one shape per stage."""
    composing = scenario in COMPOSITION_SCENARIO_NAMES
    keys = args.schedule_keys or (list(COMPOSITION_ROWS) if composing else DEFAULT_SCHEDULE_KEYS)
    has_lengths = composing or scenario == VARIABLE_LENGTH
    return [key for key in keys if (has_lengths or key not in COMPOSITION_ROWS)
            and not (has_lengths and SCHEDULES[key].system == "torch")]


def planned_variants(key: str, args) -> List[tuple]:
    """(row key, label suffix, memory factor) of each row a schedule key gives: a policy that takes a memory factor
    (the registry says which) one per factor."""
    if key not in POLICIES or not POLICIES[key].takes("memory_factor"):
        return [(key, "", None)]
    return [(key if factor == 1.0 else f"{key}-x{factor:g}", "" if factor == 1.0 else f" mem {factor:g}x",
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
        path = out_dir / "torch_zb_order.csv"
        with open(path, "w", newline="") as handle:
            csv.writer(handle).writerows(action_lists("InterleavedZeroBubble", args.pipeline_parallel,
                                                      args.model_chunks, args.microbatches))
        for run in runs:
            if run["key"] == TORCH_ZB_ORDER:
                run["schedule_file"] = str(path)
    return {"job_id": job_id, "out_dir": str(out_dir), "runs": runs, "host_ms": args.host_ms}


def host_probe_run(args, run_id: str, repeat: int) -> dict:
    """The run that measures the runtime's own cost per task (analysis.measure_host_cost): Megatron's
    interleaved order, near-zero emulated compute, same pipeline."""
    run = plan_run(args, run_id, repeat, HOST_PROBE, "interleaved")
    run.update(key=HOST_PROBE, label=HOST_PROBE, emulate_compute=HOST_PROBE_COMPUTE, host_probe=True)
    return run


def plan_run(args, run_id: str, repeat: int, scenario: str, key: str) -> dict:
    flags = scenario_flags(scenario, args.slow_link, args.lengths_file)
    row = SCHEDULES[key]
    label, system, schedule, policy, single_chunk, sim_policy = (row.label, row.system, row.schedule, row.policy,
                                                                 row.single_chunk, row.sim_policy)
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
        run["composition"] = COMPOSITION_ROWS[key].composition
    if key == "torch-zb":
        run["notes"].append("backward split 50/50 into input- and weight-gradient waits; no simulator policy for "
                            "ZeroBubble")
    if system == "torch" and sim_policy == MEGATRON_ROW:
        run["notes"].append("sim column: Megatron's interleaved order")
    return run


def run_workers(plan: dict, nproc: int, log_path: Path, timeout_s: float) -> int:
    """torchrun the worker on nproc ranks; progress lines go to stderr, everything to log_path."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MEGATRON_APP_JOB_ID", None)
    plan_path = Path(plan["out_dir"]) / "plan.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max_restarts", "0", "--module", WORKER_MODULE, str(plan_path)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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


def last_error(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()
             if "Error" in line or "error:" in line]
    return lines[-1][:300] if lines else "no error line in the log"
