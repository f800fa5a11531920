"""Each iteration's peak memory, as Megatron-LM's report_memory shows it after the first iterations.

On CUDA: the caching allocator's most allocated bytes during the iteration (its peak is reset as each iteration
starts; the trainer owns the loop, so no one else's measurement is reset). On CPU the kernel keeps no peak per
iteration: the process's peak resident set so far (getrusage), which never goes down and holds the interpreter and
its libraries beside the tensors.
"""

from __future__ import annotations

import resource
from typing import Optional

import torch


class IterationMemory:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    @property
    def measure(self) -> str:
        """What the peak counts (the trace's memory events say it)."""
        return "allocated" if self.cuda else "resident"

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.init()   # idempotent; resetting an allocator no tensor has touched yet would raise
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_mib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2 ** 20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux

    def describe(self, iteration: int, peak_mib: float, rank: int, pipeline_rank: Optional[int]) -> str:
        where = f"rank {rank}" + ("" if pipeline_rank is None else f" (pipeline rank {pipeline_rank})")
        what = f"allocated on {self.device}" if self.cuda else "resident, the whole process (CPU)"
        return f"megatron_app.train: {where}: peak memory in iteration {iteration}: {peak_mib:,.0f} MiB {what}"
