#!/usr/bin/env bash
# Multi-host training, master host (node rank 0). Same flags as run_single.sh plus:
#   bash run_master.sh --pipeline_parallel P --model_chunks V [--tensor_parallel T] [--data_parallel D] \
#        --nnodes N [--master_addr THIS_HOST] [--master_port 29500] [--transport auto|shm|tcp|rdma] [trainer flags]
# Start run_worker.sh with the same flags on the other hosts. MASTER_ADDR / MASTER_PORT / NNODES may come from the
# environment instead. Peers find each other through the rendezvous store: no addresses go in files.
exec bash "$(dirname "${BASH_SOURCE[0]}")/tools/launch_node.sh" master "$@"
