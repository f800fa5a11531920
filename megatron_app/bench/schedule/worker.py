"""One rank of tools/bench_schedule.py, launched by it under torchrun: runs every run of a plan in turn.

    python -m torch.distributed.run --nproc_per_node P --module megatron_app.bench.schedule.worker PLAN.json

One process group for the whole plan, so the ~5 s of imports per rank are paid once. A megatron_app run goes through
the trainer itself (megatron_app.train: parse_args + train with --emulate-compute; traces and the JSON log land in
the run's directory); a torch.distributed.pipelining run goes through torch_peer.py and writes its
per-rank step times and compute spans as JSON (monotonic clock, shared by the processes of one host).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist


def trainer_argv(run: dict, run_dir: Path) -> list:
    """The megatron_app.train flags of one run (also what BENCHMARKS.md quotes to reproduce a row)."""
    P, V = run["pipeline_parallel"], run["model_chunks"]
    argv = ["--pipeline_parallel", P, "--model_chunks", V, "--num-layers", P * V,
            "--hidden-size", run["hidden_size"], "--num-attention-heads", 1, "--seq-length", run["seq_length"],
            "--vocab-size", run["vocab_size"], "--micro-batch-size", run["micro_batch_size"],
            "--global-batch-size", run["microbatches"] * run["micro_batch_size"], "--iters", run["iterations"],
            "--seed", run["seed"], "--schedule", run["schedule"], "--emulate-compute", run["emulate_compute"]]
    if run["schedule"] == "app" and not run.get("schedule_file"):   # the other schedules refuse a --policy
        argv += ["--policy", run["policy"]]
    for flag, key in (("--slow-rank", "slow_rank"), ("--slow-factor", "slow_factor"),
                      ("--straggler-prob", "straggler_prob"), ("--straggler-factor", "straggler_factor"),
                      ("--link-delay", "slow_link"), ("--emulate-lengths-file", "lengths_file"),
                      ("--memory-factor", "memory_factor"), ("--composition", "composition"),
                      ("--documents-per-microbatch", "documents_per_microbatch")):
        if run.get(key) is not None:
            argv += [flag, run[key]]
    if run.get("split_backward"):
        argv.append("--split-backward")
    if run.get("schedule_file"):
        argv += ["--schedule-file", run["schedule_file"]]
    if run_dir is not None:
        argv += ["--trace-dir", run_dir / "trace", "--log-json", run_dir / "log.json"]
    return [str(item) for item in argv]


def _process_groups() -> set:
    return set(dist.distributed_c10d._world.pg_map)   # every live group, the default one included


def run_app(run: dict, run_dir: Path, job_id: str) -> None:
    from megatron_app.train.args import parse_args
    from megatron_app.train.loop import train

    os.environ["MEGATRON_APP_JOB_ID"] = job_id   # fresh shared-memory names for every run
    before = _process_groups()
    try:
        train(parse_args(trainer_argv(run, run_dir)))
    finally:
        # Megatron's destroy_model_parallel only forgets its groups; each gloo group keeps three threads, and a
        # plan of 100 runs would pile up thousands of them.
        for group in _process_groups() - before:
            dist.destroy_process_group(group)


def run_torch(run: dict, run_dir: Path) -> None:
    from megatron_app.bench.schedule.torch_peer import SPLIT_BACKWARD, SpanRecorder, run_torch_schedule

    from megatron_app.schedule import PipelineShape
    from megatron_app.emulation.spec import EmulationSpec, TaskDurations

    spec = EmulationSpec.parse(run["emulate_compute"], slow_rank=run.get("slow_rank"),
                               slow_factor=run.get("slow_factor") or 1.0,
                               straggler_prob=run.get("straggler_prob") or 0.0,
                               straggler_factor=run.get("straggler_factor") or 1.0, seed=run["seed"])
    # torch's zero-bubble rows split the backward as ours do (the same B / W draws)
    shape = PipelineShape(run["pipeline_parallel"], run["model_chunks"], run["microbatches"],
                          split_backward=run["schedule"] in SPLIT_BACKWARD)
    recorder = SpanRecorder()
    steps = run_torch_schedule(run, TaskDurations(spec, shape), recorder)
    payload = {"rank": dist.get_rank(), "steps": steps, "spans": recorder.spans}
    with open(run_dir / f"torch_rank{dist.get_rank()}.json", "w") as handle:
        json.dump(payload, handle)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    plan = json.loads(Path(args[0]).read_text())
    dist.init_process_group("gloo")
    began = time.perf_counter()
    try:
        for index, run in enumerate(plan["runs"]):
            run_dir = Path(plan["out_dir"]) / run["id"]
            run_dir.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            if dist.get_rank() == 0:
                threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
                print(f"[bench] {time.perf_counter() - began:6.1f} s  {index + 1}/{len(plan['runs'])} "
                      f"{run['scenario']}: {run['label']} (threads {threads})", flush=True)
            if run["system"] == "app":
                run_app(run, run_dir, f"{plan['job_id']}r{index}")
            else:
                run_torch(run, run_dir)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
