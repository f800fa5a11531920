"""Which device a run asked for (``--device auto|cpu|cuda``), and whether torch would find a CUDA device here,
answered without importing torch.

A launcher's ``--check-config`` resolves ``--device auto`` before any rank starts; importing torch for that one
answer took 1.2 s on this project's CPU machine and 5.3 s on a GPU host, once per launch. torch.cuda.is_available()
is true when torch was built with CUDA and the driver reports a device (cudaGetDeviceCount: cuInit, then
cuDeviceGetCount, which honour CUDA_VISIBLE_DEVICES). Both halves are read here directly: the build from torch's
generated version.py, the count from the driver library. The ranks still ask torch itself; where the two could
disagree (a ROCm build, NVML-based checks, a torch that cannot be found, a driver older than the build's CUDA major,
for which torch's runtime finds no device) this says it cannot tell.
Written by hand: no package on PyPI answers this without importing torch or a CUDA runtime.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import os
from pathlib import Path
from typing import Callable, Optional

CPU, CUDA, AUTO = "cpu", "cuda", "auto"
DEVICE_CHOICES = (AUTO, CPU, CUDA)
DRIVER_LIBRARY = "libcuda.so.1"


class DeviceUnavailable(ValueError):
    """The run asked for a device this machine does not have (one line for the user)."""


def resolve_device_type(requested: str, cuda_available: Callable[[], bool]) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cuda`` without a GPU is refused."""
    if requested == CPU:
        return CPU
    if not cuda_available():
        if requested == CUDA:
            raise DeviceUnavailable("--device cuda requested but no CUDA device is available")
        return CPU
    return CUDA


def torch_build_versions(find_spec: Callable = importlib.util.find_spec) -> Optional[dict]:
    """{"cuda": str|None, "hip": str|None} from the installed torch's version.py, or None when it cannot be read."""
    spec = find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        source = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return None
    found = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip") and node.value is not None:
            try:
                found[target.id] = ast.literal_eval(node.value)
            except ValueError:
                return None
    return found if set(found) == {"cuda", "hip"} else None


def _driver(load: Callable):
    """The CUDA driver library, or None without one."""
    try:
        return load(DRIVER_LIBRARY)
    except OSError:
        return None


def driver_device_count(load: Callable = ctypes.CDLL) -> int:
    """The devices the CUDA driver shows this process (0 without a driver, or when it fails to initialise)."""
    driver = _driver(load)
    if driver is None or driver.cuInit(0) != 0:   # CUDA_ERROR_NO_DEVICE (no device visible), NOT_INITIALIZED, ...
        return 0
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def driver_cuda_version(load: Callable = ctypes.CDLL) -> Optional[int]:
    """The CUDA version the driver supports (cuDriverGetVersion: 1000 x major + 10 x minor), None when unknown."""
    driver = _driver(load)
    version = ctypes.c_int(0)
    if driver is None or driver.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


def _major(version: str) -> Optional[int]:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def cuda_available_without_torch(environ=os.environ, find_spec: Callable = importlib.util.find_spec,
                                 load: Callable = ctypes.CDLL) -> Optional[bool]:
    """What torch.cuda.is_available() would say, or None when this cannot tell without torch."""
    versions = torch_build_versions(find_spec)
    if versions is None or versions["hip"]:
        return None                      # no torch found, or a ROCm build (torch.cuda on HIP)
    if not versions["cuda"]:
        return False                     # a CPU build never sees a GPU
    if environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1":
        return None                      # torch asks NVML instead of the driver then
    if driver_device_count(load) == 0:
        return False
    driver, build = driver_cuda_version(load), _major(versions["cuda"])
    if driver is None or build is None or driver // 1000 < build:
        return None                      # a driver older than the build's major: torch's runtime finds no device
    return True
