#!/usr/bin/env bash
# Multi-host training, worker host (node rank 1..N-1). Same flags as run_master.sh plus --node_rank:
#   bash run_worker.sh --pipeline_parallel P --model_chunks V ... --nnodes N --node_rank K --master_addr MASTER_HOST \
#        [--master_port 29500] [trainer flags]
# Waits for the master at most --rendezvous_timeout seconds (default 120), then fails with one line.
exec bash "$(dirname "${BASH_SOURCE[0]}")/tools/launch_node.sh" worker "$@"
