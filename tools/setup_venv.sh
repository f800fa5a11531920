#!/usr/bin/env bash
# Sourced by setup_env.sh (and by its test): the interpreter, .venv, and the torch that .venv imports.
#   make_venv      create .venv unless it exists: --system-site-packages, plus the site-packages of the venv that
#                  the interpreter itself belongs to, if it does (a GPU image's python3 often is a venv's, its torch
#                  in that venv: --system-site-packages alone would show .venv only the base's site-packages)
#   ensure_torch   reuse any torch .venv can import; install $TORCH_PIN only when there is none at all
# Needs repo_root. Sets base_py and venv; defines log and die. pip is run plainly, so its environment settings hold:
# PIP_NO_INDEX=1 PIP_FIND_LINKS=<wheels> installs offline.

venv="$repo_root/.venv"
TORCH_PIN="torch==2.13.0"

log() { echo "[setup] $*" >&2; }
die() { echo "setup: $*" >&2; exit 1; }

base_py=${PYTHON:-python3}
command -v "$base_py" >/dev/null || die "python3 not found (need Python >= 3.10)"
"$base_py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "Python >= 3.10 required, found $("$base_py" -V 2>&1)"

make_venv() {
    [ -x "$venv/bin/python" ] && return 0
    log "creating .venv (with system site packages, so an installed torch is reused)"
    "$base_py" -m venv --system-site-packages "$venv" || die "could not create $venv (is python3-venv installed?)"
    # The interpreter's own venv, when it is in one: a .pth in .venv's site-packages adds that venv's site-packages
    # after .venv's own (addsitedir also runs the .pth files there), before the base's.
    local outer venv_site
    venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
        || die "$venv/bin/python does not run"
    outer=$("$base_py" - "$venv_site" <<'PY'
import importlib.util, os, site, sys
if sys.prefix == sys.base_prefix:
    sys.exit(0)
sites = [path for path in site.getsitepackages() if path.startswith(sys.prefix)]
with open(os.path.join(sys.argv[1], "_megatron_app_outer_venv.pth"), "w") as pth:
    pth.writelines(f"import site; site.addsitedir({path!r})\n" for path in sites)
torch = importlib.util.find_spec("torch")
where = "no torch there"
if torch is not None:
    where = "its torch: " + (os.path.dirname(torch.origin) if torch.origin else torch.submodule_search_locations[0])
print(f"{sys.executable} is a venv's ({sys.prefix}): .venv sees its site-packages too ({where})")
PY
) || die "could not link $venv to the venv of $base_py"
    [ -z "$outer" ] || log "$outer"
}

ensure_torch() {
    local py="$venv/bin/python" problem where reinstall=()
    problem=$("$py" -c 'import torch' 2>&1 >/dev/null) && return 0
    where=$("$py" -c 'import importlib.util as u; s = u.find_spec("torch"); print(s.origin if s else "")' 2>/dev/null \
        || true)
    case "$where" in
        "") log "no importable torch: installing $TORCH_PIN" ;;
        "$venv"/*)   # one this script installed, broken (an interrupted install, say): install it again
            log "torch in .venv does not import ($(echo "$problem" | tail -n1)): installing $TORCH_PIN again"
            reinstall=(--force-reinstall --no-deps) ;;
        *)  # someone else's torch (a CUDA build, perhaps): installing another one would hide it
            die "torch is installed but does not import: $(echo "$problem" | tail -n1)" ;;
    esac
    "$py" -m pip install -q --disable-pip-version-check "${reinstall[@]}" "$TORCH_PIN" 2>&1 \
        | grep -v -E '^WARNING: Location' || true
    "$py" -c 'import torch' 2>/dev/null \
        || die "$TORCH_PIN did not install (offline? PIP_NO_INDEX=1 PIP_FIND_LINKS=<a folder with its wheel>)"
}
