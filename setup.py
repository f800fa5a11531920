"""Build megatron_app and its compiled transport core: `pip install -e . --no-build-isolation --no-deps`."""

from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CORE_DIR = Path("csrc") / "shm_tensor_rdma"

# Every object is recompiled on each build (the default no_recompile policy): a changed header can never leave
# a stale object behind. `depends` makes build_ext notice header-only changes at all.
ParallelCompile("MAPP_BUILD_JOBS").install()

core_sources = sorted(str(path) for path in (ROOT / CORE_DIR).glob("*.cpp"))
core_headers = sorted(str(path) for path in (ROOT / CORE_DIR).glob("*.h"))

shm_tensor_rdma = Pybind11Extension(
    "megatron_app._shm_tensor_rdma",
    sources=[str(Path(source).relative_to(ROOT)) for source in core_sources],
    depends=[str(Path(header).relative_to(ROOT)) for header in core_headers],
    include_dirs=[str(CORE_DIR)],
    cxx_std=17,
    extra_compile_args=["-O3", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
    libraries=["rt"],
)

setup(
    name="megatron_app",
    version="0.1.0",
    description="Adaptive pipeline schedule and shared-memory tensor transport for Megatron-Core",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_app", "megatron_app.*"]),
    ext_modules=[shm_tensor_rdma],
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
