"""train/fast_exit.py: the package's commands freeze the interpreter's objects at exit, so finalizing skips the
garbage collections over torch's and megatron-core's objects (about 1 s of every launch's two exits here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), WORLD_SIZE="1")).stdout


def test_it_is_registered_once_and_freezes_at_exit():
    code = ("import atexit, gc\nfrom unittest import mock\n"
            "from megatron_app.train.fast_exit import skip_final_collections_at_exit as skip\n"
            "with mock.patch.object(atexit, 'register') as register:\n    skip(); skip()\n"
            "assert register.call_args_list == [mock.call(gc.freeze)], register.call_args_list\n"
            "skip()\nprint('ok')\n")
    assert _run(code).strip() == "ok"


def test_the_trainers_command_registers_it_before_anything_else_of_its_own():
    """--check-config (a launch's first process) and the ranks go through the same main()."""
    code = ("import atexit, gc\nfrom megatron_app.train.__main__ import main\n"
            "main(['--pipeline_parallel', '1', '--num-layers', '2', '--check-config'])\n"
            "before = gc.get_freeze_count()\natexit._run_exitfuncs()\n"
            "print(before, gc.get_freeze_count() > 0)\n")
    lines = _run(code).splitlines()
    assert lines[0].startswith("megatron_app.train: config ok") and lines[-1] == "0 True"


def test_the_exit_bench_times_both_variants(tmp_path):
    out = tmp_path / "exit.json"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "bench_exit.py"), "--repeats", "1", "--json",
                             str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seconds = json.loads(out.read_text())["seconds"]
    assert set(seconds) == {"frozen", "default"} and all(len(v) == 1 and v[0] > 0 for v in seconds.values())
    assert "frozen / default:" in result.stdout
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "bench_exit.py"), "--repeats", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--repeats must be at least 1" in bad.stderr
