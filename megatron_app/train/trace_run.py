"""Where this run's traces go: a new directory under --trace-dir, named by start time and job, agreed by all ranks."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from megatron_app.trace.runs import new_run_name, point_latest

_STORE_KEY = "megatron_app/trace_run_name"
_runs_started = 0   # a process group may train several times (benchmarks, tests): one store key per run


def job_name() -> str:
    """The launchers' job id, else torchrun's run id, else this process (a single-process run)."""
    for variable in ("MEGATRON_APP_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(variable, "")
        if value and value != "none":
            return value
    return f"pid{os.getpid()}"


def start_trace_run(root: str | os.PathLike) -> Path:
    """Rank 0 names the run; every host's first local rank creates it and points root/latest at it."""
    global _runs_started
    _runs_started += 1
    key = f"{_STORE_KEY}/{_runs_started}"
    name = new_run_name(job_name()) if dist.get_rank() == 0 else None
    if dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        if name is not None:
            store.set(key, name)
        else:
            name = store.get(key).decode()
    directory = Path(root) / name
    if os.environ.get("LOCAL_RANK", "0") == "0":
        directory.mkdir(parents=True, exist_ok=True)
        point_latest(root, name)
    return directory
