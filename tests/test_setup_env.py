"""tools/setup_venv.sh (the part of setup_env.sh that makes .venv and decides about torch) on a GPU image's layout:
the python3 that runs it is itself a venv's, and that venv's site-packages hold torch. .venv must import that torch,
say so in one line, and never ask pip for another; with no torch anywhere and no registry, one clear line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BASE_PYTHON = getattr(sys, "_base_executable", None) or shutil.which("python3")


def _python_sees_torch(python) -> bool:
    return subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') "
                                         "is None)"], capture_output=True).returncode == 0


def _offline_env(tmp_path) -> dict:
    """No registry and no wheels (pip's own settings only: a pip install of anything fails at once), pip's config
    files ignored, and every pip command that runs logged to pip.log."""
    (tmp_path / "no-wheels").mkdir(exist_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "no-wheels"), PIP_CONFIG_FILE=os.devnull,
               PIP_LOG=str(tmp_path / "pip.log"))
    return env


def _setup_venv(checkout: Path, python: Path | str, env: dict) -> subprocess.CompletedProcess:
    script = f"source {REPO}/tools/setup_venv.sh && make_venv && ensure_torch"
    return subprocess.run(["bash", "-c", f"set -euo pipefail; {script}"], capture_output=True, text=True,
                          timeout=300, env={**env, "repo_root": str(checkout), "PYTHON": str(python)})


def _pip_commands(tmp_path) -> str:
    log = tmp_path / "pip.log"
    return log.read_text() if log.exists() else ""


@pytest.mark.skipif(BASE_PYTHON is None, reason="no base python3 to make a venv with")
def test_an_outer_venvs_torch_is_reused_and_no_torch_is_installed(tmp_path):
    if _python_sees_torch(BASE_PYTHON):
        pytest.skip(f"{BASE_PYTHON} itself sees a torch: the outer venv's would not be the only one")
    outer = tmp_path / "image-venv"
    subprocess.run([BASE_PYTHON, "-m", "venv", "--system-site-packages", "--without-pip", str(outer)], check=True)
    outer_site = Path(subprocess.run([outer / "bin" / "python", "-c", "import sysconfig; "
                                      "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                                     check=True).stdout.strip())
    (outer_site / "torch").mkdir(parents=True)
    (outer_site / "torch" / "__init__.py").write_text('__version__ = "2.11.0+cu130.outer"\n')
    checkout = tmp_path / "checkout"
    checkout.mkdir()

    done = _setup_venv(checkout, outer / "bin" / "python", _offline_env(tmp_path))
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "is a venv's" in line]
    assert said == [f"[setup] {outer}/bin/python is a venv's ({outer}): .venv sees its site-packages too "
                    f"(its torch: {outer_site / 'torch'})"], done.stderr
    assert "installing" not in done.stderr and "torch==" not in _pip_commands(tmp_path), done.stderr
    seen = subprocess.run([checkout / ".venv" / "bin" / "python", "-c", "import sys, torch; "
                           "print(torch.__version__, torch.__file__, sys.prefix, sep='|')"], capture_output=True,
                          text=True, check=True).stdout.strip().split("|")
    assert seen == ["2.11.0+cu130.outer", str(outer_site / "torch" / "__init__.py"), str(checkout / ".venv")]
    # .venv is its own environment: pip installs there, not into the outer venv
    assert subprocess.run([checkout / ".venv" / "bin" / "python", "-m", "pip", "--version"], capture_output=True,
                          text=True, check=True).stdout.split(" from ")[1].startswith(str(checkout / ".venv"))

    # a second run leaves .venv as it is and still asks pip for nothing
    again = _setup_venv(checkout, outer / "bin" / "python", _offline_env(tmp_path))
    assert again.returncode == 0 and again.stderr == "", again.stderr


@pytest.mark.skipif(BASE_PYTHON is None, reason="no base python3 to make a venv with")
def test_no_torch_anywhere_and_no_registry_is_one_clear_line(tmp_path):
    if _python_sees_torch(BASE_PYTHON):
        pytest.skip(f"{BASE_PYTHON} sees a torch: nothing would be installed")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    done = _setup_venv(checkout, BASE_PYTHON, _offline_env(tmp_path))
    assert done.returncode == 1
    assert "is a venv's" not in done.stderr     # a base interpreter: no outer venv to link
    assert "[setup] no importable torch: installing torch==2.13.0" in done.stderr
    assert done.stderr.splitlines()[-1] == ("setup: torch==2.13.0 did not install (offline? PIP_NO_INDEX=1 "
                                            "PIP_FIND_LINKS=<a folder with its wheel>)"), done.stderr
    assert "torch==2.13.0" in _pip_commands(tmp_path)   # pip ran, under the environment's settings


@pytest.mark.skipif(BASE_PYTHON is None, reason="no base python3 to make a venv with")
def test_a_torch_that_is_there_but_does_not_import_is_not_installed_over(tmp_path):
    if _python_sees_torch(BASE_PYTHON):
        pytest.skip(f"{BASE_PYTHON} itself sees a torch")
    outer = tmp_path / "image-venv"
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", str(outer)], check=True)
    outer_site = Path(subprocess.run([outer / "bin" / "python", "-c", "import sysconfig; "
                                      "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                                     check=True).stdout.strip())
    (outer_site / "torch").mkdir(parents=True)
    (outer_site / "torch" / "__init__.py").write_text('raise OSError("libcudart.so.13: cannot open shared object")\n')
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    done = _setup_venv(checkout, outer / "bin" / "python", _offline_env(tmp_path))
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == ("setup: torch is installed but does not import: OSError: libcudart.so.13: "
                                            "cannot open shared object"), done.stderr
    assert "torch==" not in _pip_commands(tmp_path)


@pytest.mark.skipif(BASE_PYTHON is None, reason="no base python3 to make a venv with")
def test_a_broken_torch_inside_venv_is_installed_again(tmp_path):
    if _python_sees_torch(BASE_PYTHON):
        pytest.skip(f"{BASE_PYTHON} itself sees a torch")
    checkout = tmp_path / "checkout"
    venv = checkout / ".venv"
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("import torch._C  # an install that was interrupted\n")
    done = _setup_venv(checkout, BASE_PYTHON, _offline_env(tmp_path))
    assert done.returncode == 1    # this .venv has no pip (nor a wheel): the attempt fails, with the line
    assert ("[setup] torch in .venv does not import (ModuleNotFoundError: No module named 'torch._C'): installing "
            "torch==2.13.0 again") in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith("setup: torch==2.13.0 did not install (offline?")
