"""Who consumes each task's output, for every task of a shape: the shape's dependency rule (shape.output_target)
evaluated once, so event loops (the reference driver, the simulator) neither allocate Tasks nor re-derive the
dependency arithmetic per event (a large share of the simulator's time at P=64, m=512)."""

from __future__ import annotations

from typing import Optional

from .shape import PipelineShape
from .tasks import KINDS_BY_INDEX, Task


class TaskTable:
    """Every Task object of a shape, built once, and who consumes each task's output."""

    def __init__(self, shape: PipelineShape):
        kinds = KINDS_BY_INDEX
        self.tasks = [[[Task(kind, chunk, mb) for mb in range(shape.num_microbatches)]
                       for chunk in range(shape.num_chunks)] for kind in kinds]
        self.consumers = []      # [rank][kind index][chunk] -> (peer rank, peer chunk) or None
        for rank in range(shape.num_stages):
            per_kind = []
            for kind in kinds:
                row = []
                for chunk in range(shape.num_chunks):
                    target = shape.output_target(rank, Task(kind, chunk, 0)) if kind in shape.kinds else None
                    row.append(None if target is None else (target[0], target[1].chunk))
                per_kind.append(row)
            self.consumers.append(per_kind)

    def consumer(self, rank: int, task: Task) -> Optional[tuple]:
        """(peer rank, peer task) that takes `task`'s output, or None."""
        kind = task.kind.index
        target = self.consumers[rank][kind][task.chunk]
        if target is None:
            return None
        return target[0], self.tasks[kind][target[1]][task.microbatch]
