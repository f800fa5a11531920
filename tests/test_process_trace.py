"""tools/process_trace.py end to end: outputs, summary, causality report, and every bad input -> one line, exit 2."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_app.trace import process_trace
from test_trace_synthetic import plan_greedy, write_plan

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "process_trace.py"
STEM = "trace_pipeline_{P}_model_chunks_{V}"




def run_tool(capsys, *argv):
    from megatron_app.trace.cli import run_cli
    try:
        code = run_cli(process_trace.PROG, process_trace.main, [str(a) for a in argv])
    except SystemExit as exit_:  # argparse exits by itself on a bad flag
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def outputs(out_dir: Path, P: int, V: int) -> list[Path]:
    stem = STEM.format(P=P, V=V)
    return [out_dir / f"{stem}.json", out_dir / f"{stem}_metrics.json", out_dir / f"{stem}_metrics.csv"]


@pytest.fixture
def two_iterations(tmp_path):
    """P=2 V=2 m=2, F=10 B=20, two complete iterations."""
    return write_plan(tmp_path / "traces", plan_greedy(2, 2, 2, forward_us=10, backward_us=20, latency_us=2,
                                                      iterations=2))


def test_outputs_and_summary(tmp_path, capsys, two_iterations):
    out = tmp_path / "out"
    code, stdout, err = run_tool(capsys, "--pipeline_parallel", 2, "--model_chunks", 2, "--trace-dir",
                                 two_iterations, "--out-dir", out)
    assert (code, err) == (0, "")
    chrome_path, metrics_path, csv_path = outputs(out, 2, 2)

    chrome = json.loads(chrome_path.read_text())
    tasks = [e for e in chrome["traceEvents"] if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    assert len(tasks) == 2 * (2 * 2 * 2)  # ranks x (F+B) x chunks x microbatches, last iteration only
    assert {e["args"]["iteration"] for e in chrome["traceEvents"] if "args" in e and "iteration" in e["args"]} \
        == {1}
    f01 = [e for e in tasks if e["pid"] == 1 and e["name"] == "F 0-1"]
    assert len(f01) == 1 and f01[0]["args"]["chunk"] == 0 and f01[0]["args"]["microbatch"] == 1
    assert f01[0]["dur"] == 10.0
    assert min(e["ts"] for e in chrome["traceEvents"] if "ts" in e) == 0.0
    names = {e["pid"]: e["args"]["name"] for e in chrome["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "pp 0 (rank 0 synthetic)", 1: "pp 1 (rank 1 synthetic)"}
    begins = [e for e in chrome["traceEvents"] if e["ph"] == "b"]
    ends = [e for e in chrome["traceEvents"] if e["ph"] == "e"]
    assert len(begins) == len(ends) > 0 and {e["id"] for e in begins} == {e["id"] for e in ends}

    metrics = json.loads(metrics_path.read_text())
    (iteration,) = metrics["iterations"]
    assert iteration["iteration"] == 1 and metrics["causality_violations"] == []
    assert iteration["ideal_us"] == 2 * 2 * (10 + 20)
    rows = list(csv.DictReader(csv_path.open()))
    assert [(r["iteration"], r["pp_rank"]) for r in rows] == [("1", "0"), ("1", "1")]
    assert float(rows[0]["makespan_us"]) == iteration["makespan_us"]

    assert iteration["microbatches"] == 2
    assert f"x bound {iteration['makespan_over_lower_bound']:.3f}" in stdout
    assert f"busiest rank's compute {iteration['ideal_us'] / 1e3:.3f} ms" in stdout
    assert "causality: ok" in stdout


def test_each_iteration_is_labelled_with_the_microbatches_it_ran(tmp_path, capsys):
    """A composed run's header keeps the loader's count (12); the iteration ran 4: the tools say 4."""
    trace_dir = write_plan(tmp_path / "traces", plan_greedy(2, 1, 4), microbatches=12)
    code, stdout, err = run_tool(capsys, "--pipeline_parallel", 2, "--model_chunks", 1, "--trace-dir", trace_dir,
                                 "--out-dir", tmp_path)
    assert (code, err) == (0, "")
    assert "iteration 0: 4 microbatches," in stdout and "microbatches=12" not in stdout
    chrome_path, metrics_path, csv_path = outputs(tmp_path, 2, 1)
    metrics = json.loads(metrics_path.read_text())
    assert "microbatches" not in metrics and metrics["iterations"][0]["microbatches"] == 4
    assert json.loads(chrome_path.read_text())["otherData"]["microbatches"] == {"0": 4}
    assert {row["microbatches"] for row in csv.DictReader(csv_path.open())} == {"4"}


def test_all_iterations(tmp_path, capsys, two_iterations):
    code, stdout, _ = run_tool(capsys, "--pipeline_parallel", 2, "--model_chunks", 2, "--trace-dir",
                               two_iterations, "--out-dir", tmp_path, "--iteration", "all")
    assert code == 0
    metrics = json.loads(outputs(tmp_path, 2, 2)[1].read_text())
    assert [it["iteration"] for it in metrics["iterations"]] == [0, 1]
    assert "iteration 0:" in stdout and "iteration 1:" in stdout


def test_causality_violation_reported_and_strict_fails(tmp_path, capsys):
    plan = plan_greedy(3, 1, 3, forward_us=10, backward_us=20)
    consumer = plan.task(0, 2, "forward", 0, 1)
    consumer.start = plan.task(0, 1, "forward", 0, 1).end - 5.0
    trace_dir = write_plan(tmp_path / "traces", plan)
    args = ["--pipeline_parallel", 3, "--model_chunks", 1, "--trace-dir", trace_dir, "--out-dir", tmp_path]
    code, stdout, _ = run_tool(capsys, *args)
    assert code == 0
    assert "causality: 1 violation(s)" in stdout
    assert "rank 2 (pp 2): forward 0-1 started" in stdout
    (violation,) = json.loads(outputs(tmp_path, 3, 1)[1].read_text())["causality_violations"]
    assert violation["task"] == "forward 0-1" and violation["producer_pp_rank"] == 1
    code, _, _ = run_tool(capsys, *args, "--strict")
    assert code == 1


def _drop_rank(d):
    (d / "trace_rank1.jsonl").unlink()


def _truncate(d):
    path = d / "trace_rank1.jsonl"
    path.write_bytes(path.read_bytes()[:-30])


def _corrupt(d):
    path = d / "trace_rank0.jsonl"
    lines = path.read_text().splitlines()
    lines[3] = lines[3][:-5]
    path.write_text("\n".join(lines) + "\n")


def _future_version(d):
    path = d / "trace_rank0.jsonl"
    lines = path.read_text().splitlines()
    lines[0] = json.dumps(json.loads(lines[0]) | {"schema_version": "3.1"})
    path.write_text("\n".join(lines) + "\n")


def _no_complete_iteration(d):
    path = d / "trace_rank1.jsonl"
    path.write_text("\n".join(l for l in path.read_text().splitlines() if '"kind":"backward"' not in l) + "\n")


BAD_INPUTS = {
    "missing rank file": (_drop_rank, [], r"missing trace_rank1\.jsonl: no trace for pipeline rank 1"),
    "truncated": (_truncate, [], r"trace_rank1\.jsonl: line \d+: truncated"),
    "corrupt": (_corrupt, [], r"trace_rank0\.jsonl: line 4: corrupt line"),
    "other shape": (None, ["--pipeline_parallel", "4"], r"trace_rank0\.jsonl: trace is from a run with "
                                                         r"pipeline_parallel=2 \(asked 4\)"),
    "unknown schema": (_future_version, [], r"trace_rank0\.jsonl: schema_version 3\.1 is not supported"),
    "no complete iteration": (_no_complete_iteration, [], r"no complete iteration \(trace_rank1\.jsonl has 0 of 4 "
                                                          r"backward"),
    "iteration not there": (None, ["--iteration", "9"], r"iteration 9 is not in the trace"),
    "bad iteration flag": (None, ["--iteration", "nine"], r"argument --iteration: expected an iteration number"),
    "no trace dir": (lambda d: None, ["--trace-dir", "/nonexistent/traces"], r"trace directory does not exist"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_no_outputs(tmp_path, capsys, two_iterations, case):
    doctor, extra_args, message = BAD_INPUTS[case]
    if doctor is not None:
        doctor(two_iterations)
    args = {"--pipeline_parallel": "2", "--model_chunks": "2", "--trace-dir": str(two_iterations),
            "--out-dir": str(tmp_path / "out")}
    args.update(zip(extra_args[::2], extra_args[1::2]))
    code, _, err = run_tool(capsys, *[x for kv in args.items() for x in kv])
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("process_trace.py: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_seed_usage_run_from_the_directory_holding_the_files(tmp_path, monkeypatch, capsys):
    trace_dir = write_plan(tmp_path / "run", plan_greedy(2, 1, 2))
    monkeypatch.chdir(trace_dir)
    code, stdout, _ = run_tool(capsys, "--pipeline_parallel", 2, "--model_chunks", 1)
    assert code == 0
    assert all(p.exists() for p in outputs(Path("."), 2, 1))


def test_default_trace_dir_is_traces(tmp_path, monkeypatch, capsys):
    write_plan(tmp_path / "traces", plan_greedy(2, 1, 2))
    monkeypatch.chdir(tmp_path)
    code, _, _ = run_tool(capsys, "--pipeline-parallel", 2, "--model-chunks", 1)
    assert code == 0
    assert all(p.exists() for p in outputs(tmp_path / "traces", 2, 1))  # beside the traces, not in the cwd
    assert not list(tmp_path.glob("trace_pipeline_*"))


def test_script_runs_as_a_command(tmp_path):
    """The real command line: from another directory, good input then bad input (no traceback)."""
    trace_dir = write_plan(tmp_path / "traces", plan_greedy(2, 1, 2))
    ok = subprocess.run([sys.executable, str(SCRIPT), "--pipeline_parallel", "2", "--model_chunks", "1",
                         "--trace-dir", str(trace_dir), "--out-dir", str(tmp_path)], capture_output=True, text=True,
                        cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "x bound" in ok.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--pipeline_parallel", "2", "--model_chunks", "3",
                          "--trace-dir", str(trace_dir)], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "model_chunks=1 (asked 3)" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_directory_as_an_argument_and_the_shape_read_from_the_trace(tmp_path, capsys, two_iterations):
    """`process_trace.py DIR`: the run's own P and V name the outputs; a shape given still has to match."""
    code, stdout, err = run_tool(capsys, two_iterations, "--out-dir", tmp_path / "out")
    assert (code, err) == (0, ""), err
    assert stdout.startswith(f"reading {two_iterations}\n") and "pipeline_parallel=2 model_chunks=2" in stdout
    assert all(p.exists() for p in outputs(tmp_path / "out", 2, 2))
    code, _, err = run_tool(capsys, two_iterations, "--model_chunks", 1)
    assert code == 2 and "model_chunks=2 (asked 1)" in err
    code, _, err = run_tool(capsys, two_iterations, "--trace-dir", tmp_path)
    assert code == 2 and err.count("\n") == 1 and "two trace directories" in err


def test_a_directory_of_runs_gives_its_newest_complete_run_whatever_its_shape(tmp_path, capsys):
    write_plan(tmp_path / "traces" / "a", plan_greedy(2, 1, 2))
    code, stdout, err = run_tool(capsys, tmp_path / "traces")
    assert (code, err) == (0, ""), err
    assert "pipeline_parallel=2 model_chunks=1" in stdout
    assert all(p.exists() for p in outputs(tmp_path / "traces" / "a", 2, 1))


def test_the_host_bound_column_reads_device_timed_tasks(tmp_path, capsys, two_iterations):
    """Schema 1.7: rank 0's tasks ended as their host did (the device waited for it: 100%), rank 1's device trailed
    its host by far more than a tenth of each span (0%); a host-timed trace shows '-'."""
    code, stdout, _ = run_tool(capsys, "--trace-dir", two_iterations, "--out-dir", tmp_path / "plain")
    assert code == 0 and re.search(r"^\s+0\s+0\s+\d+\s.*\s-\s", stdout, re.M), stdout
    for path in sorted(Path(two_iterations).glob("trace_rank*.jsonl")):
        lines = path.read_text().splitlines()
        events = [json.loads(line) for line in lines[1:]]
        for event in events:
            if event["kind"] in ("forward", "backward"):
                span = event["end"] - event["start"]
                lag = 0.0 if event["rank"] == 0 else 5.0 * span
                event.setdefault("extra", {}).update(host_us=span, queued_us=lag)
        path.write_text("\n".join([lines[0], *map(json.dumps, events)]) + "\n")
    code, stdout, _ = run_tool(capsys, "--trace-dir", two_iterations, "--out-dir", tmp_path / "device")
    rows = {int(line.split()[0]): line for line in stdout.splitlines() if re.match(r"^\s+[01]\s+[01]\s", line)}
    assert code == 0 and "100.0%" in rows[0] and " 0.0%" in rows[1], stdout


def test_the_peak_memory_column_and_counter_read_memory_events(tmp_path, capsys, two_iterations):
    """Schema 1.8: each rank's `memory` event of the iteration gives its row's peak MiB and a counter in the Chrome
    trace; a trace without them shows '-'."""
    code, stdout, _ = run_tool(capsys, "--trace-dir", two_iterations, "--out-dir", tmp_path / "plain")
    assert code == 0 and re.search(r"^\s+1\s+1\s.*\s-$", stdout, re.M), stdout
    for path in sorted(Path(two_iterations).glob("trace_rank*.jsonl")):
        lines = path.read_text().splitlines()
        events = [json.loads(line) for line in lines[1:]]
        rank, end = events[0]["rank"], max(event["end"] for event in events if event["iteration"] == 1)
        memory = {"rank": rank, "pp_rank": events[0]["pp_rank"], "iteration": 1, "kind": "memory", "start": end,
                  "end": end, "extra": {"peak_mib": 1000.0 + 234 * rank, "measure": "allocated"}}
        path.write_text("\n".join([lines[0], *map(json.dumps, events + [memory])]) + "\n")
    code, stdout, _ = run_tool(capsys, "--trace-dir", two_iterations, "--out-dir", tmp_path / "memory",
                               "--iteration", "1")
    rows = {int(line.split()[0]): line for line in stdout.splitlines() if re.match(r"^\s+[01]\s+[01]\s", line)}
    assert code == 0 and rows[0].endswith(" 1000") and rows[1].endswith(" 1234"), stdout
    chrome = json.loads(outputs(tmp_path / "memory", 2, 2)[0].read_text())
    counters = [e for e in chrome["traceEvents"] if e["ph"] == "C"]
    assert sorted(e["args"]["MiB"] for e in counters) == [1000.0, 1234.0]
    assert {e["name"] for e in counters} == {"peak memory MiB (allocated)"}
