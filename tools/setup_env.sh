#!/usr/bin/env bash
# Sourced by run_tests.sh and the run_*.sh launchers: make .venv, install pinned deps, build the extension.
# Exports VENV_PY. Each step is skipped when its stamp says the inputs have not changed. .venv and torch:
# tools/setup_venv.sh. pip runs with no index options of its own, so PIP_NO_INDEX / PIP_FIND_LINKS hold.
set -euo pipefail

repo_root=${repo_root:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=tools/setup_venv.sh
source "$repo_root/tools/setup_venv.sh"   # base_py, venv, log, die, make_venv, ensure_torch
make_venv
VENV_PY="$venv/bin/python"
export VENV_PY

file_hash() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }
pip_quiet() { "$VENV_PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -E '^WARNING: Location' || true; }

deps_stamp="$venv/.deps-$(file_hash "$repo_root/requirements.txt")"
if [ ! -f "$deps_stamp" ]; then
    ensure_torch
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
# The module loads from its file (tools/transport_core.py): through its package it would import torch, every launch.
if [ ! -f "$build_stamp" ] || ! MEGATRON_APP_CORE= "$VENV_PY" "$repo_root/tools/transport_core.py" --check 2>/dev/null; then
    previous=$(ls "$venv"/.build-* 2>/dev/null | head -n1 || true)
    changed=$( [ -s "$previous" ] && diff <(cat "$previous") <(echo "$build_description") | sed -n 's/^> //p' \
        | grep -v '^sources:' | paste -sd ';' - || true)
    log "building the extension (csrc/shm_tensor_rdma)${changed:+; changed since the last build: $changed}"
    (cd "$repo_root" && "$VENV_PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . 2>&1 \
        | grep -v -E '^WARNING: Location' ) || true
    MEGATRON_APP_CORE= "$VENV_PY" "$repo_root/tools/transport_core.py" --check \
        || die "the extension did not build; see the compiler output above"
    rm -f "$venv"/.build-*
    echo "$build_description" > "$build_stamp"
fi
