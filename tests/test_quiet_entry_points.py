"""Our entry points print no third-party warnings, and the trace tools load neither torch nor megatron."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline_runs import REPO, run_env
from test_trace_synthetic import plan_greedy, write_plan

HEAVY = ("torch", "megatron")


@pytest.mark.parametrize("tool", ["process_trace.py", "visualize_trace.py"])
def test_trace_tools_import_neither_torch_nor_megatron(tool, tmp_path):
    traces = write_plan(tmp_path / "traces", plan_greedy(2, 1, 2))
    code = (
        "import importlib, sys\n"
        f"module = importlib.import_module('megatron_app.trace.{tool.removesuffix('.py')}')\n"
        "from megatron_app.trace.cli import run_cli\n"
        f"code = run_cli(module.PROG, module.main, ['--pipeline_parallel', '2', '--model_chunks', '1', "
        f"'--trace-dir', {str(traces)!r}])\n"
        f"print(code, sorted({{name.split('.')[0] for name in sys.modules}} & set({HEAVY!r})))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=run_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 []"


@pytest.mark.parametrize("argv", [
    ["-m", "megatron_app.train", "--pipeline_parallel", "2", "--model_chunks", "2", "--check-config"],
    ["-m", "megatron_app.train", "--help"],
    ["-m", "megatron_app.sim", "--pipeline_parallel", "2", "--model_chunks", "2", "--microbatches", "4",
     "--policy", "all"],
])
def test_entry_points_print_no_third_party_warnings(argv):
    done = subprocess.run([sys.executable, "-W", "default", *argv], cwd=REPO, env=run_env(WORLD_SIZE="2"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "warnings.warn" not in done.stderr, done.stderr


def test_corpus_tools_print_no_third_party_warnings(tmp_path):
    corpus = tmp_path / "corpus"
    runs = [["tools/make_corpus.py", "--output-dir", str(corpus), "--sources", "licenses"],
            ["tools/preprocess_data.py", "--input", str(corpus / "corpus.jsonl"), "--output-prefix", str(tmp_path / "pp"),
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-json", str(corpus / "tokenizer.json"),
             "--append-eod", "--workers", "2"]]
    for argv in runs:
        done = subprocess.run([sys.executable, "-W", "default", *argv], cwd=REPO, env=run_env(), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "Warning" not in done.stderr and "warnings.warn" not in done.stderr, done.stderr


def test_the_loss_layers_dtype_table_does_not_warn_about_complex_half():
    # torch warns once per process when a complex32 tensor is made; the table sizes every wire dtype
    code = "from megatron_app.lossy.tensors import element_table; print(len(element_table()))"
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ComplexHalf" not in done.stderr, done.stderr
