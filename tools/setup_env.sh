#!/usr/bin/env bash
# Sourced by run_tests.sh and the run_*.sh launchers: make .venv, install pinned deps, build the extension.
# Exports VENV_PY. Each step is skipped when its stamp says the inputs have not changed.
set -euo pipefail

repo_root=${repo_root:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
venv="$repo_root/.venv"
TORCH_PIN="torch==2.13.0"

log() { echo "[setup] $*" >&2; }
die() { echo "setup: $*" >&2; exit 1; }

base_py=${PYTHON:-python3}
command -v "$base_py" >/dev/null || die "python3 not found (need Python >= 3.10)"
"$base_py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "Python >= 3.10 required, found $("$base_py" -V 2>&1)"

if [ ! -x "$venv/bin/python" ]; then
    log "creating .venv (with system site packages, so an installed torch is reused)"
    "$base_py" -m venv --system-site-packages "$venv" || die "could not create $venv (is python3-venv installed?)"
fi
VENV_PY="$venv/bin/python"
export VENV_PY

file_hash() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }
pip_quiet() { "$VENV_PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -E '^WARNING: Location' || true; }

deps_stamp="$venv/.deps-$(file_hash "$repo_root/requirements.txt")"
if [ ! -f "$deps_stamp" ]; then
    if ! "$VENV_PY" -c 'import torch' 2>/dev/null; then
        log "no importable torch: installing $TORCH_PIN"
        pip_quiet "$TORCH_PIN"
    fi
    log "installing pinned dependencies (requirements.txt)"
    pip_quiet -r "$repo_root/requirements.txt"
    "$VENV_PY" -W ignore::UserWarning -c 'import torch, megatron.core, pybind11, pytest, openpyxl, matplotlib, hypothesis' \
        || die "dependencies did not install; see pip's output above"
    rm -f "$venv"/.deps-*
    touch "$deps_stamp"
fi

# Rebuild the extension whenever its sources, its build script or what the build probes change (rdma-core installed
# after a first build, another compiler or torch): the stamp file holds that description.
build_description=$(repo_root="$repo_root" VENV_PY="$VENV_PY" bash "$repo_root/tools/build_stamp.sh") \
    || die "could not describe the build (tools/build_stamp.sh failed)"
build_stamp="$venv/.build-$(echo "$build_description" | sha256sum | cut -c1-16)"
if [ ! -f "$build_stamp" ] || ! "$VENV_PY" -c 'import megatron_app.transport._shm_tensor_rdma' 2>/dev/null; then
    previous=$(ls "$venv"/.build-* 2>/dev/null | head -n1 || true)
    changed=$( [ -s "$previous" ] && diff <(cat "$previous") <(echo "$build_description") | sed -n 's/^> //p' \
        | grep -v '^sources:' | paste -sd ';' - || true)
    log "building the extension (csrc/shm_tensor_rdma)${changed:+; changed since the last build: $changed}"
    (cd "$repo_root" && "$VENV_PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . 2>&1 \
        | grep -v -E '^WARNING: Location' ) || true
    "$VENV_PY" -c 'import megatron_app.transport._shm_tensor_rdma' || die "the extension did not build; see the compiler output above"
    rm -f "$venv"/.build-*
    echo "$build_description" > "$build_stamp"
fi
