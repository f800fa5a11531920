"""tools/slurm/run.slurm against a real SLURM started here: munged, slurmctld and a slurmd in each of two network
namespaces joined by a veth pair. A job submitted with sbatch trains across both nodes with the same losses as
run_single.sh and writes its logs where asked; a layout that does not fit the allocation, or a bad flag, fails in one
line before any rank starts. The cluster tests need root, slurm-wlm and munge (they skip with the reason otherwise);
the checks outside an allocation run everywhere."""

import json
import re
import subprocess

import pytest
from netns_hosts import TwoHosts
from pipeline_runs import REPO, run_env
from slurm_cluster import SlurmCluster, slurm_unavailable_reason

SCRIPT = "tools/slurm/run.slurm"
LAYOUT = ["--pipeline_parallel", "2", "--model_chunks", "2"]
TRAIN = ["--iters", "3", "--num-layers", "4", "--hidden-size", "32", "--seq-length", "32"]
SLURM_MISSING = slurm_unavailable_reason()
needs_slurm = pytest.mark.skipif(SLURM_MISSING is not None, reason=str(SLURM_MISSING))


def _outside_slurm_env():
    return {key: value for key, value in run_env(PYTHONPATH="").items() if not key.startswith("SLURM_")}


@pytest.mark.parametrize("flags, message", [
    (LAYOUT, "run.slurm: not inside a SLURM allocation: submit with 'sbatch tools/slurm/run.slurm ...'"),
    ([*LAYOUT, "--nnodes", "2"], "run.slurm: --nnodes comes from the allocation: choose the node count with sbatch"),
])
def test_run_slurm_outside_an_allocation_fails_in_one_line(flags, message):
    done = subprocess.run(["bash", SCRIPT, *flags], cwd=REPO, env=_outside_slurm_env(), capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(message), done.stderr


@pytest.fixture(scope="module")
def cluster():
    # Each node also offers 2 GPUs to SLURM (device-file stand-ins): jobs that ask with --gpus-per-node see
    # SLURM_GPUS_ON_NODE as on a GPU cluster; jobs that do not ask get none, as here in the training run.
    with TwoHosts() as hosts, SlurmCluster(hosts, gpus_per_node=2) as running:
        yield running


@pytest.fixture(scope="module", autouse=True)
def built_once():
    """The job sources tools/setup_env.sh; build (if needed) here, outside the timed job."""
    subprocess.run(["bash", "-c", "source tools/setup_env.sh"], cwd=REPO, check=True, capture_output=True)


def _sbatch(cluster, tmp_path, flags, options=(), script=SCRIPT, cwd=REPO, timeout=240):
    """Submit run.slurm FLAGS ([OPTIONS] for sbatch) with the job log and per-rank logs under tmp_path and wait for
    it; returns (exit code, job id, job log)."""
    env = cluster.env(run_env(PYTHONPATH="", LOG_DIR=tmp_path / "logs"))
    job_id, state, exit_code = cluster.run_job(["--time=5", f"--output={tmp_path}/slurm-%j.out", *options, script,
                                                *flags], timeout_s=timeout, cwd=cwd, env=env)
    job_log = tmp_path / f"slurm-{job_id}.out"
    assert job_log.exists(), f"job {job_id} {state}, no job log {job_log}:\n{cluster.daemon_logs()}"
    return exit_code, job_id, job_log.read_text()


def _losses(path):
    return [item["loss"] for item in json.loads(path.read_text())["iterations"]]


@needs_slurm
@pytest.mark.slow
def test_sbatch_trains_across_two_nodes_like_run_single(cluster, tmp_path):
    single = subprocess.run(["bash", "run_single.sh", *LAYOUT, *TRAIN, "--log-json", tmp_path / "single.json",
                             "--no-trace"], cwd=REPO, env=run_env(LOG_DIR=tmp_path / "single_logs", PYTHONPATH=""),
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]

    traces = tmp_path / "traces"
    flags = [*LAYOUT, *TRAIN, "--rendezvous_timeout", "60", "--trace-dir", traces,
             "--log-json", tmp_path / "slurm.json"]
    rc, job_id, job_log = _sbatch(cluster, tmp_path, flags)
    assert rc == 0, job_log[-4000:]
    # The last pipeline stage (global rank 1, on the second node) logs the losses.
    assert _losses(tmp_path / "slurm.json") == _losses(tmp_path / "single.json")
    master = re.escape(cluster.hosts.addresses[0])
    assert re.search(rf"job {job_id}: 2 nodes \(.*\) x 1 ranks per node \(no GPUs allocated, default\), "
                     rf"master {master}:{20000 + int(job_id) % 20000}", job_log), job_log[-4000:]
    # srun labels each node's lines with its task number: both nodes spoke, each in its own role.
    assert "0: [run_master.sh] node 0" in job_log and "1: [run_worker.sh] node 1" in job_log, job_log[-4000:]
    run_logs = tmp_path / "logs" / f"slurm-{job_id}"
    for node in (0, 1):
        assert list((run_logs / f"torchrun_node{node}").glob("*/attempt_0/0/stderr.log")), sorted(run_logs.rglob("*"))
    # Each rank ran in its own namespace: the link between them is TCP, not shared memory.
    links = {}
    for path in (traces / "latest").glob("trace_rank*.jsonl"):
        header = json.loads(path.read_text().splitlines()[0])
        links[header["global_rank"]] = header["extra"]["links"]
    assert links == {0: {"1": "tcp"}, 1: {"0": "tcp"}}


@needs_slurm
@pytest.mark.parametrize("options, flags, message", [
    ((), ["--pipeline_parallel", "4", "--model_chunks", "2"],
     "run.slurm: pipeline 4 x tensor 1 x data 1 = 4 ranks, but the allocation gives 2 nodes x 1 ranks per node "
     "(no GPUs allocated, default) = 2: change sbatch --nodes, --procs_per_node or the layout"),
    ((), [*LAYOUT, "--procs_per_node", "2"], "run.slurm: pipeline 2 x tensor 1 x data 1 = 2 ranks, but the allocation "
     "gives 2 nodes x 2 ranks per node (--procs_per_node) = 4"),
    (["--gpus-per-node=2"], LAYOUT, "run.slurm: pipeline 2 x tensor 1 x data 1 = 2 ranks, but the allocation "
     "gives 2 nodes x 2 ranks per node (GPUs per node) = 4"),
    ((), [*LAYOUT, "--no-such-flag", "1"], "megatron_app.train: error: unrecognized arguments: --no-such-flag 1"),
])
def test_sbatch_with_bad_input_fails_in_one_line_before_srun(cluster, tmp_path, options, flags, message):
    rc, job_id, job_log = _sbatch(cluster, tmp_path, flags, options, timeout=120)
    assert rc == 2
    lines = [line for line in job_log.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), job_log
    assert not (tmp_path / "logs" / f"slurm-{job_id}").exists()


@needs_slurm
def test_sbatch_from_another_directory_finds_the_checkout(cluster, tmp_path):
    """sbatch runs a spool copy of the script; the checkout is found from the submitted path (scontrol Command=)."""
    rc, job_id, job_log = _sbatch(cluster, tmp_path, ["--pipeline_parallel", "4"], script=REPO / SCRIPT,
                                  cwd=tmp_path, timeout=120)
    assert rc == 2
    lines = [line for line in job_log.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("run.slurm: pipeline 4 x tensor 1 x data 1 = 4 ranks"), job_log
