#!/usr/bin/env bash
# Sourced by run_tests.sh after setup_env.sh: a second environment, .venv-megatron-latest, that is .venv with the
# newest supported megatron-core (the top of megatron_compat.SUPPORTED_RANGE) in front of .venv's 0.16.1.
# 0.19 declares Requires-Python >= 3.12, but its wheel runs on 3.11 once triton is importable, so on an interpreter
# older than 3.12 it is installed with --ignore-requires-python --no-deps (its only dependencies, torch, numpy and
# packaging, come from .venv). Exports LATEST_VENV_PY. Skipped when its stamp says nothing changed.
set -euo pipefail

LATEST_MEGATRON_PIN="megatron-core==0.19.2"
TRITON_PIN="triton==3.9.0"
latest_venv="$repo_root/.venv-megatron-latest"
LATEST_VENV_PY="$latest_venv/bin/python"
export LATEST_VENV_PY

# .venv's own packages are reached through a .pth file, so only these two pins decide whether to rebuild.
latest_stamp="$latest_venv/.deps-$(echo "$LATEST_MEGATRON_PIN $TRITON_PIN" | sha256sum | cut -c1-16)"
if [ ! -f "$latest_stamp" ]; then
    log "making .venv-megatron-latest: .venv plus $LATEST_MEGATRON_PIN and $TRITON_PIN"
    rm -rf "$latest_venv"
    "$base_py" -m venv --system-site-packages "$latest_venv" || die "could not create $latest_venv"
    base_site=$("$VENV_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    latest_site=$("$LATEST_VENV_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # .venv's packages (torch, pytest, megatron_app's editable install, ...) come after this venv's own, so the
    # newer megatron-core here shadows .venv's. addsitedir also runs .venv's .pth files.
    echo "import site; site.addsitedir('$base_site')" > "$latest_site/zz_megatron_app_base_venv.pth"
    "$LATEST_VENV_PY" -m pip install -q --disable-pip-version-check --ignore-requires-python --no-deps \
        "$LATEST_MEGATRON_PIN" "$TRITON_PIN" 2>&1 | grep -v -E '^WARNING: Location' || true
    "$LATEST_VENV_PY" -W ignore -c '
import sys
from megatron_app.megatron_compat import megatron_core_version
want = sys.argv[1].split("==")[1]
got = megatron_core_version().base_version
sys.exit(0 if got == want else f"expected megatron-core {want}, got {got}")' "$LATEST_MEGATRON_PIN" 2>/dev/null \
        || die "$LATEST_MEGATRON_PIN did not install into $latest_venv; see pip's output above"
    touch "$latest_stamp"
fi
