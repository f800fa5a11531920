"""--device auto|cpu|cuda decided before any rank starts: the launcher's --check-config asks torch's build and the
CUDA driver directly (megatron_app/device_choice.py) instead of importing torch."""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_app.device_choice import (DeviceUnavailable, cuda_available_without_torch,
                                        resolve_device_type, torch_build_versions)

REPO = Path(__file__).resolve().parents[1]


def fake_torch(tmp_path, text):
    package = tmp_path / "torch"
    package.mkdir()
    (package / "version.py").write_text(text)
    return lambda name: SimpleNamespace(submodule_search_locations=[str(package)]) if name == "torch" else None


class FakeDriver:
    """libcuda.so.1's three calls: cuInit's status, the count cuDeviceGetCount writes, the CUDA version
    cuDriverGetVersion writes."""

    def __init__(self, init_status=0, count=1, version=13000):
        self.init_status, self.count, self.version, self.calls = init_status, count, version, []

    def cuDriverGetVersion(self, pointer):
        self.calls.append("cuDriverGetVersion")
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int))[0] = self.version
        return 0

    def cuInit(self, flags):
        self.calls.append("cuInit")
        return self.init_status

    def cuDeviceGetCount(self, pointer):
        self.calls.append("cuDeviceGetCount")
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return 0


def no_driver_expected(name):
    raise AssertionError(f"the driver was loaded ({name}) for a build that cannot use it")


CUDA_BUILD = "__all__ = ['cuda', 'hip']\ncuda: Optional[str] = '13.0'\ngit_version = 'x'\nhip: Optional[str] = None\n"
CPU_BUILD = "from typing import Optional\ncuda = None\nhip = None\n"


def test_the_build_is_read_from_torch_version_file_in_either_assignment_form(tmp_path):
    assert torch_build_versions(fake_torch(tmp_path, CUDA_BUILD)) == {"cuda": "13.0", "hip": None}
    other = tmp_path / "other"
    other.mkdir()
    assert torch_build_versions(fake_torch(other, CPU_BUILD)) == {"cuda": None, "hip": None}


@pytest.mark.parametrize("text", ["cuda = None\n", "cuda = some_call()\nhip = None\n", "this is not python(\n"])
def test_a_version_file_that_cannot_be_read_says_so(tmp_path, text):
    assert torch_build_versions(fake_torch(tmp_path, text)) is None


def test_no_torch_installed_cannot_tell():
    assert torch_build_versions(lambda name: None) is None
    assert cuda_available_without_torch({}, find_spec=lambda name: None, load=no_driver_expected) is None


def test_a_cpu_build_is_no_cuda_without_asking_the_driver(tmp_path):
    assert cuda_available_without_torch({}, find_spec=fake_torch(tmp_path, CPU_BUILD), load=no_driver_expected) \
        is False


def test_a_cuda_build_asks_the_driver_for_its_devices(tmp_path):
    find_spec = fake_torch(tmp_path, CUDA_BUILD)
    driver = FakeDriver(count=2)
    assert cuda_available_without_torch({}, find_spec=find_spec, load=lambda name: driver) is True
    assert driver.calls == ["cuInit", "cuDeviceGetCount", "cuDriverGetVersion"]
    # CUDA_VISIBLE_DEVICES="" or no GPU: cuInit fails with CUDA_ERROR_NO_DEVICE (100)
    assert cuda_available_without_torch({}, find_spec=find_spec, load=lambda name: FakeDriver(100)) is False
    assert cuda_available_without_torch({}, find_spec=find_spec, load=lambda name: FakeDriver(count=0)) is False

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    assert cuda_available_without_torch({}, find_spec=find_spec, load=missing) is False


def test_a_driver_older_than_the_builds_cuda_is_left_to_torch(tmp_path):
    """torch's CUDA 13.0 runtime on a 12.x driver finds no device (insufficient driver); a later 13.x minor or a
    newer major one does. Where the driver is older the check asks torch, which says so in one line."""
    find_spec = fake_torch(tmp_path, CUDA_BUILD)
    assert cuda_available_without_torch({}, find_spec=find_spec, load=lambda name: FakeDriver(version=12080)) is None
    for version in (13000, 13020, 14000):
        assert cuda_available_without_torch({}, find_spec=find_spec,
                                            load=lambda name: FakeDriver(version=version)) is True


def test_rocm_builds_and_nvml_checks_are_left_to_torch(tmp_path):
    rocm = fake_torch(tmp_path, "cuda = None\nhip = '6.2'\n")
    assert cuda_available_without_torch({}, find_spec=rocm, load=no_driver_expected) is None
    other = tmp_path / "other"
    other.mkdir()
    cuda = fake_torch(other, CUDA_BUILD)
    assert cuda_available_without_torch({"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}, find_spec=cuda,
                                        load=no_driver_expected) is None


def test_the_requested_device_resolves_as_before():
    never = lambda: pytest.fail("cpu needs no probe")   # noqa: E731
    assert resolve_device_type("cpu", never) == "cpu"
    assert resolve_device_type("auto", lambda: True) == "cuda"
    assert resolve_device_type("auto", lambda: False) == "cpu"
    assert resolve_device_type("cuda", lambda: True) == "cuda"
    with pytest.raises(DeviceUnavailable, match="--device cuda requested but no CUDA device is available"):
        resolve_device_type("cuda", lambda: False)


def without_nvml_check():
    """The environment of a launcher: the suite's conftest makes torch answer from NVML, which this leaves to
    torch."""
    return {name: value for name, value in os.environ.items() if name != "PYTORCH_NVML_BASED_CUDA_CHECK"}


def test_the_answer_here_is_torchs():
    """On this host (either kind): the installed torch and driver, read directly, agree with torch itself. In a
    process of its own: the driver initialised here would break the suite's later forks on a GPU host."""
    code = ("import torch\nfrom megatron_app.device_choice import cuda_available_without_torch, driver_device_count\n"
            "assert cuda_available_without_torch() is torch.cuda.is_available()\n"
            "assert not torch.cuda.is_available() or driver_device_count() == torch.cuda.device_count()\n"
            "print(torch.cuda.is_available())\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=without_nvml_check())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("True", "False")


@pytest.mark.cuda
def test_on_a_gpu_host_the_check_sees_what_torch_sees():
    """gpu_check's pytest step (-m cuda): the driver's count through ctypes is torch's, and `--device auto` resolves
    to cuda in a launcher's check, without torch."""
    code = ("import sys\nfrom megatron_app.device_choice import cuda_available_without_torch, driver_device_count\n"
            "assert cuda_available_without_torch() is True\ncount = driver_device_count()\n"
            "assert 'torch' not in sys.modules\nimport torch\nassert count == torch.cuda.device_count(), count\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=without_nvml_check())
    assert result.returncode == 0, result.stderr


def test_check_config_imports_no_torch():
    """The launcher's check of a two-stage run: the device, the transport's mode and /dev/shm, without torch (it
    took 1.2 s here and 5.3 s on a GPU host, once per launch)."""
    code = ("import sys\nfrom megatron_app.train.__main__ import main\n"
            "main(['--check-config', '--pipeline_parallel', '2', '--device', 'auto'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**without_nvml_check(), "WORLD_SIZE": "2"})
    assert result.returncode == 0, result.stderr
    assert "config ok: 2 ranks, P=2" in result.stdout


def test_check_config_refuses_cuda_without_a_device_in_one_line():
    if cuda_available_without_torch() is not False:   # the suite's NVML check: a CPU build says False at once
        pytest.skip("this host's torch may see a CUDA device")
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", "--check-config", "--device", "cuda"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=without_nvml_check())
    assert result.returncode == 2
    assert result.stderr.strip() == ("megatron_app.train: error: --device cuda requested but no CUDA device is "
                                     "available")


def test_the_launch_imports_bench_times_both_measures_both_ways(tmp_path):
    """tools/bench_launch_imports.py (BENCHMARKS.md "Launch time"): one repeat, every variant measured."""
    out = tmp_path / "imports.json"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "bench_launch_imports.py"), "--repeats", "1",
                             "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seconds = json.loads(out.read_text())["seconds"]
    assert {measure: set(variants) for measure, variants in seconds.items()} == {
        "check-config": {"no torch", "torch first"}, "rank imports": {"deferred", "eager"}}
    assert all(len(values) == 1 and values[0] > 0 for variants in seconds.values() for values in variants.values())
    assert "rank imports: deferred" in result.stdout
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "bench_launch_imports.py"), "--repeats", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--repeats must be at least 1" in bad.stderr
