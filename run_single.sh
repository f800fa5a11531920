#!/usr/bin/env bash
# Train a GPT with megatron_app's pipeline schedule on this node.
#   bash run_single.sh --pipeline_parallel P --model_chunks V [--tensor_parallel T] [--data_parallel D] [trainer flags]
# Starts P*T*D ranks with torchrun (CPU + gloo by default, one GPU per rank when there are enough GPUs).
# Megatron-LM's names work too (--pipeline-model-parallel-size, --tensor-model-parallel-size, ...).
# Every other flag goes to `python -m megatron_app.train` (see --help there).
set -euo pipefail

launch_started=$(date +%s.%N)   # the launcher's own phases reach the rank's start-up record (train/startup.py)
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$repo_root"

usage() { echo "usage: bash run_single.sh --pipeline_parallel P --model_chunks V [--tensor_parallel T] [--data_parallel D] [trainer flags]"; }
fail() { echo "run_single.sh: $*" >&2; exit 2; }

P=1; V=; T=1; D=1; passthrough=()   # V unset: the trainer derives it (1, or from Megatron-LM's --num-layers-per-virtual-pipeline-stage)
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exec_help=1; break ;;
        --pipeline_parallel|--pipeline-parallel|--pipeline-model-parallel-size)
            [ $# -ge 2 ] || fail "$1 needs a value"; P=$2; shift 2 ;;
        --model_chunks|--model-chunks|--num-virtual-stages-per-pipeline-rank|--virtual-pipeline-model-parallel-size)
            [ $# -ge 2 ] || fail "$1 needs a value"; V=$2; shift 2 ;;
        --tensor_parallel|--tensor-parallel|--tensor-model-parallel-size)
            [ $# -ge 2 ] || fail "$1 needs a value"; T=$2; shift 2 ;;
        --data_parallel|--data-parallel) [ $# -ge 2 ] || fail "$1 needs a value"; D=$2; shift 2 ;;
        *) passthrough+=("$1"); shift ;;
    esac
done
for pair in "pipeline_parallel:$P" "model_chunks:${V:-1}" "tensor_parallel:$T" "data_parallel:$D"; do
    value=${pair#*:}
    [[ "$value" =~ ^[1-9][0-9]*$ ]] || fail "--${pair%%:*} must be a positive integer, got '$value'"
done

source tools/setup_env.sh
setup_done=$(date +%s.%N)
layout=(--pipeline_parallel "$P" ${V:+--model_chunks "$V"} --tensor_parallel "$T" --data_parallel "$D")
if [ "${exec_help:-0}" = 1 ]; then exec "$VENV_PY" -m megatron_app.train --help; fi

world=$((P * T * D))
# Check every flag in one process first: a bad config fails with one line before any rank starts.
config=$(WORLD_SIZE=$world "$VENV_PY" -m megatron_app.train "${layout[@]}" "${passthrough[@]}" --check-config) || exit 2
export MEGATRON_APP_LAUNCH_MARKS="$launch_started $setup_done $(date +%s.%N)"
echo "$config"
[[ "$config" =~ \ V=([0-9]+) ]] && V=${BASH_REMATCH[1]}   # the trainer's V (also from Megatron-LM's flags)

export MEGATRON_APP_JOB_ID=${MEGATRON_APP_JOB_ID:-single$$x$(date +%s)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cleanup() { "$VENV_PY" "$repo_root/tools/transport_core.py" --cleanup "$MEGATRON_APP_JOB_ID" 2>/dev/null || true; }
trap cleanup EXIT

echo "[run_single] $world ranks: pipeline $P x tensor $T x data $D, $V model chunks per rank (job $MEGATRON_APP_JOB_ID)" >&2
# run_ranks.py: a failed rank ends the output with one line naming it, instead of torchrun's traceback.
torchrun_logs="${LOG_DIR:-logs}/torchrun"
"$VENV_PY" tools/run_ranks.py --name run_single.sh --log-dir "$torchrun_logs" --job-id "$MEGATRON_APP_JOB_ID" -- \
    "$VENV_PY" -m megatron_app.train.torchrun --standalone --nnodes 1 --nproc_per_node "$world" \
    --max_restarts 0 --redirects 3 --tee 3 --log_dir "$torchrun_logs" \
    -m megatron_app.train "${layout[@]}" "${passthrough[@]}"
