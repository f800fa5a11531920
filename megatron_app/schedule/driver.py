"""drive(): a tiny reference multi-rank driver on a logical clock, for tests and as a model for the simulator.

Each rank runs one task at a time; a finished task's output reaches its consumer rank after `arrival_delay`. A rank
whose policy has nothing to run sleeps until the next arrival for it (no polling).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .errors import ScheduleConfigError, ScheduleStallError
from .policies import Policy, make_policy
from .shape import PipelineShape
from .state import RankState
from .task_table import TaskTable
from .tasks import Task

# (producer rank, producer task, consumer rank) -> delay in time units
ArrivalDelay = Callable[[int, Task, int], float]
# (rank, task) -> duration in time units
TaskDuration = Callable[[int, Task], float]

_FINISH, _ARRIVE, _WAKE = 0, 1, 2   # tie-break at equal times: finish first, then arrivals, then ask the policy


def stall_report(states: Sequence[RankState], policies: Sequence[Policy]) -> str:
    lines = [f"schedule stalled: no rank can run and no input is in flight (policy {policies[0].name!r})"]
    lines += [state.describe() for state in states]
    return "\n".join(lines)


def drive(shape: PipelineShape, policies: Union[str, Sequence[Policy]],
          arrival_delay: Optional[ArrivalDelay] = None,
          task_duration: Optional[TaskDuration] = None,
          finish_times: Optional[Dict[Tuple[int, Task], float]] = None) -> Dict[int, List[Task]]:
    """Run every rank to completion; returns each rank's tasks in execution order.

    finish_times: when given, filled with each (rank, task)'s end on the logical clock.
    policies: one Policy per rank, or a policy name (default options on every rank).
    Raises ScheduleStallError (with every rank's state) when the schedule would hang.
    """
    if isinstance(policies, str):
        policies = [make_policy(policies, shape, rank) for rank in range(shape.num_stages)]
    if len(policies) != shape.num_stages:
        raise ScheduleConfigError(f"need one policy per rank ({shape.num_stages}), got {len(policies)}")
    states = [RankState(shape, rank) for rank in range(shape.num_stages)]
    table = TaskTable(shape)
    busy = [False] * shape.num_stages
    events: list = []
    sequence = itertools.count()   # keeps the heap order total and deterministic

    def push(time: float, kind: int, rank: int, task: Optional[Task] = None, duration: float = 0.0):
        heapq.heappush(events, (time, kind, next(sequence), rank, task, duration))

    for rank in range(shape.num_stages):
        push(0.0, _WAKE, rank)
    while events:
        now, kind, _, rank, task, duration = heapq.heappop(events)
        state = states[rank]
        if kind == _ARRIVE:
            state.mark_arrived(task)
            push(now, _WAKE, rank)
        elif kind == _FINISH:
            state.mark_done(task)
            if finish_times is not None:
                finish_times[rank, task] = now
            policies[rank].observe(task, duration)
            busy[rank] = False
            target = table.consumer(rank, task)
            if target is not None:
                delay = arrival_delay(rank, task, target[0]) if arrival_delay else 0.0
                if delay < 0:
                    raise ScheduleConfigError(f"arrival_delay returned {delay} < 0 for {task} on rank {rank}")
                push(now + delay, _ARRIVE, *target)
            push(now, _WAKE, rank)
        elif not busy[rank] and not state.finished:
            chosen = policies[rank].next(state)
            if chosen is not None:
                state.mark_started(chosen)
                busy[rank] = True
                duration = task_duration(rank, chosen) if task_duration else 1.0
                if duration < 0:
                    raise ScheduleConfigError(f"task_duration returned {duration} < 0 for {chosen}")
                push(now + duration, _FINISH, rank, chosen, duration)
    if not all(state.finished for state in states):
        raise ScheduleStallError(stall_report(states, policies))
    return {rank: state.done_tasks for rank, state in enumerate(states)}
