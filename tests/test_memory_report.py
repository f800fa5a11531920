"""train/memory_report.py: each iteration's peak memory (the JSON log's peak_memory_mib and the first iteration's
line; the trainer's own use is checked in tests/test_train_runs.py)."""

import pytest
import torch

from megatron_app.train.memory_report import IterationMemory


def test_on_cpu_the_peak_is_the_processes_resident_peak_so_far():
    memory = IterationMemory(torch.device("cpu"))
    memory.begin()
    before = memory.peak_mib()
    block = torch.ones(64 * 2 ** 20 // 4)   # 64 MiB, touched
    after = memory.peak_mib()
    del block
    memory.begin()
    assert before > 10 and after >= before + 60 and memory.peak_mib() >= after   # it never goes down
    assert memory.describe(1, after, 3, 1).endswith("MiB resident, the whole process (CPU)")
    assert "rank 3 (pipeline rank 1): peak memory in iteration 1:" in memory.describe(1, after, 3, 1)


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
