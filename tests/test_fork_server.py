"""tests/pipeline_runs.py forked_ranks() through a pytest worker's fork_ranks server (tests/helpers/fork_ranks.py
--serve): a run gives what a fresh `fork_ranks.py` launcher gives (exit status, both outputs, the rank's environment),
a timeout kills the run's launcher and ranks and raises as subprocess.run does, another environment gets a server of
its own, and a server that does not start leaves the runs to fresh launchers."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

import pipeline_runs
from pipeline_runs import forked_ranks

RANK_SCRIPT = textwrap.dedent("""\
    import os, sys, time
    rank = int(os.environ["RANK"])
    print(f"out {rank} of {os.environ['WORLD_SIZE']} marker={os.environ.get('FORK_SERVER_MARKER')}", flush=True)
    print(f"err {rank}", file=sys.stderr, flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "sleep":
        open(os.path.join(sys.argv[2], f"pid{rank}"), "w").write(str(os.getpid()))
        time.sleep(600)
    if len(sys.argv) > 1 and sys.argv[1] == "fail" and rank == 1:
        sys.exit(7)
    """)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank_script.py"
    path.write_text(RANK_SCRIPT)
    return path


def _fresh(script, *args):
    return subprocess.run([sys.executable, str(pipeline_runs.HELPERS / "fork_ranks.py"), "2", str(script), *args],
                          cwd=pipeline_runs.REPO, env=pipeline_runs.run_env(), capture_output=True, text=True,
                          timeout=120)


def test_a_served_run_gives_what_a_fresh_launcher_gives(script):
    served = forked_ranks(2, [script], timeout=120)
    assert pipeline_runs._ForkServer.current is not None and pipeline_runs._ForkServer.current.ready
    fresh = _fresh(script)
    assert served.returncode == fresh.returncode == 0
    assert sorted(served.stdout.splitlines()) == sorted(fresh.stdout.splitlines()) == [
        "out 0 of 2 marker=None", "out 1 of 2 marker=None"]
    assert sorted(served.stderr.splitlines()) == sorted(fresh.stderr.splitlines()) == ["err 0", "err 1"]


def test_a_failing_rank_stops_the_run_with_its_status(script):
    served = forked_ranks(2, [script, "fail"], timeout=120)
    assert served.returncode == 7
    assert "fork_ranks: rank 1 exited with 7" in served.stderr


def test_a_timeout_kills_the_launcher_and_its_ranks_and_the_server_serves_on(script, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        forked_ranks(2, [script, "sleep", tmp_path], timeout=8)
    assert "out 0 of 2" in expired.value.output
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)
    assert forked_ranks(2, [script], timeout=120).returncode == 0


def test_another_environment_gets_a_server_of_its_own(script):
    forked_ranks(2, [script], timeout=120)
    first = pipeline_runs._ForkServer.current
    marked = forked_ranks(2, [script], timeout=120, FORK_SERVER_MARKER="yes")
    assert "out 0 of 2 marker=yes" in marked.stdout
    assert pipeline_runs._ForkServer.current is not first and first.process.poll() is not None


def test_a_server_that_does_not_start_leaves_fresh_launchers_to_run(script, monkeypatch):
    """Not ready in time (here: no time at all): the run goes to a fresh launcher, and later runs in the same
    environment do not try to start a server again."""
    monkeypatch.setattr(pipeline_runs._ForkServer, "START_TIMEOUT_S", 0)
    result = forked_ranks(2, [script], timeout=120, FORK_SERVER_MARKER="slow")
    failed = pipeline_runs._ForkServer.current
    assert result.returncode == 0 and "out 1 of 2 marker=slow" in result.stdout
    assert not failed.ready and failed.process.poll() is not None
    assert forked_ranks(2, [script], timeout=120, FORK_SERVER_MARKER="slow").returncode == 0
    assert pipeline_runs._ForkServer.current is failed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:   # a zombie is gone for this purpose
        return stat.read().split(")")[-1].split()[0] != "Z"
