"""Launching multi-rank runs from tests (torchrun, or forks of one process for speed; a subprocess bounded in time)."""

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
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
    (tests/helpers/fork_ranks.py): the same environment per rank, about a third of the CPU on a 2-core machine.
    The launcher itself is a fork of this pytest worker's fork_ranks server, started at the first call, when the
    environment is the server's (PYTEST_CURRENT_TEST aside); a fresh `fork_ranks.py` process otherwise."""
    cmd = [sys.executable, str(HELPERS / "fork_ranks.py"), str(nproc), *map(str, script_and_args)]
    environment = run_env(**env)
    server = _ForkServer.for_env(environment)
    if server is None:
        return subprocess.run(cmd, cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout)
    return server.run(cmd, environment, timeout)


def _launch_env(environment: dict) -> dict:
    """What a launcher's imports could read: the environment without the name of the test that asks."""
    return {key: value for key, value in environment.items() if key != "PYTEST_CURRENT_TEST"}


class _ForkServer:
    """tests/helpers/fork_ranks.py --serve, one per pytest worker and environment: its imports (~4 s of CPU) are
    paid once, not by each run's launcher. Ends with the worker (the server's parent-death signal)."""
    current = None
    lock = threading.Lock()

    def __init__(self, environment: dict):
        self.env = _launch_env(environment)
        self.folder = Path(tempfile.mkdtemp(prefix="fork_ranks_"))
        self.socket_path = str(self.folder / "socket")
        self.process = subprocess.Popen([sys.executable, str(HELPERS / "fork_ranks.py"), "--serve", self.socket_path],
                                        cwd=REPO, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        self.ready = self.process.stdout.readline().strip() == "ready"
        if not self.ready:   # a fresh launcher then says why (fork_ranks' ForkUnsafe line), as before
            self.close()
        atexit.register(self.close)

    @classmethod
    def for_env(cls, environment: dict):
        """The server for this environment (started, or restarted for another one); None when it cannot serve."""
        if cls.current is None or cls.current.env != _launch_env(environment) or cls.current.process.poll() is not None:
            if cls.current is not None:
                cls.current.close()
            cls.current = cls(environment)
        return cls.current if cls.current.ready else None

    def run(self, cmd: list, environment: dict, timeout: float) -> subprocess.CompletedProcess:
        """What subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) gives for a fresh launcher."""
        with self.lock, tempfile.TemporaryDirectory(dir=self.folder) as scratch:
            stdout, stderr = Path(scratch) / "stdout", Path(scratch) / "stderr"
            request = {"argv": cmd[2:], "env": environment, "cwd": str(REPO), "stdout": str(stdout),
                       "stderr": str(stderr)}
            deadline = time.monotonic() + timeout
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.connect(self.socket_path)
                stream = connection.makefile("rw")
                stream.write(json.dumps(request) + "\n")
                stream.flush()
                pid = json.loads(stream.readline())["pid"]
                try:
                    connection.settimeout(max(0.0, deadline - time.monotonic()))
                    returncode = json.loads(stream.readline())["returncode"]
                except socket.timeout:
                    _kill_group(pid)
                    raise subprocess.TimeoutExpired(cmd, timeout, output=_read(stdout), stderr=_read(stderr))
                except BaseException:
                    _kill_group(pid)
                    raise
            return subprocess.CompletedProcess(cmd, returncode, _read(stdout), _read(stderr))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _kill_group(pid: int) -> None:
    """A served launcher and its ranks: their own process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def read_until(process: subprocess.Popen, marker: str, timeout: float = 240.0) -> str:
    """A launcher's stdout, line by line, until a line holds `marker` (asserted, with the output's tail)."""
    seen = ""
    deadline = time.monotonic() + timeout
    while marker not in seen and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen += line
    assert marker in seen, seen[-2000:]
    return seen
