#!/usr/bin/env bash
# The GPU proof, one command on any CUDA host with Python >= 3.10:
#   bash tools/gpu_check.sh --out DIR [--wheels DIR]   # GPU host; --wheels: install offline from these wheels
#   bash tools/gpu_check.sh --cpu --out DIR            # the CPU rehearsal (same steps, small sizes; in the suite)
#   [--steps a,b,...] [--budget-s SECONDS]             # a subset of the steps; a time budget for them (after set-up)
#   [--no-ahead]                                       # timed runs start only when the one before ends
# Sets up .venv (tools/setup_env.sh, timed), then runs tools/gpu_check.py, which writes DIR/report.json and
# DIR/report.txt. Exit 0 when every step passes (or skips with its reason), 1 otherwise, 2 for bad flags.
set -uo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=; cpu=; wheels=; steps=; budget=; no_ahead=
while [ $# -gt 0 ]; do
    case "$1" in
        --out) [ $# -ge 2 ] || { echo "gpu_check.sh: --out needs a folder" >&2; exit 2; }; out=$2; shift 2 ;;
        --wheels) [ $# -ge 2 ] || { echo "gpu_check.sh: --wheels needs a folder" >&2; exit 2; }; wheels=$2; shift 2 ;;
        --steps) [ $# -ge 2 ] || { echo "gpu_check.sh: --steps needs a list" >&2; exit 2; }; steps=$2; shift 2 ;;
        --budget-s) [ $# -ge 2 ] || { echo "gpu_check.sh: --budget-s needs seconds" >&2; exit 2; }; budget=$2; shift 2 ;;
        --cpu) cpu=1; shift ;;
        --no-ahead) no_ahead=1; shift ;;
        -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
done
[ -n "$out" ] || { echo "gpu_check.sh: --out DIR is required" >&2; exit 2; }
if [ -n "$wheels" ]; then
    [ -d "$wheels" ] || { echo "gpu_check.sh: --wheels $wheels is not a folder" >&2; exit 2; }
    export PIP_FIND_LINKS=$(cd "$wheels" && pwd) PIP_NO_INDEX=1
fi
mkdir -p "$out"
started=$(date +%s%N)
# shellcheck source=tools/setup_env.sh
if ! ( source "$repo_root/tools/setup_env.sh" ) >"$out/setup.log" 2>&1; then
    echo "gpu_check.sh: set-up failed: $(tail -n 1 "$out/setup.log") (whole log: $out/setup.log)" >&2
    exit 1
fi
elapsed_ms=$(( ($(date +%s%N) - started) / 1000000 ))
setup_seconds=$(printf "%d.%03d" $((elapsed_ms / 1000)) $((elapsed_ms % 1000)))
source "$repo_root/tools/setup_env.sh" 2>/dev/null
exec "$VENV_PY" "$repo_root/tools/gpu_check.py" --out "$out" --setup-seconds "$setup_seconds" ${cpu:+--cpu} \
    ${steps:+--steps "$steps"} ${budget:+--budget-s "$budget"} ${no_ahead:+--no-ahead}
