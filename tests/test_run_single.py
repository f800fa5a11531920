"""run_single.sh end to end: bad configs fail before any rank starts; a P=2 V=2 run feeds both trace tools."""

import json
import re
import subprocess
import sys

import pytest

from pipeline_runs import REPO, run_env


def _run_single(*flags, timeout=300, cwd=REPO, **env):
    return subprocess.run(["bash", str(REPO / "run_single.sh"), *map(str, flags)], cwd=cwd,
                          env=run_env(**env), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, message", [
    (["--pipeline_parallel", "3", "--model_chunks", "2"], "divisible"),
    (["--pipeline_parallel", "4", "--model_chunks", "2", "--global-batch-size", "6", "--micro-batch-size", "2"],
     "microbatch"),
    (["--pipeline_parallel", "2", "--policy", "fastest"], "policy"),
    (["--pipeline_parallel", "two"], "positive integer"),
    (["--pipeline_parallel", "2", "--no-such-flag"], "no-such-flag"),
    (["--pipeline_parallel", "2", "--variable-seq-lengths"], "--variable-seq-lengths needs --data-path"),
    (["--pipeline_parallel", "2", "--composition", "packed"], "--composition needs --variable-seq-lengths"),
    # Megatron-LM's names reach the launcher's layout (4 ranks: T=2 is checked against the heads) and the trainer
    (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
      "--hidden-size", "63", "--train-iters", "2"], "--num-attention-heads 3 is not divisible by tensor_parallel(2)"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "--num-layers 8 is not divisible by pipeline_parallel(2) x 3"),
    (["--pipeline_parallel", "2", "--log-json", "/dev/null/x.json"], "/dev/null is not a directory"),
    (["--pipeline_parallel", "2", "--save", "/dev/null/ckpt"], "/dev/null is not a directory"),
])
def test_bad_config_fails_in_one_line_before_any_rank_starts(flags, message):
    result = _run_single(*flags, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[setup]")]
    assert len(errors) == 1 and message in errors[0].lower(), result.stderr
    assert "Traceback" not in result.stderr
    assert "ranks:" not in result.stderr, "ranks were started for a bad config"


@pytest.mark.slow
def test_run_single_p2_v2_traces_through_process_and_visualize(tmp_path):
    from openpyxl import load_workbook

    traces, out = tmp_path / "traces", tmp_path / "out"
    result = _run_single("--pipeline_parallel", 2, "--model_chunks", 2, "--iters", 2, "--trace-dir", traces,
                         LOG_DIR=tmp_path / "logs")
    assert result.returncode == 0, result.stderr[-3000:]
    iteration_lines = re.findall(r"iter (\d+)/2 \| loss ([0-9.]+) \| ([0-9.]+) ms \| (\d+) tokens/s", result.stdout)
    assert [int(i) for i, *_ in iteration_lines] == [1, 2]
    # This run's traces are in a directory of their own, which traces/latest points at and the log names.
    run_dir = (traces / "latest").resolve()
    assert run_dir.parent == traces.resolve() and sorted(p.name for p in run_dir.iterdir()) == [
        "trace_rank0.jsonl", "trace_rank1.jsonl"]
    assert f"traces: {traces / run_dir.name} ({traces / 'latest'} points there)" in result.stdout

    # One numbering: the log's iter 1/2 and 2/2 are the trace's iterations 1 and 2 (optimizer spans included)
    events = [json.loads(line) for line in (run_dir / "trace_rank0.jsonl").read_text().splitlines()[1:]]
    assert sorted({e["iteration"] for e in events if "iteration" in e}) == [1, 2]
    picked = subprocess.run([sys.executable, str(REPO / "tools" / "process_trace.py"), "--pipeline_parallel", "2",
                             "--model_chunks", "2", "--trace-dir", str(traces), "--out-dir", str(out),
                             "--iteration", "2"], capture_output=True, text=True, timeout=120, env=run_env())
    assert picked.returncode == 0 and "iteration 2" in picked.stdout, picked.stderr

    m = 8
    for tool in ("process_trace.py", "visualize_trace.py"):
        run = subprocess.run([sys.executable, str(REPO / "tools" / tool), "--pipeline_parallel", "2",
                              "--model_chunks", "2", "--trace-dir", str(traces), "--out-dir", str(out), "--strict"]
                             if tool == "process_trace.py" else
                             [sys.executable, str(REPO / "tools" / tool), "--pipeline_parallel", "2",
                              "--model_chunks", "2", "--trace-dir", str(traces), "--out-dir", str(out)],
                             capture_output=True, text=True, timeout=120, env=run_env())
        assert run.returncode == 0, run.stderr
    assert "causality: ok" in subprocess.run(
        [sys.executable, str(REPO / "tools" / "process_trace.py"), "--pipeline_parallel", "2", "--model_chunks", "2",
         "--trace-dir", str(traces), "--out-dir", str(out)], capture_output=True, text=True, env=run_env()).stdout
    sheet = load_workbook(out / "trace_pipeline_2_model_chunks_2.xlsx").active
    label = re.compile(r"^\d+-\d+$")
    for row in (4, 5):   # pipeline ranks 0 and 1, rank 0 on top
        cells = [c.value for c in sheet[row] if isinstance(c.value, str) and label.match(c.value)]
        assert len(cells) == 2 * 2 * m, f"row {row}: {len(cells)} task cells"
    assert (out / "trace_pipeline_2_model_chunks_2.png").stat().st_size > 10_000
