"""One rank of a group decides, every rank of the group receives the decision: how every choice that must agree
across ranks is made (the iteration plan, the job id)."""

from __future__ import annotations

import time

import torch.distributed as dist


def decide_once(decide, distributed: bool, group=None):
    """decide() on the group's first rank, timed; its result broadcast to every rank of the group (default: the
    job). Returns (result, seconds the decision took on the deciding rank, 0.0 elsewhere)."""
    first = 0 if group is None else dist.get_global_rank(group, 0)
    deciding = not distributed or dist.get_rank() == first
    result, seconds = None, 0.0
    if deciding:
        start = time.perf_counter()
        result = decide(start)
        seconds = time.perf_counter() - start
    if distributed and dist.get_world_size(group) > 1:
        box = [result]
        dist.broadcast_object_list(box, src=first, group=group)
        result = box[0]
    return result, seconds
