"""Build megatron_app and its compiled transport core.

Into an existing Megatron environment: `pip install .` (or `pip install -e .` for a checkout you edit). The test
command (tools/run_tests.sh) uses `pip install -e . --no-build-isolation --no-deps` inside its own .venv.
"""

import os
import tempfile
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CORE_DIR = Path("csrc") / "shm_tensor_rdma"

# Every object is recompiled on each build (the default no_recompile policy): a changed header can never leave
# a stale object behind. `depends` makes build_ext notice header-only changes at all.
ParallelCompile("MAPP_BUILD_JOBS").install()

# One folder per job (core, shm, tcp, rdma, loss, bindings: csrc/shm_tensor_rdma/README.md); every folder is on the
# include path, so a file includes any header by its name.
core_sources = sorted(str(path) for path in (ROOT / CORE_DIR).rglob("*.cpp"))
core_headers = sorted(str(path) for path in (ROOT / CORE_DIR).rglob("*.h"))
core_folders = sorted(str(path.relative_to(ROOT)) for path in (ROOT / CORE_DIR).iterdir() if path.is_dir())

VERBS_PROBE = """#include <infiniband/verbs.h>
int main(void) { int count = 0; struct ibv_device **list = ibv_get_device_list(&count); if (list) ibv_free_device_list(list); return 0; }
"""


def rdma_core_available() -> tuple[bool, str]:
    """Whether <infiniband/verbs.h> compiles and a program links against -libverbs (rdma-core's dev package).
    MAPP_WITHOUT_RDMA=1 builds without it, as on a machine lacking rdma-core."""
    if os.environ.get("MAPP_WITHOUT_RDMA", "") not in ("", "0"):
        return False, "MAPP_WITHOUT_RDMA is set"
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.errors import CompileError, LinkError
    from setuptools._distutils.sysconfig import customize_compiler

    compiler = new_compiler()
    customize_compiler(compiler)
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "verbs_probe.c"
        source.write_text(VERBS_PROBE)
        devnull = os.open(os.devnull, os.O_WRONLY)
        saved = os.dup(2)
        os.dup2(devnull, 2)  # the probe's compiler errors are expected where rdma-core is missing
        try:
            objects = compiler.compile([str(source)], output_dir=scratch)
            compiler.link_executable(objects, "verbs_probe", output_dir=scratch, libraries=["ibverbs"])
        except CompileError:
            return False, "<infiniband/verbs.h> not found"
        except LinkError:
            return False, "-libverbs does not link"
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)
    return True, "rdma-core found"


with_rdma, rdma_reason = rdma_core_available()
print(f"megatron_app: rdma backend {'built with libibverbs' if with_rdma else 'not built'} ({rdma_reason})")

# MAPP_SANITIZE=address,undefined (or thread): a sanitizer build for tests (tools/build_sanitized.sh builds it
# apart from the normal extension). Frame pointers and line tables (-g1) keep the reports' stacks readable.
# ASan/UBSan unoptimised: here the build took 39 s against 79 s at -O1 -g, and the sanitized test files 63 s against
# 61 s. TSan keeps -O1 (not measured unoptimised).
SANITIZERS = [name for name in os.environ.get("MAPP_SANITIZE", "").split(",") if name]
sanitize_flags = ([f"-fsanitize={','.join(SANITIZERS)}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all",
                   "-g1", "-O1" if "thread" in SANITIZERS else "-O0"] if SANITIZERS else [])

shm_tensor_rdma = Pybind11Extension(
    "megatron_app.transport._shm_tensor_rdma",
    sources=[str(Path(source).relative_to(ROOT)) for source in core_sources],
    depends=[str(Path(header).relative_to(ROOT)) for header in core_headers],
    include_dirs=core_folders,
    cxx_std=17,
    extra_compile_args=(["-O3", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"] + sanitize_flags),
    extra_link_args=["-pthread"] + sanitize_flags[:1],
    libraries=["rt"] + (["ibverbs"] if with_rdma else []),
    define_macros=[("MAPP_HAVE_IBVERBS", "1")] if with_rdma else [],
)

setup(
    name="megatron_app",
    version="0.1.0",
    description="Adaptive pipeline schedule and shared-memory tensor transport for Megatron-Core",
    python_requires=">=3.10",
    # torch is left out on purpose: the environment's own (CUDA) torch is used, and megatron-core asks for one.
    # megatron-core: the range megatron_compat supports; pip picks the newest that installs for the interpreter
    # (0.19 needs Python >= 3.12 and imports triton, which a CPU torch does not bring).
    install_requires=[
        "megatron-core>=0.16,<0.20",
        'triton; python_version >= "3.12" and sys_platform == "linux"',
        "numpy>=1.26",
        "packaging",
    ],
    extras_require={
        "tools": ["openpyxl==3.1.5", "matplotlib==3.11.2", "tokenizers==0.23.3"],
    },
    packages=find_packages(include=["megatron_app", "megatron_app.*"]),
    ext_modules=[shm_tensor_rdma],
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
