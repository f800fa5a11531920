"""The runtime inside Megatron: install() at Megatron's own call site, idle ranks block, dead ranks are named."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pipeline_runs import HELPERS, REPO, forked_ranks, run_env

WORKER = HELPERS / "megatron_call_site_worker.py"


def _read(out, name, rank):
    return json.loads((out / f"{name}_rank{rank}.json").read_text())


@pytest.mark.slow
def test_install_reaches_megatrons_call_site_and_uninstall_restores_it(tmp_path):
    result = forked_ranks(2, [WORKER, "train", tmp_path])
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        report = _read(tmp_path, "train", rank)
        assert report["ours_after_install"], "get_forward_backward_func() did not return our 1F1B entry point"
        assert report["restored"] and report["megatron_after_uninstall"]
        assert not report["grads_after_eval"], "a forward-only (evaluation) step produced gradients"
    last = _read(tmp_path, "train", 1)
    assert last["train_losses"] == 8 and last["eval_losses"] == 8   # one loss dict per microbatch, last stage


@pytest.mark.slow
def test_a_rank_waiting_for_input_blocks_instead_of_spinning(tmp_path):
    result = forked_ranks(2, [WORKER, "idle", tmp_path])
    assert result.returncode == 0, result.stderr[-3000:]
    report = _read(tmp_path, "idle", 1)
    (cpu_normal, _), (cpu_normal2, _), (cpu_delayed, wall_delayed) = report["cpu_wall"]
    assert wall_delayed >= report["idle_s"], "rank 1 did not wait for rank 0's delayed forward"
    # CPU spent beyond a normal step, while rank 1 sat idle for idle_s seconds: must be ~0 (<= 5% of a core)
    extra_cpu = cpu_delayed - max(cpu_normal, cpu_normal2)
    assert extra_cpu <= 0.05 * report["idle_s"], f"waiting rank used {extra_cpu:.3f} s CPU in {report['idle_s']} s"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_dead_rank_is_named_by_the_survivor_within_seconds(tmp_path):
    # Plain processes, not torchrun: no elastic agent kills the survivor for us, our runtime must notice.
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = run_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      MEGATRON_APP_JOB_ID=f"dead{port}")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "die", str(tmp_path)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert procs[1].wait(timeout=120) == 3
    died_at = time.monotonic()
    _, err = procs[0].communicate(timeout=60)
    noticed_after = time.monotonic() - died_at
    assert procs[0].returncode != 0
    assert noticed_after < 15, f"survivor took {noticed_after:.1f} s to fail"
    assert "rank 1" in err and "died" in err, err[-2000:]
    assert not [n for n in os.listdir("/dev/shm") if f"dead{port}" in n], "shared-memory segments left behind"
