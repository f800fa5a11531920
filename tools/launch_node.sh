#!/usr/bin/env bash
# Shared body of run_master.sh and run_worker.sh: one host's part of a multi-host training run.
#   bash tools/launch_node.sh master|worker [run_single.sh flags] --nnodes N [--node_rank K] --master_addr A
#        [--master_port P] [--transport auto|shm|tcp|rdma] [--rendezvous_timeout S] [trainer flags]
# Every host runs torchrun with a static rendezvous at A:P and (P*T*D)/N ranks. Before that, a preflight through
# a short-lived store at A:P checks that every host was given the same flags and that each node rank shows up once;
# it also hands the master's job id to every host. Ranks exchange their own addresses through torchrun's store.
set -euo pipefail

role=${1:?role master|worker}
shift
script="run_${role}.sh"
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"

usage() {
    echo "usage: bash $script --pipeline_parallel P --model_chunks V [--tensor_parallel T] [--data_parallel D]" \
         "--nnodes N $([ "$role" = worker ] && echo '--node_rank K ')--master_addr HOST [--master_port PORT]" \
         "[--transport auto|shm|tcp|rdma] [--rendezvous_timeout S] [trainer flags]"
}
fail() { echo "$script: $*" >&2; exit 2; }

P=1; V=; T=1; D=1; passthrough=()   # V unset: the trainer derives it
nnodes=${NNODES:-}; node_rank=${NODE_RANK:-}
master_addr=${MASTER_ADDR:-}; master_port=${MASTER_PORT:-29500}
transport=${MEGATRON_APP_TRANSPORT:-auto}; rdzv_timeout=${MEGATRON_APP_RENDEZVOUS_TIMEOUT:-120}
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --pipeline_parallel|--pipeline-parallel|--pipeline-model-parallel-size)
            [ $# -ge 2 ] || fail "$1 needs a value"; P=$2; shift 2 ;;
        --model_chunks|--model-chunks|--num-virtual-stages-per-pipeline-rank|--virtual-pipeline-model-parallel-size)
            [ $# -ge 2 ] || fail "$1 needs a value"; V=$2; shift 2 ;;
        --tensor_parallel|--tensor-parallel|--tensor-model-parallel-size)
            [ $# -ge 2 ] || fail "$1 needs a value"; T=$2; shift 2 ;;
        --data_parallel|--data-parallel) [ $# -ge 2 ] || fail "$1 needs a value"; D=$2; shift 2 ;;
        --nnodes) [ $# -ge 2 ] || fail "$1 needs a value"; nnodes=$2; shift 2 ;;
        --node_rank|--node-rank) [ $# -ge 2 ] || fail "$1 needs a value"; node_rank=$2; shift 2 ;;
        --master_addr|--master-addr) [ $# -ge 2 ] || fail "$1 needs a value"; master_addr=$2; shift 2 ;;
        --master_port|--master-port) [ $# -ge 2 ] || fail "$1 needs a value"; master_port=$2; shift 2 ;;
        --transport) [ $# -ge 2 ] || fail "$1 needs a value"; transport=$2; shift 2 ;;
        --rendezvous_timeout|--rendezvous-timeout) [ $# -ge 2 ] || fail "$1 needs a value"; rdzv_timeout=$2; shift 2 ;;
        *) passthrough+=("$1"); shift ;;
    esac
done

positive() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || fail "--$1 must be a positive integer, got '$2'"; }
for pair in "pipeline_parallel:$P" "model_chunks:${V:-1}" "tensor_parallel:$T" "data_parallel:$D"; do
    positive "${pair%%:*}" "${pair#*:}"
done
[ -n "$nnodes" ] || fail "--nnodes is required (or set NNODES)"
positive nnodes "$nnodes"
positive rendezvous_timeout "$rdzv_timeout"
if [ "$role" = master ]; then
    node_rank=${node_rank:-0}
    [ "$node_rank" = 0 ] || fail "the master is node rank 0, got --node_rank $node_rank (use run_worker.sh)"
    master_addr=${master_addr:-$(hostname)}
else
    [ -n "$node_rank" ] || fail "--node_rank is required (or set NODE_RANK)"
    [[ "$node_rank" =~ ^[0-9]+$ ]] && [ "$node_rank" -ge 1 ] && [ "$node_rank" -lt "$nnodes" ] \
        || fail "--node_rank must be between 1 and $((nnodes - 1)) for a worker, got '$node_rank'"
    [ -n "$master_addr" ] || fail "--master_addr is required (or set MASTER_ADDR): the master's address"
fi
[[ "$master_port" =~ ^[0-9]+$ ]] && [ "$master_port" -ge 1 ] && [ "$master_port" -le 65535 ] \
    || fail "--master_port must be a port number (1-65535), got '$master_port'"
case "$transport" in auto|shm|tcp|rdma) ;; *) fail "--transport must be auto, shm, tcp or rdma, got '$transport'" ;; esac

world=$((P * T * D))
[ $((world % nnodes)) = 0 ] || fail "$world ranks (pipeline $P x tensor $T x data $D) do not split evenly over $nnodes nodes"
nproc=$((world / nnodes))

source tools/setup_env.sh
layout=(--pipeline_parallel "$P" ${V:+--model_chunks "$V"} --tensor_parallel "$T" --data_parallel "$D")
config=$(WORLD_SIZE=$world LOCAL_WORLD_SIZE=$nproc NODE_RANK=$node_rank "$VENV_PY" -m megatron_app.train "${layout[@]}" \
    ${passthrough[@]+"${passthrough[@]}"} --check-config) || exit 2
echo "$config"
[[ "$config" =~ \ V=([0-9]+) ]] && V=${BASH_REMATCH[1]}   # the trainer's V (also from Megatron-LM's flags)

layout_json="{\"pipeline_parallel\": $P, \"model_chunks\": $V, \"tensor_parallel\": $T, \"data_parallel\": $D, \"nnodes\": $nnodes, \"transport\": \"$transport\"}"
job_id=${MEGATRON_APP_JOB_ID:-multi$$x$(date +%s)}
echo "[$script] node $node_rank of $nnodes: checking in with $master_addr:$master_port" >&2
# Run as a file, not with -m: importing the megatron_app.transport package loads torch and the extension, which takes
# seconds on a loaded host and would count against --rendezvous_timeout before the first connection attempt.
job_id=$(TORCH_CPP_LOG_LEVEL=FATAL "$VENV_PY" megatron_app/transport/preflight.py --role "$role" --nnodes "$nnodes" \
    --node_rank "$node_rank" --master_addr "$master_addr" --master_port "$master_port" \
    --job_id "$job_id" --timeout "$rdzv_timeout" --layout "$layout_json" -- ${passthrough[@]+"${passthrough[@]}"}) || exit 2

export MEGATRON_APP_JOB_ID=$job_id MEGATRON_APP_TRANSPORT=$transport
# gloo advertises the address its host name resolves to (often 127.0.0.1): point it at the interface that reaches
# the master instead, found from this host's own address toward it.
if [ -z "${GLOO_SOCKET_IFNAME:-}" ] && command -v ip >/dev/null; then
    local_ip=$("$VENV_PY" -c 'import sys; from megatron_app.transport.backend_choice import advertised_address
print(advertised_address(sys.argv[1]))' "$master_addr")
    ifname=$(ip -o addr show | awk -v ip="$local_ip" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}')
    if [ -n "$ifname" ]; then export GLOO_SOCKET_IFNAME=$ifname; fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cleanup() { "$VENV_PY" "$repo_root/tools/transport_core.py" --cleanup "$MEGATRON_APP_JOB_ID" 2>/dev/null || true; }
trap cleanup EXIT

echo "[$script] node $node_rank: $nproc of $world ranks (pipeline $P x tensor $T x data $D, $V chunks), transport $transport, job $job_id" >&2
# run_ranks.py: a failed rank ends the output with one line naming it, instead of torchrun's traceback.
torchrun_logs="${LOG_DIR:-logs}/torchrun_node$node_rank"
"$VENV_PY" tools/run_ranks.py --name "$script (node $node_rank)" --log-dir "$torchrun_logs" --job-id "$job_id" -- \
    "$VENV_PY" -m megatron_app.train.torchrun --nnodes "$nnodes" --node_rank "$node_rank" --nproc_per_node "$nproc" \
    --master_addr "$master_addr" --master_port "$master_port" --max_restarts 0 \
    --redirects 3 --tee 3 --log_dir "$torchrun_logs" \
    -m megatron_app.train "${layout[@]}" ${passthrough[@]+"${passthrough[@]}"}
