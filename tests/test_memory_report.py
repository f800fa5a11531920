"""train/memory_report.py: each iteration's peak memory (the JSON log's peak_memory_mib and the first iteration's
line; the trainer's own use is checked in tests/test_train_runs.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_app.train.memory_report import IterationMemory

REPO = Path(__file__).resolve().parents[1]


def test_on_cpu_the_peak_is_the_processes_resident_peak_so_far():
    """In a fresh interpreter: the peak so far, in a test process, may already stand above any block it allocates."""
    probe = """
import torch
from megatron_app.train.memory_report import IterationMemory
memory = IterationMemory(torch.device("cpu"))
memory.begin()
before = memory.peak_mib()
resident = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) / 1024
block = torch.ones(256 * 2 ** 20 // 4)   # 256 MiB, touched
after = memory.peak_mib()
del block
memory.begin()
print(before, resident, after, memory.peak_mib())
print(memory.describe(1, after, 3, 1))
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr[-2000:]
    numbers, line = result.stdout.splitlines()[:2]
    before, resident, after, later = map(float, numbers.split())
    # the peak holds the block on top of what was resident (the imports' own peak may have stood higher), and it
    # never goes down
    assert before >= resident > 10 and after >= max(before, resident + 250) and later >= after
    assert line.endswith("MiB resident, the whole process (CPU)")
    assert "rank 3 (pipeline rank 1): peak memory in iteration 1:" in line


@pytest.mark.cuda
def test_on_cuda_the_peak_is_the_allocators_within_the_iteration():
    memory = IterationMemory(torch.device("cuda", 0))
    memory.begin()
    block = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device="cuda:0")
    first = memory.peak_mib()
    del block
    memory.begin()   # a new iteration: the freed block is no longer its peak
    small = torch.empty(2 ** 20, dtype=torch.uint8, device="cuda:0")
    second = memory.peak_mib()
    del small
    assert first >= 256 and second < first - 200
    assert memory.describe(1, first, 0, None).endswith("allocated on cuda:0")
