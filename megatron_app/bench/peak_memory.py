"""Run the trainer in a fresh group of spawned gloo ranks on this host and hand back each rank's peak resident
memory and the run's iteration times (tools/bench_distributed_optimizer.py, tools/bench_recompute.py).

Every rank is a new interpreter (spawn, not fork), so its peak (getrusage's ru_maxrss at the end) holds only this
run: the interpreter, its libraries, the model and whatever the training kept alive at its worst moment. The
iteration times are the trainer's own, read from the --log-json file its reporting rank writes.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import tempfile
from dataclasses import dataclass
from typing import Sequence, Tuple

LOG_NAME = "log.json"


@dataclass(frozen=True)
class PeakMemoryRun:
    """One run: ``peak_rss_mib[rank]`` and the reporting rank's ``iteration_ms``, first iteration first."""

    peak_rss_mib: Tuple[float, ...]
    iteration_ms: Tuple[float, ...]

    @property
    def max_peak_rss_mib(self) -> float:
        """The run's figure: its worst rank (the one that would run out first)."""
        return max(self.peak_rss_mib)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, flags: Sequence[str], out_dir: str) -> None:
    """One spawned rank: train, then leave its peak resident memory in out_dir/rank<r>.json."""
    import warnings
    warnings.filterwarnings("ignore")   # megatron-core and torch warn on import; the bench's output is its table
    import torch
    import torch.distributed as dist

    from megatron_app.train.args import parse_args
    from megatron_app.train.loop import train

    torch.set_num_threads(1)   # the ranks share the host's cores: one thread each keeps them from fighting
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        train(parse_args(list(flags), environ={"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}))
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        # ru_maxrss is in KiB on Linux
        json.dump({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, handle)


def run_once(flags: Sequence[str], world: int) -> PeakMemoryRun:
    """Train with the trainer's ``flags`` on ``world`` spawned ranks; a rank's failure raises here.
    The run's --log-json is this function's own (flags must not give one)."""
    flags = [str(flag) for flag in flags]
    if any(flag == "--log-json" or flag.startswith("--log-json=") for flag in flags):
        raise ValueError("run_once reads the iteration times from its own --log-json: drop the flag")
    import torch.multiprocessing as mp   # here, not at the top: a refused call costs no torch import
    with tempfile.TemporaryDirectory() as out_dir:
        log_json = os.path.join(out_dir, LOG_NAME)
        mp.start_processes(_rank, args=(world, free_port(), flags + ["--log-json", log_json], out_dir),
                           nprocs=world, start_method="spawn")
        peaks = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as handle:
                peaks.append(json.load(handle)["peak_rss_mib"])
        with open(log_json) as handle:
            iterations = json.load(handle)["iterations"]
    return PeakMemoryRun(tuple(peaks), tuple(entry["time_ms"] for entry in iterations))
