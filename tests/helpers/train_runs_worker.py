"""Several megatron_app.train runs in one process group, for forked_ranks: the imports are paid once.

    train_runs_worker.py ARGV_JSON    # a JSON list of trainer argument lists, run in turn on every rank
"""

import json
import os
import sys

import torch.distributed as dist

from megatron_app.train.args import parse_args
from megatron_app.train.loop import train

if __name__ == "__main__":
    runs = json.loads(open(sys.argv[1]).read())
    dist.init_process_group("gloo")
    try:
        for index, argv in enumerate(runs):
            os.environ["MEGATRON_APP_JOB_ID"] = f"trainruns{os.getppid()}r{index}"   # fresh shared-memory names
            before = set(dist.distributed_c10d._world.pg_map)
            train(parse_args(argv))
            for group in set(dist.distributed_c10d._world.pg_map) - before:
                dist.destroy_process_group(group)
    finally:
        dist.destroy_process_group()
