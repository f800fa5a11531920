"""The import contracts in .importlinter (layers point down, pure schedule/trace, no cycles, nothing imports tools/)
hold, and they are not vacuous: each breaks when a forbidden import is planted in a copy of the package."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: import-linter is pinned in requirements.txt (run tools/run_tests.sh)")
    return subprocess.run([str(LINT_IMPORTS), "--config", str(REPO / ".importlinter"), "--no-cache", "--no-logo"],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_the_package_keeps_its_import_contracts():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, planted, broken", [
    ("runtime/session.py", "from megatron_app.lossy import pipeline", "Layers point down"),
    ("schedule/policies.py", "from megatron_app.schedule import adaptive", None),   # fine: adaptive is below
    ("lossy/errors.py", "from megatron_app.lossy import plugin", "No import cycles"),
    ("schedule/tasks.py", "import torch", "schedule and trace import neither torch nor megatron"),
    ("trace/schema.py", "from megatron.core import parallel_state", "schedule and trace import neither"),
    ("sim/engine.py", "import tools.bench_schedule", "Nothing in the package imports tools/"),
    ("transport/tags.py", "from megatron_app.sim import network", "Layers point down"),
])
def test_a_planted_import_breaks_the_right_contract(tmp_path, module, planted, broken):
    copy = tmp_path / "megatron_app"
    shutil.copytree(REPO / "megatron_app", copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{planted}\n")
    result = lint_imports(tmp_path)
    if broken is None:
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        assert result.returncode != 0, result.stdout
        assert f"{broken}" in result.stdout.split("Broken contracts")[-1], result.stdout
