#!/usr/bin/env bash
# Builds the transport module with gcc's sanitizers into build/sanitize-<kinds>/, apart from .venv's normal build,
# and prints the module's path. Rebuilt only when tools/build_stamp.sh's description or the kinds change.
#   MAPP_SANITIZE=address,undefined VENV_PY=.venv/bin/python bash tools/build_sanitized.sh
# Use: MEGATRON_APP_CORE=<printed path> LD_PRELOAD=$(gcc -print-file-name=libasan.so) python -m pytest ...
set -euo pipefail

repo_root=${repo_root:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
py=${VENV_PY:-$repo_root/.venv/bin/python}
kinds=${MAPP_SANITIZE:?set MAPP_SANITIZE, e.g. address,undefined}
out="$repo_root/build/sanitize-${kinds//,/-}"
stamp="$out/.build-$( (repo_root="$repo_root" VENV_PY="$py" bash "$repo_root/tools/build_stamp.sh"; echo "$kinds") \
    | sha256sum | cut -c1-16)"
module() { find "$out/lib" -name '_shm_tensor_rdma*.so' 2>/dev/null | head -n1; }
if [ ! -f "$stamp" ] || [ -z "$(module)" ]; then
    echo "[setup] building the transport module with -fsanitize=$kinds (into ${out#"$repo_root"/})" >&2
    rm -rf "$out"
    mkdir -p "$out"
    (cd "$repo_root" && MAPP_SANITIZE="$kinds" "$py" setup.py -q build_ext --build-lib "$out/lib" \
        --build-temp "$out/tmp" >"$out/build.log" 2>&1) || { cat "$out/build.log" >&2; exit 1; }
    touch "$stamp"
fi
module
