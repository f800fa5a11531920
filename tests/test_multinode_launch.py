"""run_master.sh / run_worker.sh start-up faults on loopback (no training starts): a wrong master address, a port
in use, a worker started twice and mismatched flags each end every launcher with one clear line, in bounded time."""

import socket
import subprocess
import threading
import time

import pytest
from pipeline_runs import REPO, run_env

from megatron_app.transport.preflight import describe_mismatch, run_config

LAYOUT = ["--pipeline_parallel", "2", "--model_chunks", "2"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(script, port, *extra, node_rank=None, timeout="5"):
    argv = ["bash", script, *LAYOUT, "--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
            "--rendezvous_timeout", timeout, *extra]
    if node_rank is not None:
        argv[2:2] = ["--node_rank", str(node_rank)]
    return subprocess.Popen(argv, cwd=REPO, env=run_env(PYTHONPATH=""), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process, timeout=180):   # generous: launchers import megatron-core on a loaded 2-core machine
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, err


@pytest.fixture(scope="module", autouse=True)
def built_once():
    subprocess.run(["bash", "-c", "source tools/setup_env.sh"], cwd=REPO, check=True, capture_output=True)


def test_run_config_ignores_host_local_paths_and_spellings():
    a = run_config({"nnodes": 2}, ["--iters", "3", "--log-json", "a.json", "--data-path", "x", "y"])
    b = run_config({"nnodes": 2}, ["--iters=3", "--log_json", "b.json", "--data_path", "x", "y"])
    assert a == b
    c = run_config({"nnodes": 2}, ["--iters", "4", "--data-path", "x", "z"])
    assert describe_mismatch(a, c, 1) == "--data-path: master 'x y', node 1 'x z'; --iters: master '3', node 1 '4'"


class TimedStderr:
    """Reads a launcher's stderr in the background, noting when each line arrived."""

    def __init__(self, process):
        self.process = process
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stderr:
            self.lines.append((time.monotonic(), line))

    def finish(self, timeout=180):
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=10)
        ended = time.monotonic()
        return self.process.returncode, "".join(line for _, line in self.lines), ended

    def when(self, text):
        return next((at for at, line in self.lines if text in line), None)


def test_worker_without_a_master_gives_up_with_a_clear_line():
    started = time.monotonic()
    rc, err = finish(launch("run_worker.sh", free_port(), node_rank=1, timeout="3"))
    assert rc == 2
    assert "worker node 1: no master answered at 127.0.0.1:" in err and "within 3 s" in err, err
    assert "Traceback" not in err
    assert time.monotonic() - started < 45


def test_the_rendezvous_timeout_holds_within_seconds():
    """Measured from the check-in line: the store client's own connect retries used to add a minute and more."""
    worker = TimedStderr(launch("run_worker.sh", free_port(), node_rank=1, timeout="10"))
    rc, err, ended = worker.finish()
    checking_in = worker.when("checking in with")
    assert rc == 2 and "no master answered" in err and checking_in is not None, err
    assert 10 <= ended - checking_in < 10 + 4, (ended - checking_in, err)


@pytest.mark.slow
def test_mismatched_flags_are_named_on_both_hosts():
    port = free_port()
    master = launch("run_master.sh", port, "--iters", "3", timeout="90")
    time.sleep(0.5)
    worker = launch("run_worker.sh", port, "--iters", "4", node_rank=1, timeout="90")
    for process in (master, worker):
        rc, err = finish(process)
        assert rc == 2, err
        assert "flags differ between hosts: --iters: master '3', node 1 '4'" in err, err


def test_master_port_in_use_is_reported():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        rc, err = finish(launch("run_master.sh", taken.getsockname()[1]))
    assert rc == 2
    assert "cannot serve the rendezvous on port" in err and "in use" in err, err


@pytest.mark.slow
def test_a_worker_started_twice_is_named():
    port = free_port()
    three_nodes = ["--nnodes", "3", "--data_parallel", "3"]
    master = launch("run_master.sh", port, *three_nodes, timeout="20")
    time.sleep(0.5)
    # Workers wait longer than the master, so the master's verdict on node 2 reaches the first worker before the
    # worker's own deadline (which starts later: its config check and check-in come seconds after the master's).
    first = launch("run_worker.sh", port, *three_nodes, node_rank=1, timeout="60")
    # The launcher checks the config (importing megatron-core, seconds on a loaded machine) before it checks in: start
    # the second copy only once the first is checking in, or the second may be the one that checks in first.
    seen = ""
    while "checking in with" not in seen:
        line = first.stderr.readline()
        assert line, f"the first worker ended before checking in: {seen}"
        seen += line
    time.sleep(3.0)
    second = launch("run_worker.sh", port, *three_nodes, node_rank=1, timeout="60")
    rc, err = finish(second)
    assert rc == 2 and "node rank 1 has already checked in" in err and "started twice" in err, err
    # Node 2 never comes: the master and the first worker stop with the reason, within the timeout.
    for process in (master, first):
        rc, err = finish(process)
        assert rc == 2 and "worker node(s) [2] did not check in within 20 s" in err, err


@pytest.mark.slow
def test_a_worker_started_twice_after_the_job_began_is_named_at_once(tmp_path):
    """The second copy reaches torchrun's store (the check-in store is gone by then): named, not a 40 s wait."""
    port = free_port()
    train = ["--iters", "200", "--num-layers", "4", "--no-trace"]  # layers divide by P x V = 4
    env = run_env(PYTHONPATH="", LOG_DIR=str(tmp_path / "logs"))

    def start(script, node_rank=None, timeout="60"):
        argv = ["bash", script, *LAYOUT, "--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                "--rendezvous_timeout", timeout, *train]
        if node_rank is not None:
            argv[2:2] = ["--node_rank", str(node_rank)]
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    master = start("run_master.sh")
    worker = start("run_worker.sh", node_rank=1)
    try:
        progress = ""
        deadline = time.monotonic() + 240
        while "iter 2/200" not in progress and time.monotonic() < deadline:  # the worker hosts the last stage
            line = worker.stdout.readline()
            if not line:
                break
            progress += line
        assert "iter 2/200" in progress, progress[-2000:]
        twice = TimedStderr(start("run_worker.sh", node_rank=1, timeout="40"))
        rc, err, ended = twice.finish()
        checking_in = twice.when("checking in with")
        assert rc == 2 and "started twice" in err and "already running" in err, err
        # Far below the 40 s rendezvous timeout; 7.5 s was seen on a machine loaded 10 deep.
        assert ended - checking_in < 15, (ended - checking_in, err)
        assert master.poll() is None and worker.poll() is None  # the running job goes on
    finally:
        import os
        import signal

        for process in (master, worker):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in (master, worker):
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "0"], "--nnodes must be a positive integer"),
    (["--nnodes", "3"], "2 ranks (pipeline 2 x tensor 1 x data 1) do not split evenly over 3 nodes"),
    (["--transport", "pigeon"], "--transport must be auto, shm, tcp or rdma"),
    (["--master_port", "70000"], "--master_port must be a port number"),
    # Megatron-LM's names set the launcher's layout (the later flag wins, as on the trainer's command line)
    (["--pipeline-model-parallel-size", "3", "--tensor-model-parallel-size", "3", "--nnodes", "2"],
     "9 ranks (pipeline 3 x tensor 3 x data 1) do not split evenly over 2 nodes"),
])
def test_bad_launcher_flags(args, message):
    result = subprocess.run(["bash", "run_master.sh", *LAYOUT, "--nnodes", "2", *args], cwd=REPO,
                            env=run_env(PYTHONPATH=""), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_worker_needs_a_node_rank_in_range():
    result = subprocess.run(["bash", "run_worker.sh", *LAYOUT, "--nnodes", "2", "--node_rank", "2",
                             "--master_addr", "127.0.0.1"], cwd=REPO, env=run_env(PYTHONPATH=""),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--node_rank must be between 1 and 1 for a worker, got '2'" in result.stderr
