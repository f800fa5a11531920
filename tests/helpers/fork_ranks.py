"""Runs a rank script on N local ranks as forks of one process that imported torch and megatron-core once.

What torchrun --standalone gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), without each rank paying
the ~10 s of CPU that importing torch and megatron-core costs (torch.compile decorators pull in dynamo/inductor): on
the 2-core CI machine the imports were most of a small multi-rank test. Only for tests; users launch with torchrun.
    python tests/helpers/fork_ranks.py NPROC SCRIPT [ARGS...]
Like torchrun: the first rank that fails stops the others, and the exit status is non-zero if any rank failed.
"""

import ctypes
import os
import runpy
import signal
import socket
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def preload() -> None:
    """Imported before forking, so every rank finds them in sys.modules. Nothing here may start a thread."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401


def run_rank(rank: int, world: int, script: str, args: list[str]) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # no orphans if the parent is killed
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank))
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exit_request:
        code = exit_request.code
        if code is None:
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            return 1
        return code
    except BaseException:  # noqa: BLE001 - a rank's failure becomes its exit status, as under torchrun
        traceback.print_exc()
        return 1


def main() -> int:
    world, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    preload()
    # The port is picked after the ~10 s of imports, just before rank 0 binds it: picked before, another test's
    # process took it in between once (EADDRINUSE under two pytest workers).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = run_rank(rank, world, script, args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        ranks[pid] = rank
    failed = 0
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            print(f"fork_ranks: rank {rank} exited with {code}; stopping the others", file=sys.stderr)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while ranks and time.monotonic() < deadline:
                done, _ = os.waitpid(-1, os.WNOHANG)
                if done:
                    ranks.pop(done, None)
                else:
                    time.sleep(0.05)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    return failed


if __name__ == "__main__":
    sys.exit(main())
