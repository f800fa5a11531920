"""What a user reads when a run fails: one line of our own naming the failed rank (signal or error, last iteration,
log path) instead of torchrun's traceback; one line for a host that lacks room in /dev/shm, before any rank starts;
one line for an environment failure inside a rank."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_app.train import run_ranks
from megatron_app.train.__main__ import environment_failure
from megatron_app.train.shm_budget import estimate, local_ring_counts, segment_bytes
from pipeline_runs import REPO, read_until, run_env


MiB = 2**20
ROOT_CAUSE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
megatron_app.train FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_12:00:00
  host      : node7
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def test_root_cause_names_rank_signal_iteration_and_log(tmp_path):
    rank_dir = tmp_path / "abc_1" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stderr.log").write_text("warming up\n")
    (tmp_path / "abc_1" / "attempt_0" / "0").mkdir()
    (tmp_path / "abc_1" / "attempt_0" / "0" / "stdout.log").write_text(
        "iter 1/50 | loss 6.9 | 10 ms | 1 tokens/s\niter 2/50 | loss 6.8 | 10 ms | 1 tokens/s\n")
    line = run_ranks.failure_line("run_single.sh", tmp_path, tmp_path / "agent.log", ROOT_CAUSE, 1)
    assert line == (f"run_single.sh: rank 3 on node7 failed (killed by SIGKILL) after iteration 2 of 50; "
                    f"its log: {rank_dir}/stderr.log")
    (rank_dir / "stderr.log").write_text("megatron_app.train: rank 3: error: [Errno 28] No space left on device\n")
    assert run_ranks.failure_line("x", tmp_path, tmp_path / "a.log", ROOT_CAUSE.replace("-9 (pid", "1 (pid"), 1) \
        .startswith("x: rank 3 on node7 failed (exit code 1) after iteration 2 of 50: [Errno 28] No space left")
    assert run_ranks.failure_line("x", tmp_path / "none", tmp_path / "a.log", "no report", 1) == (
        f"x: the job failed (torchrun exit 1) before the first iteration ended; torchrun's report: {tmp_path}/a.log")


def test_a_host_without_the_reporting_rank_does_not_claim_the_job_never_iterated(tmp_path):
    # On a multi-host job the rank printing iteration lines (the last stage) may live on the other host.
    line = run_ranks.failure_line("x", tmp_path / "none", tmp_path / "a.log", "no report", 1, multi_host=True)
    assert "before the first iteration" not in line and "(no rank of this host reports iterations)" in line, line
    assert run_ranks.nodes_of(["torch.distributed.run", "--nnodes", "2", "--node_rank", "1"]) == 2
    assert run_ranks.nodes_of(["torch.distributed.run", "--nnodes=1:4"]) == 4
    assert run_ranks.nodes_of(["torch.distributed.run", "--standalone", "--nnodes", "1"]) == 1
    assert run_ranks.nodes_of(["torch.distributed.run"]) == 1


TWO_FAILURES = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
megatron_app.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_12:00:00
  host      : node7
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4243)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_12:00:00
  host      : node7
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4242)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
TRANSPORT_CLOSED = """\
Traceback (most recent call last):
  File "executor.py", line 1, in run
    self.transport.wait_any(keys)
megatron_app.transport._core.TransportClosed: rank 1 closed its transport while rank 0 waited
"""


def _rank_logs(tmp_path, stderr_by_rank: dict[int, str]) -> None:
    for local_rank, text in stderr_by_rank.items():
        rank_dir = tmp_path / "abc_1" / "attempt_0" / str(local_rank)
        rank_dir.mkdir(parents=True)
        (rank_dir / "stderr.log").write_text(text)


def test_the_rank_whose_own_error_came_first_is_named_not_torchruns_first_observed(tmp_path):
    # torchrun saw rank 0 first, but rank 0 only lost its peer: rank 1's own error is the cause
    _rank_logs(tmp_path, {0: TRANSPORT_CLOSED,
                          1: "megatron_app.train: rank 1: error: [Errno 17] File exists: '/dev/null'\n"})
    line = run_ranks.failure_line("run_single.sh", tmp_path, tmp_path / "agent.log", TWO_FAILURES, 1, {0: 9, 1: 4})
    assert line.startswith("run_single.sh: rank 1 on node7 failed (exit code 1) before the first iteration ended: "
                           "[Errno 17] File exists: '/dev/null'; its log: "), line


def test_among_own_errors_the_earliest_wins_and_a_bug_beats_a_lost_peer(tmp_path):
    _rank_logs(tmp_path, {0: "megatron_app.train: rank 0: error: iteration 3: the loss is nan\n",
                          1: "megatron_app.train: rank 1: error: No space left on device\n"})
    line = run_ranks.failure_line("x", tmp_path, tmp_path / "a.log", TWO_FAILURES, 1, {0: 7, 1: 2})
    assert "rank 1 on node7" in line and line.endswith(
        f": No space left on device; its log: {tmp_path}/abc_1/attempt_0/1/stderr.log"), line
    bug = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad shape\n"
    peer = "megatron_app.train: rank 0: rank 1 (pipeline rank 1) died: its process exited\n"
    for name, text in (("0", peer), ("1", bug)):
        (tmp_path / "abc_1" / "attempt_0" / name / "stderr.log").write_text(text)
    line = run_ranks.failure_line("x", tmp_path, tmp_path / "a.log", TWO_FAILURES, 1, {0: 1, 1: 2})
    assert "rank 1 on node7" in line and ": ValueError: bad shape; its log:" in line, line


# Both ranks' stderr of `run_single.sh --pipeline_parallel 2 --model_chunks 2 --variable-seq-lengths --composition
# balanced --device cuda` on an H200 (../shared/gpu/h200-2026-11-26/balanced_failure/): torch.distributed's excepthook
# wrote "[rank0]: " before every line of rank 0's traceback; rank 1 left no error.
H200_FAILURE = Path(__file__).resolve().parent / "data" / "h200_balanced_failure"
PACKED_ASSERTION = ("AssertionError: Packed sequence is not supported by DotProductAttention.Please use "
                    "TEDotProductAttention instead.")
BUG = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    g()\nValueError: bad shape\n"


def test_a_rank_prefixed_traceback_recorded_on_a_gpu_host_gives_its_exception_and_rank():
    text = (H200_FAILURE / "rank0.stderr.log").read_text()
    assert all(line.startswith("[rank0]: ") for line in text.splitlines() if "Traceback" in line)
    error = run_ranks.rank_error(0, text)
    assert (error.line, error.rank, error.own, error.consequence) == (PACKED_ASSERTION, 0, False, False)
    assert run_ranks.rank_error(1, (H200_FAILURE / "rank1.stderr.log").read_text()) is None


def test_the_failure_line_of_the_recorded_gpu_failure_names_rank_0_and_its_assertion(tmp_path):
    _rank_logs(tmp_path, {rank: (H200_FAILURE / f"rank{rank}.stderr.log").read_text() for rank in (0, 1)})
    log = tmp_path / "abc_1" / "attempt_0" / "0" / "stderr.log"
    line = run_ranks.failure_line("run_single.sh", tmp_path, tmp_path / "a.log", TWO_FAILURES, 1)
    assert line == (f"run_single.sh: rank 0 on node7 failed (exit code 1) before the first iteration ended: "
                    f"{PACKED_ASSERTION}; its log: {log}")
    # without torchrun's report, the rank is the one torch's prefix names (global rank 6, local rank 2)
    alone = tmp_path / "alone"
    _rank_logs(alone, {2: log.read_text().replace("[rank0]", "[rank6]")})
    line = run_ranks.failure_line("x", alone, tmp_path / "a.log", "no report", 1)
    assert line.startswith(f"x: rank 6 failed (exit code 1) before the first iteration ended: {PACKED_ASSERTION};")


@pytest.mark.parametrize("prefix", ["", "[rank3]: ", "[default1]:[rank3]: ", "    | "])
def test_any_prefix_that_the_traceback_carries_on_every_line_is_read_through(prefix):
    text = "".join(prefix + line if line else line for line in BUG.splitlines(keepends=True))
    interleaved = text.replace("    g()\n", "    g()\n[rank1]: some other process's line\n\n")
    for stderr in (text, interleaved, "warming up\n" + text + "\n"):
        error = run_ranks.rank_error(1, stderr)
        assert error.line == "ValueError: bad shape", stderr
        assert error.rank == (3 if "rank3" in prefix else None)
    # a chained exception: the last traceback's exception
    chained = text + "\nDuring handling of the above exception, another exception occurred:\n\n" + \
        text.replace("ValueError: bad shape", "mod.KeyError: 'x'")
    assert run_ranks.rank_error(1, chained).line == "KeyError: 'x'"


@pytest.mark.parametrize("text", [
    "", "\n\n", "no traceback at all\n", "[rank0]: Traceback (most recent call last):",
    "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n",   # cut off before its exception
    "Traceback (most recent call last)", "junk Traceback (most recent call last): junk\n\x00\x01\n",
    b"\xff\xfe\x00Traceback (most recent call last):\r\n\x80\x81: \xc3\n".decode("utf-8", errors="replace"),
    "[rank0]: megatron_app.train: rank 0: rank 1 (pipeline rank 1) died\n",
])
def test_rank_error_never_raises_on_any_stderr(text):
    error = run_ranks.rank_error(0, text)
    assert error is None or (isinstance(error.line, str) and "\n" not in error.line)


def test_rank_error_never_raises_on_arbitrary_text():
    from hypothesis import given, settings, strategies as st

    pieces = st.sampled_from(["Traceback (most recent call last):", "[rank0]: ", "  File \"x\"", "ValueError: x",
                              "megatron_app.train: error: e", "\n", "\r", " ", "\x00", ":"])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.one_of(pieces, st.text(max_size=8)), max_size=30), st.binary(max_size=64))
    def check(parts, junk):
        for text in ("".join(parts), junk.decode("utf-8", errors="replace") + "".join(parts)):
            run_ranks.rank_error(0, text)

    check()


def test_the_launcher_ends_with_the_prefixed_tracebacks_exception(tmp_path, capsys):
    # a stand-in for torchrun --tee 3: the rank's lines reach run_ranks as "[default0]:[rank0]: ...", its log holds
    # "[rank0]: ...", torchrun's own report is unprefixed
    recorded = H200_FAILURE / "rank0.stderr.log"
    fake_torchrun = tmp_path / "fake_torchrun.py"
    fake_torchrun.write_text(f"""
import pathlib, sys
text = pathlib.Path({str(recorded)!r}).read_text()
rank_dir = pathlib.Path({str(tmp_path / "logs")!r}) / "abc_1" / "attempt_0" / "0"
rank_dir.mkdir(parents=True)
(rank_dir / "stderr.log").write_text(text)
for line in text.splitlines():
    sys.stderr.write("[default0]:" + line + "\\n")
sys.stderr.write({ROOT_CAUSE.replace("3 (local_rank: 1)", "0 (local_rank: 0)").replace("-9 (pid", "1 (pid")!r})
sys.exit(1)
""")
    code = run_ranks.main(["--name", "run_single.sh", "--log-dir", str(tmp_path / "logs"), "--",
                           sys.executable, str(fake_torchrun)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines()[-1] == (
        f"run_single.sh: rank 0 on node7 failed (exit code 1) before the first iteration ended: {PACKED_ASSERTION}; "
        f"its log: {tmp_path}/logs/abc_1/attempt_0/0/stderr.log")


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in children] + [d for c in children for d in _descendants(int(c))]


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    for pid in _descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"megatron_app.train" in command:
            return pid
    return None


@pytest.mark.slow
def test_kill_9_of_a_rank_ends_with_one_line_naming_it(tmp_path):
    log_dir = tmp_path / "logs"
    launcher = subprocess.Popen(
        ["bash", str(REPO / "run_single.sh"), "--pipeline_parallel", "2", "--model_chunks", "1", "--iters", "400",
         "--num-layers", "2", "--no-trace"], cwd=REPO, env=run_env(LOG_DIR=str(log_dir)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        read_until(launcher, "iter 2/400")
        victim = _rank_pid(launcher.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("run_single.sh: rank 1 on ") and "failed (killed by SIGKILL) after iteration " in last
    assert last.endswith("/attempt_0/1/stderr.log") and f"its log: {log_dir}/" in last, last
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    assert list(log_dir.glob("torchrun/torchrun_agent_*.log"))  # torchrun's own report is kept, not shown


def test_shm_estimate_matches_the_transport_and_counts_local_peers():
    # The transport reserved 16785408 bytes for one ring of 16 x 1 MiB slots (issue 15); we allow one page more.
    assert 16785408 <= segment_bytes(1, 1 << 20, 16) <= 16785408 + 4096
    assert local_ring_counts(4, 1, 1, ranks_per_node=4, node_rank=0) == [3, 3, 3, 3]
    assert local_ring_counts(2, 1, 1, ranks_per_node=1, node_rank=1) == [0]  # its only peer is on another host
    assert local_ring_counts(2, 2, 1, ranks_per_node=2, node_rank=0) == [0, 0]  # tp pairs per host: no shm peer
    needed = estimate(4, 1, 1, ranks_per_node=4, sizes=(1 << 20, 16))  # 3 rings of 5 slots each per rank
    assert (needed.ranks, needed.per_rank) == (4, segment_bytes(3, 1 << 20, 16))
    assert 60 * MiB < needed.needed < 61 * MiB
    reason = needed.shortfall(free=56 * MiB, total=64 * MiB)
    assert reason.startswith("this job needs about 60.0 MiB of shared memory in /dev/shm (4 rank(s) on this host")
    assert "only 56.0 MiB is free there (size 64.0 MiB)" in reason and needed.shortfall(1 << 30, 1 << 30) is None


def test_environment_failures_become_one_line_and_bugs_do_not():
    shm = RuntimeError("cannot reserve 16785408 bytes in /dev/shm/mapp_x.init1 (is /dev/shm full?): No space left "
                       "on device")
    assert environment_failure(shm) == str(shm)
    assert environment_failure(OSError(errno.ENOSPC, "No space left on device")) == "[Errno 28] No space left on device"
    port = RuntimeError("The server socket has failed to listen on any local network address.\n"
                        "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: Address already in use")
    assert environment_failure(port) == ("The server socket has failed to listen on any local network address. "
                                         "(port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: "
                                         "Address already in use)")
    assert environment_failure(ValueError("bad")) is None and environment_failure(RuntimeError("a bug")) is None


def _can_mount_private_tmpfs() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_private_tmpfs(), reason="needs root and unshare to give the run a small /dev/shm")
def test_a_small_dev_shm_is_refused_with_the_number_before_any_rank_starts(tmp_path):
    """Docker-like small /dev/shm (16 MiB, in a private mount namespace): one line, exit 2, no rank started."""
    command = (f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec bash {REPO / 'run_single.sh'} "
               "--pipeline_parallel 2 --model_chunks 1 --iters 1 --num-layers 2 --no-trace")
    start = time.monotonic()
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", command], cwd=REPO,
                          env=run_env(LOG_DIR=str(tmp_path / "logs")), capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if not line.startswith("[setup]")]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("megatron_app.train: error: this job needs about 32.0 MiB of shared memory in "
                               "/dev/shm (2 rank(s) on this host") and "only 16.0 MiB is free" in lines[0]
    assert not (tmp_path / "logs").exists()  # torchrun never started
    assert time.monotonic() - start < 120


def test_an_output_path_that_cannot_be_made_is_refused_before_any_rank_starts(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    done = subprocess.run(
        ["bash", str(REPO / "run_single.sh"), "--pipeline_parallel", "2", "--model_chunks", "1", "--iters", "1",
         "--num-layers", "2", "--trace-dir", str(blocker / "traces")], cwd=REPO,
        env=run_env(LOG_DIR=str(tmp_path / "logs")), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (f"megatron_app.train: error: --trace-dir {blocker}/traces: cannot "
                                                    f"create the directory there: {blocker} is not a directory")
    assert "ranks:" not in done.stderr and not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_an_environment_failure_inside_the_ranks_is_one_line_per_rank_and_one_summary(tmp_path):
    # The path is fine when the launcher and the ranks check the flags; it turns into a file while the ranks wait
    # at their start gate (train/start_gate.py), so creating the trace folder fails inside them, past their imports.
    blocker, gate = tmp_path / "a_file", tmp_path / "gate"
    launcher = subprocess.Popen(
        ["bash", str(REPO / "run_single.sh"), "--pipeline_parallel", "2", "--model_chunks", "1", "--iters", "1",
         "--num-layers", "2", "--trace-dir", str(blocker / "traces")], cwd=REPO,
        env=run_env(LOG_DIR=str(tmp_path / "logs"), MEGATRON_APP_START_GATE=str(gate)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    err = ""
    while err.count("waits for its start gate") < 2:
        line = launcher.stderr.readline()
        assert line, err
        err += line
    blocker.write_text("not a directory")
    gate.touch()
    out, rest = launcher.communicate(timeout=300)
    err += rest
    assert launcher.returncode != 0
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    # rank 0 (the one that traces first) says it, and the launcher once, naming its log
    assert last.startswith("run_single.sh: rank 0 on ") and " before the first iteration ended: [Errno 20] Not a " \
        f"directory: '{blocker}/traces/" in last and "; its log: " in last, last
