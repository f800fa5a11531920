"""One directory per run under the trace root, a `latest` pointer, and tools that read the newest complete run of
the asked shape and say which: a P=2 run after a P=4 run in the same root no longer trips over the P=4 files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_app.trace import read_trace_dir
from megatron_app.trace.runs import LATEST, choose_run, new_run_name, point_latest
from megatron_app.trace.schema import TraceError
from test_trace_synthetic import plan_greedy, write_plan

REPO = Path(__file__).resolve().parent.parent
PROCESS = REPO / "tools" / "process_trace.py"
VISUALIZE = REPO / "tools" / "visualize_trace.py"


def write_run(root: Path, started: float, P: int, V: int, m: int = 4, run_id: str = "job") -> Path:
    """A run as the trainer leaves it: root/<start time>_<run id>/trace_rank*.jsonl, root/latest pointing at it."""
    name = new_run_name(run_id, now=started)
    write_plan(root / name, plan_greedy(P, V, m), run_id=run_id)
    point_latest(root, name)
    return root / name


def unfinish(run_dir: Path, rank: int) -> None:
    """What a rank killed mid-run leaves: its file without the tracer's closing line."""
    path = run_dir / f"trace_rank{rank}.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["kind"] == "closed"
    path.write_text("".join(lines[:-1]))


def tool(script: Path, cwd: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *flags], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_run_names_sort_by_start_time_and_latest_is_replaced(tmp_path):
    older, newer = new_run_name("single1x2", now=1_700_000_000), new_run_name("a/b c", now=1_700_000_061)
    assert older == "20231114-221320_single1x2" and newer == "20231114-221421_a-b-c" and older < newer
    (tmp_path / older).mkdir()
    (tmp_path / newer).mkdir()
    point_latest(tmp_path, older)
    point_latest(tmp_path, newer)
    assert (tmp_path / LATEST).resolve() == (tmp_path / newer).resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([older, newer, LATEST])  # no temporary link left


def test_a_p2_run_after_a_p4_run_is_read_and_named(tmp_path):
    root = tmp_path / "traces"
    p4 = write_run(root, 1_700_000_000, P=4, V=2, m=8, run_id="first")
    p2 = write_run(root, 1_700_000_100, P=2, V=2, run_id="second")
    done = tool(PROCESS, tmp_path, "--pipeline_parallel", "2", "--model_chunks", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"reading traces/{p2.name} (latest run, run id second)"
    assert (p2 / "trace_pipeline_2_model_chunks_2.json").exists()  # outputs beside the traces they came from
    assert not list(tmp_path.glob("trace_pipeline_*")) and not list(p4.glob("trace_pipeline_*"))
    # Asking for the older shape reads the older run, and says why it is not the latest one.
    done = tool(VISUALIZE, tmp_path, "--pipeline_parallel", "4", "--model_chunks", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        f"reading traces/{p4.name} (newest complete pipeline_parallel=4, model_chunks=2 run, run id first); skipped the latest "
        f"run {p2.name}: it is a pipeline_parallel=2, model_chunks=2 run")
    assert (p4 / "trace_pipeline_4_model_chunks_2.xlsx").exists()


def test_an_unfinished_latest_run_is_skipped_for_the_newest_complete_one(tmp_path):
    root = tmp_path / "traces"
    finished = write_run(root, 1_700_000_000, P=2, V=1, run_id="finished")
    died = write_run(root, 1_700_000_100, P=2, V=1, run_id="died")
    unfinish(died, rank=1)
    chosen = choose_run(root, 2, 1)
    assert chosen.directory == finished
    assert chosen.note.endswith(f"skipped the latest run {died.name}: rank(s) 1 did not finish (still running, "
                                "or the run failed)")
    (died / "trace_rank0.jsonl").unlink()
    assert "1 of 2 rank files" in choose_run(root, 2, 1).note
    # --out-dir still wins over "beside the traces".
    done = tool(PROCESS, tmp_path, "--pipeline_parallel", "2", "--model_chunks", "1", "--out-dir", str(tmp_path / "o"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "o" / "trace_pipeline_2_model_chunks_1.json").exists()


def test_no_complete_run_is_one_line_naming_the_latest(tmp_path):
    root = tmp_path / "traces"
    died = write_run(root, 1_700_000_000, P=2, V=1)
    unfinish(died, rank=0)
    done = tool(PROCESS, tmp_path, "--pipeline_parallel", "2", "--model_chunks", "1")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert (f"no complete pipeline_parallel=2, model_chunks=1 run (the latest run {died.name}: rank(s) 0 did not "
            "finish") in done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="no trace files and no run directories"):
        choose_run(empty, 2, 1)


def test_a_directory_of_trace_files_is_read_as_one_run(tmp_path):
    """The simulator's --trace-dir and a run directory given directly: read as they are."""
    plain = write_plan(tmp_path / "sim", plan_greedy(2, 1, 2))
    assert choose_run(plain, 2, 1).directory == plain


def test_the_reader_follows_latest_under_a_root(tmp_path):
    """Scripts that call read_trace_dir(root) directly get the latest run."""
    run_dir = write_run(tmp_path / "traces", 1_700_000_000, P=2, V=1)
    assert read_trace_dir(tmp_path / "traces", 2, 1).trace_dir == tmp_path / "traces" / LATEST
    assert read_trace_dir(run_dir, 2, 1).pipeline_parallel == 2
