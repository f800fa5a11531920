#!/usr/bin/env bash
# What the extension's build depends on, one "name: value" line each: its sources and build script (hashed), and
# what setup.py probes on this machine (the verbs header and library, the compiler, torch, pybind11, Python).
# setup_env.sh rebuilds whenever this text changes: installing rdma-core after a first build must give an rdma build.
#   VENV_PY=.venv/bin/python bash tools/build_stamp.sh
set -euo pipefail

repo_root=${repo_root:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
py=${VENV_PY:-python3}

sources=$(find "$repo_root/csrc" "$repo_root/setup.py" -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' \
    -o -name 'setup.py' \) 2>/dev/null | sort)
# shellcheck disable=SC2086  # one path per word
echo "sources: $(cat $sources 2>/dev/null | sha256sum | cut -c1-16)"

# The compilers setup.py's build uses: $CC / $CXX, else the ones Python was configured with.
read -r cc cxx < <("$py" -c 'import sysconfig
print((sysconfig.get_config_var("CC") or "cc").split()[0], (sysconfig.get_config_var("CXX") or "c++").split()[0])')
cc=${CC:-$cc}; cxx=${CXX:-$cxx}
echo "compiler: $cxx $("$cxx" --version 2>/dev/null | head -n1 || echo missing)"
if echo '#include <infiniband/verbs.h>' | "$cc" -E -x c - >/dev/null 2>&1; then
    echo "verbs header: present"
else
    echo "verbs header: absent"
fi
verbs_library=$("$cc" -print-file-name=libibverbs.so 2>/dev/null || true)
if [ -n "$verbs_library" ] && [ "$verbs_library" != libibverbs.so ]; then
    echo "verbs library: $verbs_library"
else
    echo "verbs library: absent"
fi
"$py" - <<'PYTHON'
import importlib.metadata as metadata
import sys

for name in ("torch", "pybind11"):
    try:
        print(f"{name}: {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name}: absent")
print(f"python: {sys.version.split()[0]}")
PYTHON
echo "MAPP_WITHOUT_RDMA: ${MAPP_WITHOUT_RDMA:-}"
