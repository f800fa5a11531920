"""tests/helpers/fork_ranks.py on a CUDA host: its parent process must not touch CUDA before forking the ranks, or no
rank can use CUDA ("Cannot re-initialize CUDA in forked subprocess", 16 errors of the equality grid on an H200).
On CPU, with torch's CUDA entry points stood in for: the parent refuses to fork with one message naming the cause,
and a module that asks torch.cuda.is_available() at import time (as megatron-core 0.19 does) leaves forks good."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

HELPERS = Path(__file__).resolve().parent / "helpers"


@pytest.fixture(scope="module")
def fork_ranks():
    spec = importlib.util.spec_from_file_location("fork_ranks_under_test", HELPERS / "fork_ranks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cuda_at_import(tmp_path, monkeypatch):
    """A module that asks for CUDA at import time, as megatron-core 0.19's dist_checkpointing/strategies/torch.py
    does, and a torch that looks CUDA-built: its runtime device count is there (and poisons forks, on a real one)."""
    (tmp_path / "cuda_at_import.py").write_text("import torch\n\nHAVE_CUDA = torch.cuda.is_available()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cuda_at_import", raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 1, raising=False)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")    # restored after the test, whatever preload sets
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    return tmp_path / "cuda_at_import.py"


def test_this_host_is_fork_safe(fork_ranks):
    fork_ranks.check_fork_safe([])


def test_a_parent_that_initialised_cuda_refuses_to_fork_with_one_clear_message(fork_ranks, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(fork_ranks.ForkUnsafe, match=r"^fork_ranks: CUDA is initialised in the parent process, so "
                       r"forked ranks could not use CUDA \(\"Cannot re-initialize CUDA in forked subprocess\"\)"):
        fork_ranks.check_fork_safe([])


def test_a_parent_whose_forks_torch_marked_bad_refuses_to_fork(fork_ranks, monkeypatch):
    # torch's at-fork handler, registered by the first runtime query, marks every child: asked of a real child
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    with pytest.raises(fork_ranks.ForkUnsafe, match="torch marked forks of the parent process bad"):
        fork_ranks.check_fork_safe([])


def test_a_cuda_query_at_import_is_named_when_nvml_cannot_answer(fork_ranks, cuda_at_import, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)    # no NVML: torch asks the CUDA runtime
    queries = fork_ranks.preload(("cuda_at_import",))
    assert queries == [f"{cuda_at_import}:3 (torch._C._cuda_getDeviceCount)"]
    assert torch._C._cuda_getDeviceCount() == 1 and torch._C._cuda_getDeviceCount.__name__ == "<lambda>"  # restored
    with pytest.raises(fork_ranks.ForkUnsafe, match=rf"queried the CUDA runtime, first at {cuda_at_import}:3 "):
        fork_ranks.check_fork_safe(queries)


def test_an_is_available_at_import_leaves_forks_good_when_nvml_answers(fork_ranks, cuda_at_import, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    assert fork_ranks.preload(("cuda_at_import",)) == []    # preload set PYTORCH_NVML_BASED_CUDA_CHECK=1
    assert sys.modules["cuda_at_import"].HAVE_CUDA is True
    fork_ranks.check_fork_safe([])
    # without that setting, the same import asks the runtime: the H200 run's failure
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    monkeypatch.delitem(sys.modules, "cuda_at_import")
    assert fork_ranks.preload(("cuda_at_import",)) == [f"{cuda_at_import}:3 (torch._C._cuda_getDeviceCount)"]


def test_the_cuda_driver_probe_does_not_load_the_driver(fork_ranks):
    assert fork_ranks.cuda_driver_initialised() is False     # this process never called cuInit
    maps = Path("/proc/self/maps").read_text()
    assert "libcuda.so" not in maps or torch.cuda.is_available()
