"""Launching multi-rank runs from tests (torchrun, or forks of one process for speed; a subprocess bounded in time)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HELPERS = REPO / "tests" / "helpers"


def run_env(**extra):
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun(nproc: int, script_and_args, timeout: float = 900, **env):
    """Run `script_and_args` on nproc ranks; returns the CompletedProcess (output captured)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max_restarts", "0", *map(str, script_and_args)]
    return subprocess.run(cmd, cwd=REPO, env=run_env(**env), capture_output=True, text=True, timeout=timeout)


def forked_ranks(nproc: int, script_and_args, timeout: float = 900, **env):
    """Like torchrun(), but the ranks are forks of one process that imported torch and megatron-core once
    (tests/helpers/fork_ranks.py): the same environment per rank, about a third of the CPU on a 2-core machine."""
    cmd = [sys.executable, str(HELPERS / "fork_ranks.py"), str(nproc), *map(str, script_and_args)]
    return subprocess.run(cmd, cwd=REPO, env=run_env(**env), capture_output=True, text=True, timeout=timeout)


def read_until(process: subprocess.Popen, marker: str, timeout: float = 240.0) -> str:
    """A launcher's stdout, line by line, until a line holds `marker` (asserted, with the output's tail)."""
    import time

    seen = ""
    deadline = time.monotonic() + timeout
    while marker not in seen and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen += line
    assert marker in seen, seen[-2000:]
    return seen
