"""A rank of tests/test_gloo_gradients.py: torch's collectives inside the one-by-one manager on a gloo group, and
Megatron's DDP reducing its buckets through it. Prints one JSON line of what it saw."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main():
    from torch.distributed import _coalescing_manager

    from megatron_app.gloo_gradients import one_by_one_on_gloo
    from megatron_app.say import say

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    manager = one_by_one_on_gloo(_coalescing_manager)
    seen = {}
    for async_ops in (False, True):
        tensors = [torch.full((5,), float(rank + 1)), torch.full((3,), 10.0 * (rank + 1))]
        with manager(dist.group.WORLD, async_ops=async_ops) as cm:
            for tensor in tensors:
                dist.all_reduce(tensor, group=dist.group.WORLD, async_op=async_ops)
        cm.wait()
        seen[f"async={async_ops}"] = [tensor.tolist() for tensor in tensors]
        seen[f"works async={async_ops}"] = len(cm.works)
    try:
        with manager(dist.group.WORLD) as cm:
            dist.all_gather_into_tensor(torch.empty(4), torch.ones(2), group=dist.group.WORLD)
    except RuntimeError as error:
        seen["all_gather"] = str(error)
    say(json.dumps({"rank": rank, **seen}), sys.stdout)   # one write: the two ranks share the pipe
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
