"""run_master.sh / run_worker.sh start-up faults on loopback (no training starts): a wrong master address, a port
in use, a worker started twice and mismatched flags each end every launcher with one clear line, in bounded time."""

import socket
import subprocess
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


def test_worker_without_a_master_gives_up_with_a_clear_line():
    started = time.monotonic()
    rc, err = finish(launch("run_worker.sh", free_port(), node_rank=1, timeout="3"))
    assert rc == 2
    assert "worker node 1: no master answered at 127.0.0.1:" in err and "within 3 s" in err, err
    assert "Traceback" not in err
    assert time.monotonic() - started < 45


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
    first = launch("run_worker.sh", port, *three_nodes, node_rank=1, timeout="20")
    time.sleep(2.0)
    second = launch("run_worker.sh", port, *three_nodes, node_rank=1, timeout="20")
    rc, err = finish(second)
    assert rc == 2 and "node rank 1 has already checked in" in err and "started twice" in err, err
    # Node 2 never comes: the master and the first worker stop with the reason, within the timeout.
    for process in (master, first):
        rc, err = finish(process)
        assert rc == 2 and "worker node(s) [2] did not check in within 20 s" in err, err


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "0"], "--nnodes must be a positive integer"),
    (["--nnodes", "3"], "2 ranks (pipeline 2 x tensor 1 x data 1) do not split evenly over 3 nodes"),
    (["--transport", "pigeon"], "--transport must be auto, shm, tcp or rdma"),
    (["--master_port", "70000"], "--master_port must be a port number"),
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
