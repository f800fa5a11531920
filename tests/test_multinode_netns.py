"""A real two-host run: run_master.sh in one network namespace, run_worker.sh in another, joined by a veth pair.
Same losses as run_single.sh for the same config, every link over TCP, both hosts' traces merge in process_trace;
a host that dies mid-run ends the other host's processes with a clear error. Root only (skips otherwise)."""

import re
import json
import subprocess
import sys
import time

import pytest
from netns_hosts import TwoHosts, netns_unavailable_reason
from pipeline_runs import REPO, run_env

pytestmark = [pytest.mark.slow]
reason = netns_unavailable_reason()
if reason:
    pytestmark.append(pytest.mark.skip(reason=reason))

LAYOUT = ["--pipeline_parallel", "2", "--model_chunks", "2"]
TRAIN = ["--iters", "3", "--num-layers", "4", "--hidden-size", "32", "--seq-length", "32"]
PORT = "29731"


@pytest.fixture(scope="module", autouse=True)
def built_once():
    """Both launchers source tools/setup_env.sh; build (if needed) once here, not twice at the same time."""
    subprocess.run(["bash", "-c", "source tools/setup_env.sh"], cwd=REPO, check=True, capture_output=True)


def _losses(path):
    return [item["loss"] for item in json.loads(path.read_text())["iterations"]]


def _launch(hosts, host, script, tmp_path, extra, log_name):
    node = ["--node_rank", str(host)] if script == "run_worker.sh" else []
    argv = ["bash", script, *LAYOUT, "--nnodes", "2", *node, "--master_addr", hosts.addresses[0],
            "--master_port", PORT, "--rendezvous_timeout", "60", *extra]
    log = open(tmp_path / log_name, "w")
    env = run_env(LOG_DIR=str(tmp_path / "logs"), PYTHONPATH="")
    return hosts.run(host, argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), log


def _stop(*launched):
    """Kill whatever a test left running (a failed assertion must not leave a host's launcher behind)."""
    for process, log in launched:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_two_hosts_train_like_one_and_their_traces_merge(tmp_path):
    single = subprocess.run(["bash", "run_single.sh", *LAYOUT, *TRAIN, "--log-json", tmp_path / "single.json",
                             "--no-trace"], cwd=REPO, env=run_env(LOG_DIR=str(tmp_path / "logs1"), PYTHONPATH=""),
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    traces = tmp_path / "traces"
    train = [*TRAIN, "--trace-dir", str(traces)]
    with TwoHosts() as hosts:
        master, master_log = _launch(hosts, 0, "run_master.sh", tmp_path, [*train, "--log-json", tmp_path / "m.json"],
                                     "master.log")
        worker, worker_log = _launch(hosts, 1, "run_worker.sh", tmp_path, [*train, "--log-json", tmp_path / "w.json"],
                                     "worker.log")
        try:
            assert worker.wait(timeout=240) == 0, (tmp_path / "worker.log").read_text()[-4000:]
            assert master.wait(timeout=60) == 0, (tmp_path / "master.log").read_text()[-4000:]
        finally:
            _stop((master, master_log), (worker, worker_log))
    # The last pipeline stage (global rank 1, on the worker host) computes and logs the losses.
    assert _losses(tmp_path / "w.json") == _losses(tmp_path / "single.json")
    headers = {}
    for path in sorted((traces / "latest").glob("trace_rank*.jsonl")):
        header = json.loads(path.read_text().splitlines()[0])
        headers[header["global_rank"]] = header
    assert set(headers) == {0, 1}
    assert headers[0]["extra"]["links"] == {"1": "tcp"} and headers[1]["extra"]["links"] == {"0": "tcp"}
    merged = subprocess.run([sys.executable, "tools/process_trace.py", "--pipeline_parallel", "2", "--model_chunks",
                             "2", "--trace-dir", str(traces), "--out-dir", str(tmp_path)], cwd=REPO,
                            env=run_env(), capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr[-3000:]
    chrome = json.loads((tmp_path / "trace_pipeline_2_model_chunks_2.json").read_text())
    events = chrome["traceEvents"] if isinstance(chrome, dict) else chrome
    assert {event.get("pid") for event in events if event.get("ph") == "X"} >= {0, 1}


def test_a_host_killed_mid_run_ends_the_other_host_with_a_clear_error(tmp_path):
    train = ["--iters", "400", "--num-layers", "4", "--hidden-size", "32", "--seq-length", "32", "--no-trace"]
    with TwoHosts() as hosts:
        master, master_log = _launch(hosts, 0, "run_master.sh", tmp_path, train, "master.log")
        worker, worker_log = _launch(hosts, 1, "run_worker.sh", tmp_path, train, "worker.log")
        try:
            deadline = time.monotonic() + 240
            while "iter 2/400" not in (tmp_path / "worker.log").read_text():
                assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
                time.sleep(0.5)
            hosts.kill_everything_in(1)
            killed_at = time.monotonic()
            rc = master.wait(timeout=120)
            took = time.monotonic() - killed_at
        finally:
            _stop((master, master_log), (worker, worker_log))
    output = (tmp_path / "master.log").read_text()
    assert rc != 0
    assert took < 60, f"the master host needed {took:.0f} s to stop"
    # The master notices on a receive ("closed its connection") or on a send ("connection lost"), whichever comes first.
    named = re.search(r"rank 0: peer rank 1 .*(closed its connection without a goodbye|connection lost)", output)
    assert named, output[-3000:]
