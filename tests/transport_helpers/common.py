"""Shared by the transport tests and by rank_main.py (which runs a rank in a subprocess)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

SHM_DIR = Path("/dev/shm")
RANK_MAIN = Path(__file__).with_name("rank_main.py")

# Every dtype the transport carries, with how to draw valid random values of it.
ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
]


def new_job_id() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture(name="job_id")
def job_id_fixture():
    """A fresh job id; fails the test if any of its segments is left in /dev/shm afterwards.
    Test modules import job_id_fixture to use the `job_id` fixture."""
    from megatron_app.transport import cleanup_job

    job = new_job_id()
    yield job
    leftovers = job_segments(job)
    cleanup_job(job)  # never leave garbage behind, even when the test failed
    assert leftovers == [], f"segments left in /dev/shm: {leftovers}"


def job_segments(job_id: str) -> list[str]:
    """Names in /dev/shm that belong to `job_id` (published or being built)."""
    prefix = f"mapp_{job_id}_r"
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def random_tensor(generator: torch.Generator, dtype: torch.dtype, shape) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities, denormals included) of `dtype`; bools are 0/1."""
    numel = 1
    for extent in shape:
        numel *= extent
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=generator, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=generator, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))


def message_for(seed: int, index: int, max_numel: int = 40_000) -> torch.Tensor:
    """The index-th message of a deterministic stream: random dtype, rank 0-4 and shape (some empty)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    dtype = ALL_DTYPES[int(torch.randint(0, len(ALL_DTYPES), (1,), generator=generator))]
    ndim = int(torch.randint(0, 5, (1,), generator=generator))
    limit = max(1, int(round(max_numel ** (1.0 / max(ndim, 1)))))
    shape = [int(torch.randint(0, limit + 1, (1,), generator=generator)) for _ in range(ndim)]
    return random_tensor(generator, dtype, shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class RankProcess:
    """A rank running tests/transport_helpers/rank_main.py in a subprocess; talks line by line on stdout."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, str(RANK_MAIN), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.process.pid

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """The next stdout line; fails the test unless it starts with `prefix`."""
        line = self._readline(timeout)
        if not line.startswith(prefix):
            raise AssertionError(f"expected a line starting with {prefix!r}, got {line!r}; stderr: {self.stderr()}")
        return line

    def _readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        stdout = self.process.stdout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no output from rank process within {timeout} s")
            readable, _, _ = select.select([stdout], [], [], remaining)
            if readable:
                line = stdout.readline()
                if not line:
                    raise AssertionError(f"rank process exited (rc={self.process.wait()}): {self.stderr()}")
                return line.strip()

    def stderr(self) -> str:
        if self.process.poll() is None:
            return "<still running>"
        return self.process.stderr.read()[-3000:]

    def wait(self, timeout: float = 60.0) -> int:
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)

    def close(self) -> None:
        self.kill()
        for stream in (self.process.stdout, self.process.stderr):
            stream.close()


def process_cpu_seconds() -> float:
    """CPU time (user + system) of this whole process, all threads, from /proc."""
    with open("/proc/self/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")
