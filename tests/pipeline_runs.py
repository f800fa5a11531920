"""Launching multi-rank runs from tests (torchrun, or forks of one process for speed; a subprocess bounded in time)."""

import atexit
import contextlib
import json
import os
import select
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
    with _ForkServer.lock:
        server = _ForkServer.for_env(environment)
        if server is not None:
            return server.run(cmd, environment, timeout)
    return subprocess.run(cmd, cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout)


def _launch_env(environment: dict) -> dict:
    """What a launcher's imports could read: the environment without the name of the test that asks."""
    return {key: value for key, value in environment.items() if key != "PYTEST_CURRENT_TEST"}


class _ForkServer:
    """tests/helpers/fork_ranks.py --serve, one per pytest worker and environment: its imports (~4 s of CPU) are
    paid once, not by each run's launcher. Ends with the worker (the server's parent-death signal)."""
    current = None
    lock = threading.Lock()
    START_TIMEOUT_S = 300

    def __init__(self, environment: dict):
        self.env = _launch_env(environment)
        self.folder = Path(tempfile.mkdtemp(prefix="fork_ranks_"))
        self.socket_path = str(self.folder / "socket")
        self.process = subprocess.Popen([sys.executable, str(HELPERS / "fork_ranks.py"), "--serve", self.socket_path],
                                        cwd=REPO, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL)
        atexit.register(self.close)
        self.ready = self._wait_ready()
        if not self.ready:   # fresh launchers then say why (fork_ranks' ForkUnsafe line), as before
            self.close()

    def _wait_ready(self) -> bool:
        """Whether the server said "ready" (its imports done) within START_TIMEOUT_S; anything else it prints first
        (an import's own output) is passed over."""
        deadline = time.monotonic() + self.START_TIMEOUT_S
        said = b""
        while not said.endswith(b"ready\n"):   # the server's last words on this pipe
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                return False
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                return False
            said += chunk
        return True

    @classmethod
    def for_env(cls, environment: dict):
        """The server for this environment (started, or restarted after another environment or its end); None when
        one for this environment could not start (a fresh launcher each time then)."""
        current = cls.current
        if current is None or current.env != _launch_env(environment) or (
                current.ready and current.process.poll() is not None):
            if current is not None:
                current.close()
            cls.current = current = cls(environment)
        return current if current.ready else None

    def run(self, cmd: list, environment: dict, timeout: float) -> subprocess.CompletedProcess:
        """What subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) gives for a fresh launcher."""
        with tempfile.TemporaryDirectory(dir=self.folder) as scratch:
            stdout, stderr = Path(scratch) / "stdout", Path(scratch) / "stderr"
            request = {"argv": cmd[2:], "env": environment, "cwd": str(REPO), "stdout": str(stdout),
                       "stderr": str(stderr)}
            deadline = time.monotonic() + timeout
            pid = None
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(timeout)
                connection.connect(self.socket_path)
                stream = connection.makefile("rw")
                stream.write(json.dumps(request) + "\n")
                stream.flush()
                try:
                    pid = self._answer(stream)["pid"]
                    connection.settimeout(max(0.0, deadline - time.monotonic()))
                    returncode = self._answer(stream)["returncode"]
                except socket.timeout:
                    _kill_group(pid)
                    raise subprocess.TimeoutExpired(cmd, timeout, output=_read(stdout), stderr=_read(stderr))
                except BaseException:
                    _kill_group(pid)
                    raise
            return subprocess.CompletedProcess(cmd, returncode, _read(stdout), _read(stderr))

    def _answer(self, stream) -> dict:
        line = stream.readline()
        if not line:
            raise RuntimeError(f"the fork_ranks server ended during a run (exit status {self.process.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _kill_group(pid) -> None:
    """A served launcher and its ranks: their own process group (None: not started)."""
    if pid is not None:
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
