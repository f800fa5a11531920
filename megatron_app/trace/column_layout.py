"""Place each forward/backward of one iteration in a spreadsheet column so the sheet reads as the computation order
AND the dependencies: a task sits right of the previous task on its rank and right of the task that produced its
input. Derived from event order, not wall time (the timeline plot shows time)."""

from __future__ import annotations

from dataclasses import dataclass

from .dependencies import InputSources, TaskKey, task_key
from .schema import BACKWARD, TraceEvent

FORWARD_WIDTH = 1
BACKWARD_WIDTH = 2  # backward costs about twice a forward; two merged cells say so at a glance


@dataclass(frozen=True)
class PlacedTask:
    event: TraceEvent
    column: int  # 0-based
    width: int


def task_width(event: TraceEvent) -> int:
    """A backward is two cells; a forward and a split backward's W one each."""
    return BACKWARD_WIDTH if event.kind == BACKWARD else FORWARD_WIDTH


def layout_columns(stage_events: list[list[TraceEvent]], sources: InputSources) -> list[list[PlacedTask]]:
    """stage_events[r]: the compute events of pipeline rank r. Returns the placed tasks per rank, in run order.

    Ranks advance in lockstep: a rank's next task is placed once its producer is placed. If a doctored or
    clock-skewed trace makes that impossible (a cycle), the earliest-starting waiting task is placed anyway.
    """
    queues = [sorted(events, key=lambda e: (e.start, e.end)) for events in stage_events]
    present = {task_key(e) for events in queues for e in events}
    placed: dict[TaskKey, PlacedTask] = {}
    next_free = [0] * len(queues)
    heads = [0] * len(queues)
    rows: list[list[PlacedTask]] = [[] for _ in queues]

    def place(rank: int, producer: PlacedTask | None) -> None:
        event = queues[rank][heads[rank]]
        column = next_free[rank]
        if producer is not None:
            column = max(column, producer.column + producer.width)
        task = PlacedTask(event, column, task_width(event))
        placed[task_key(event)] = task
        rows[rank].append(task)
        next_free[rank] = column + task.width
        heads[rank] += 1

    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for rank, queue in enumerate(queues):
            while heads[rank] < len(queue):
                producer_key = sources.producer_of(queue[heads[rank]])
                if producer_key is not None and producer_key in present and producer_key not in placed:
                    break
                place(rank, placed.get(producer_key) if producer_key else None)
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [r for r, q in enumerate(queues) if heads[r] < len(q)]
            rank = min(waiting, key=lambda r: queues[r][heads[r]].start)
            place(rank, None)
            remaining -= 1
    return rows
