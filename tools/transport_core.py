#!/usr/bin/env python3
"""The launchers' two uses of the compiled transport core, without importing torch.

    python tools/transport_core.py --check            # exit 0 when the built module loads (setup_env.sh)
    python tools/transport_core.py --cleanup JOB_ID   # remove JOB_ID's shared-memory segments whose owners exited

Importing the module through its package (megatron_app.transport) imports torch: 1.2 s on this machine's CPU torch
and several seconds with a CUDA build, once for each check and each launcher's exit. The core itself is free of
libtorch, so it is loaded here from its file (MEGATRON_APP_CORE=PATH: that build instead, as megatron_app.transport
does). Exit codes: 0 done, 1 the module does not load (its error on stderr), 2 bad flags.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULE = "_shm_tensor_rdma"   # its PyInit_ symbol: the name must end so


def core_path() -> Path:
    override = os.environ.get("MEGATRON_APP_CORE")
    if override:
        return Path(override)
    return REPO / "megatron_app" / "transport" / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"


def load_core():
    path = core_path()
    spec = importlib.util.spec_from_file_location(f"megatron_app.transport.{MODULE}", path)
    if spec is None or not path.is_file():
        raise ImportError(f"{path} is not built (run `pip install -e . --no-build-isolation --no-deps`)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="load the built module and exit")
    action.add_argument("--cleanup", metavar="JOB_ID", help="remove this job's segments whose owner process exited")
    args = parser.parse_args(argv)
    try:
        core = load_core()
    except ImportError as error:
        print(f"transport_core.py: {error}", file=sys.stderr)
        return 1
    if args.cleanup is not None:
        core.cleanup_job(args.cleanup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
