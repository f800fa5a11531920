"""train/gc_phases.py: the package's commands pause the garbage collector while they import torch and
megatron-core, resume it (objects frozen) before the model is built, and freeze everything at exit, so finalizing
skips its collections."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), WORLD_SIZE="1")).stdout


def test_pause_resume_and_the_freeze_at_exit_registered_once():
    code = ("import atexit, gc\nfrom unittest import mock\n"
            "from megatron_app.train import gc_phases\n"
            "with mock.patch.object(atexit, 'register') as register:\n"
            "    gc_phases.pause_collections_while_importing(); gc_phases.pause_collections_while_importing()\n"
            "assert register.call_args_list == [mock.call(gc.freeze)], register.call_args_list\n"
            "assert not gc.isenabled() and gc.get_freeze_count() == 0\n"
            "gc_phases.resume_collections()\n"
            "assert gc.isenabled() and gc.get_freeze_count() > 0\n"
            "print('ok')\n")
    assert _run(code).strip() == "ok"


def test_resume_leaves_a_collector_it_did_not_pause_alone():
    """An in-process caller (a test, a user's script) that never paused keeps its collector as it was."""
    code = ("import gc\nfrom megatron_app.train import gc_phases\n"
            "gc_phases.resume_collections()\nassert gc.isenabled() and gc.get_freeze_count() == 0\n"
            "gc.disable(); gc_phases.resume_collections(); assert not gc.isenabled()\nprint('ok')\n")
    assert _run(code).strip() == "ok"


def test_the_trainers_command_pauses_first_and_freezes_at_exit():
    """`python -m megatron_app.train` (a launch's --check-config and its ranks) pauses before parsing its flags
    (which imports torch); a caller of main() in its own process keeps its collector."""
    code = ("import atexit, gc, runpy, sys\n"
            "sys.argv = ['megatron_app.train', '--pipeline_parallel', '1', '--num-layers', '2', '--check-config']\n"
            "runpy.run_module('megatron_app.train', run_name='__main__', alter_sys=True)\n"
            "paused = not gc.isenabled()\nbefore = gc.get_freeze_count()\natexit._run_exitfuncs()\n"
            "print(paused, before, gc.get_freeze_count() > 0)\n")
    lines = _run(code).splitlines()
    assert lines[0].startswith("megatron_app.train: config ok") and lines[-1] == "True 0 True"
    in_process = ("import gc\nfrom megatron_app.train.__main__ import main\n"
                  "main(['--pipeline_parallel', '1', '--num-layers', '2', '--check-config'])\n"
                  "print(gc.isenabled(), gc.get_freeze_count())\n")
    assert _run(in_process).splitlines()[-1] == "True 0"


def test_the_bench_times_both_variants(tmp_path):
    out = tmp_path / "gc.json"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "bench_gc_phases.py"), "--repeats", "1", "--json",
                             str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seconds = json.loads(out.read_text())["seconds"]
    assert set(seconds) == {"gc_phases", "default"}
    assert all(len(values) == 1 and values[0] > 0 for phases in seconds.values() for values in phases.values())
    assert "gc_phases / default: imports" in result.stdout
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "bench_gc_phases.py"), "--repeats", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--repeats must be at least 1" in bad.stderr
