"""The extension is rebuilt when what its build probed changes, not only its sources: a fresh checkout built without
rdma-core, then rdma-core installed (here: a verbs header put on the compiler's path), must build again."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_checkout(tmp_path):
    """What a clone of this tree holds: tracked and not-ignored files only (no .venv, no build)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    root = tmp_path / "checkout"
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    return root


def fake_verbs_header(tmp_path) -> Path:
    include = tmp_path / "include"
    (include / "infiniband").mkdir(parents=True)
    (include / "infiniband" / "verbs.h").write_text("/* stands in for rdma-core's header */\n")
    return include


def compiler_on_a_machine_without_rdma_core(tmp_path) -> tuple[Path, Path]:
    """A C compiler that sees no rdma-core until the returned marker file exists, whatever this host has installed:
    the probe `#include <infiniband/verbs.h>` fails and libibverbs.so is not found. Everything else goes to cc."""
    marker = tmp_path / "rdma-core-installed"
    compiler = tmp_path / "cc-without-rdma"
    compiler.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ ! -e "{marker}" ]; then\n'
        '    case "$*" in *-print-file-name=libibverbs*) echo libibverbs.so; exit 0;; esac\n'
        '    if [ "$1" = -E ]; then input=$(cat); case "$input" in *infiniband/verbs.h*) exit 1;; esac\n'
        '        printf %s "$input" | exec cc "$@"; fi\n'
        "fi\n"
        'exec cc "$@"\n')
    compiler.chmod(0o755)
    return compiler, marker


def describe(root: Path, **env) -> dict:
    done = subprocess.run(["bash", "tools/build_stamp.sh"], cwd=root, capture_output=True, text=True, check=True,
                          env={**os.environ, "VENV_PY": sys.executable, **env})
    return dict(line.split(": ", 1) if ": " in line else (line.rstrip(":"), "") for line in done.stdout.splitlines())


def test_build_description_names_what_the_build_probed(fresh_checkout, tmp_path):
    import torch

    plain = describe(fresh_checkout, CPATH="")
    assert plain["torch"] == torch.__version__
    assert plain["verbs header"] == ("present" if Path("/usr/include/infiniband/verbs.h").exists() else "absent")
    assert plain["compiler"].split()[0] and plain["python"] == sys.version.split()[0]
    header_directory = fake_verbs_header(tmp_path)
    with_header = describe(fresh_checkout, CPATH=str(header_directory))
    assert with_header["verbs header"] == "present"
    assert {key for key in plain if plain[key] != with_header[key]} <= {"verbs header"}
    compiler, rdma_core_installed = compiler_on_a_machine_without_rdma_core(tmp_path)
    without = describe(fresh_checkout, CPATH="", CC=str(compiler))
    assert (without["verbs header"], without["verbs library"]) == ("absent", "absent")
    rdma_core_installed.touch()
    assert describe(fresh_checkout, CPATH=str(header_directory), CC=str(compiler))["verbs header"] == "present"


def test_setup_rebuilds_a_fresh_checkout_once_rdma_core_appears(fresh_checkout, tmp_path):
    """setup_env.sh's decision, with pip stubbed: the real build is the same either way and takes minutes."""
    builds = tmp_path / "builds.log"
    venv_bin = fresh_checkout / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    # The checkout's python: this interpreter; `pip install -e .` only logs, and puts this tree's built module
    # where an in-place build would (the checkout's own megatron_app is the one imported).
    (venv_bin / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1 $2 $3" = "-m pip install" ]; then echo build >> "{builds}"; '
        f'cp "{REPO}"/megatron_app/transport/_shm_tensor_rdma*.so "{fresh_checkout}/megatron_app/transport/"; '
        'exit 0; fi\n'
        f'PYTHONPATH="{REPO}" exec "{sys.executable}" "$@"\n')
    (venv_bin / "python").chmod(0o755)
    requirements_hash = subprocess.run("cat requirements.txt | sha256sum | cut -c1-16", shell=True,
                                       cwd=fresh_checkout, capture_output=True, text=True, check=True).stdout.strip()
    (fresh_checkout / ".venv" / f".deps-{requirements_hash}").touch()

    compiler, rdma_core_installed = compiler_on_a_machine_without_rdma_core(tmp_path)

    def setup(**env):
        done = subprocess.run(["bash", "-c", "source tools/setup_env.sh"], cwd=fresh_checkout, capture_output=True,
                              text=True, env={**os.environ, "CPATH": "", "CC": str(compiler), **env}, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stderr, builds.read_text().count("build") if builds.exists() else 0

    log, count = setup()
    assert count == 1, log  # the first set-up builds, without verbs
    assert setup()[1] == 1  # nothing changed: no build
    rdma_core_installed.touch()  # `apt-get install libibverbs-dev`, as it were (the header also put on the path,
    log, count = setup(CPATH=str(fake_verbs_header(tmp_path)))  # for hosts that have none)
    assert count == 2, log
    assert "changed since the last build: verbs header: present" in log
    stamps = list((fresh_checkout / ".venv").glob(".build-*"))
    assert len(stamps) == 1 and "verbs header: present" in stamps[0].read_text()
