"""`zb-h1`: a ZB-H1-style static order (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) for a split backward.

Megatron's order of forwards and B's (interleaved, or 1F1B when V == 1) with each rank r keeping its r latest W's
deferred: after each B the oldest W runs once more than r are pending, and the r left run at the end of the
iteration. In 1F1B rank r ends its last backward r backward-slots before rank 0 and then idles; r W's fill that tail.
Rank r then holds up to r more activations than under Megatron's order, so every rank's peak is about rank 0's (with
V == 1 exactly P, the 1F1B peak of the pipeline: ZB-H1's "same peak memory as 1F1B"). With uniform costs and free
messages, V == 1 and F = B = W, its makespan is 3m + P - 1 task-times against 1F1B's 3(m + P - 1) (the paper's
bubble (P-1)(F+B-W)); tests/test_schedule_split_backward.py checks that.
"""

from __future__ import annotations

from collections import deque
from typing import List, Optional, Tuple

from .errors import ScheduleConfigError
from .megatron_order import megatron_order, without_fill
from .shape import PipelineShape
from .static_order import StaticOrderPolicy, make_static
from .tasks import Kind, Task


def zb_h1_order(shape: PipelineShape, rank: int) -> Tuple[Task, ...]:
    """Rank `rank`'s tasks in the ZB-H1-style order (module doc); `shape` must have split_backward."""
    if not shape.split_backward:
        raise ScheduleConfigError("policy 'zb-h1' needs a split backward (--split-backward)")
    deferred = rank
    order: List[Task] = []
    pending: deque = deque()
    for task in without_fill(megatron_order(shape, rank)):
        order.append(task)
        if task.kind is Kind.BACKWARD:
            pending.append(Task(Kind.WEIGHT, task.chunk, task.microbatch))
            if len(pending) > deferred:
                order.append(pending.popleft())
    order.extend(pending)
    return tuple(order)


def make_zb_h1(shape: PipelineShape, rank: int, memory_cap: Optional[int] = None) -> StaticOrderPolicy:
    return make_static("zb-h1", zb_h1_order(shape, rank), shape, rank, memory_cap)
