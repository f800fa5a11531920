"""Loads the compiled transport core, with a clear message when it has not been built.

MEGATRON_APP_CORE=PATH loads that build of the module instead (tools/build_sanitized.sh's sanitizer build, which
lives outside the package so the normal extension stays in place)."""

import importlib.util
import os
import sys

_override = os.environ.get("MEGATRON_APP_CORE")
if _override:
    _spec = importlib.util.spec_from_file_location("megatron_app.transport._shm_tensor_rdma", _override)
    if _spec is None or not os.path.isfile(_override):
        raise ImportError(f"MEGATRON_APP_CORE={_override} is not a built transport module")
    core = importlib.util.module_from_spec(_spec)
    sys.modules["megatron_app.transport._shm_tensor_rdma"] = core  # so that `from . import _shm_tensor_rdma` finds it
    _spec.loader.exec_module(core)
    setattr(sys.modules["megatron_app.transport"], "_shm_tensor_rdma", core)
else:
    try:
        from . import _shm_tensor_rdma as core
    except ImportError as error:  # pragma: no cover - depends on the build state
        raise ImportError(
            "megatron_app.transport._shm_tensor_rdma is not built; run "
            "`pip install -e . --no-build-isolation --no-deps` in the repository root"
        ) from error

__all__ = ["core"]
