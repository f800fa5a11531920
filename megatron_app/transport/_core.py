"""Loads the compiled transport core, with a clear message when it has not been built."""

try:
    from megatron_app import _shm_tensor_rdma as core
except ImportError as error:  # pragma: no cover - depends on the build state
    raise ImportError(
        "megatron_app._shm_tensor_rdma is not built; run "
        "`pip install -e . --no-build-isolation --no-deps` in the repository root"
    ) from error

__all__ = ["core"]
