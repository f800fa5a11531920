"""The discrete-event loop: P ranks run the schedule package's own policy objects under a cost model.

Semantics mirror the runtime (megatron_app.runtime.executor): an idle rank first takes every input that has
arrived by now, then asks policy.next(state); it runs the task, reports policy.observe(task, seconds) and posts the
output, which reaches the consumer rank after the link's cost (network.py). When the policy returns None the rank
waits until the next arrival of one of its inputs. Events at equal times: finishes, then arrivals, then decisions.

Iterations are separated by a barrier (the optimizer step and gradient reductions need every rank): iteration k+1
starts when the slowest rank ends iteration k. Each rank keeps one policy object for the whole run (so the adaptive
policy's learned costs carry over) and gets a fresh RankState per iteration.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from megatron_app.schedule import PipelineShape, Policy, RankState, ScheduleStallError, Task, make_policy
from megatron_app.schedule.driver import stall_report
from megatron_app.schedule.iteration_plan import PipelineSpec, plan_told_microbatches
from megatron_app.schedule.task_table import TaskTable

from .costs import DurationTable
from .network import Network
from .trace_output import SimTrace

_FINISH, _ARRIVE, _DECIDE = 0, 1, 2   # tie-break at equal times
US_PER_S = 1e6


@dataclass
class IterationOutcome:
    iteration: int
    start_us: float
    end_us: float
    busy_us: List[float]                 # per rank: sum of its task durations
    peak_activations: List[int]          # per rank
    orders: List[List[Task]] = field(repr=False)   # per rank, tasks in execution order
    peak_activation_sizes: List[float] = field(default_factory=list)   # per rank: tokens with lengths, else count
    planning_s: float = 0.0              # CPU time rank 0's policy spent choosing this iteration's plan

    @property
    def makespan_us(self) -> float:
        return self.end_us - self.start_us

    @property
    def bubble_ratio(self) -> float:
        """Mean over ranks of the idle share of the makespan (tools/process_trace.py's mean_bubble_ratio)."""
        if self.makespan_us <= 0:
            return 0.0
        return sum(1.0 - busy / self.makespan_us for busy in self.busy_us) / len(self.busy_us)


def make_policies(shape: PipelineShape, name: str, memory_cap: Optional[int] = None,
                  memory_factor: Optional[float] = None) -> List[Policy]:
    """One policy per rank; memory_factor goes to the policies that declare it (the others ignore it here, so one
    simulator configuration can compare every policy)."""
    from megatron_app.schedule import POLICIES

    factor = memory_factor if POLICIES[name].takes("memory_factor") else None
    return [make_policy(name, shape, rank, memory_cap, memory_factor=factor) for rank in range(shape.num_stages)]


def run_iteration(shape: PipelineShape, policies: Sequence[Policy], durations: DurationTable, network: Network,
                  iteration: int, start_us: float, trace: Optional[SimTrace] = None,
                  table: Optional[TaskTable] = None, lengths: Optional[Sequence[int]] = None,
                  plan=None) -> IterationOutcome:
    """Simulate one iteration from start_us; raises ScheduleStallError (every rank's state) if it would hang.
    lengths: tokens per microbatch. Planning policies get them (rank 0 plans, every rank adopts the plan, as the
    runtime's broadcast does) and activations are sized by them (peaks in tokens); None counts activations.
    plan: a plan chosen beforehand (a composed batch's, composition_plan.py): planning policies adopt it, no search."""
    P = shape.num_stages
    planning_s = 0.0
    if policies[0].plans_iterations and plan is not None:
        for policy in policies:
            policy.use_plan(lengths, plan)
    elif policies[0].plans_iterations:
        planner = policies[0]
        if lengths is not None and planner.orders_told_lengths:
            began = time.process_time()     # CPU time: on a shared machine wall time would measure the load
            pipeline = PipelineSpec.of_shape(shape, planner.memory_factor, planner.evaluations)
            plan = plan_told_microbatches(lengths, pipeline, planner.costs).replica(0).plan
            planning_s = time.process_time() - began
        for policy in policies:
            policy.use_plan(lengths, plan)
    activation_sizes = lengths
    table = table or TaskTable(shape)
    states = [RankState(shape, rank, activation_sizes) for rank in range(P)]
    busy = [False] * P
    decision_pending = [False] * P
    idle_since: List[Optional[float]] = [start_us] * P   # set while a rank waits for an input
    busy_us = [0.0] * P
    end_us = [start_us] * P
    events: list = []
    sequence = itertools.count()

    def push(time, kind, rank, task=None):
        heapq.heappush(events, (time, kind, next(sequence), rank, task))

    def request_decision(time, rank):
        if not decision_pending[rank]:
            decision_pending[rank] = True
            push(time, _DECIDE, rank)

    for rank in range(P):
        request_decision(start_us, rank)
    while events:
        now, kind, _, rank, task = heapq.heappop(events)
        state = states[rank]
        if kind == _FINISH:
            state.mark_done(task)
            duration = durations.us(rank, task)
            policies[rank].observe(task, duration / US_PER_S)
            busy[rank] = False
            end_us[rank] = now
            target = table.consumer(rank, task)
            if target is not None:
                peer, consumer_task = target
                _, arrival = network.send(rank, peer, now)
                push(arrival, _ARRIVE, peer, consumer_task)
                if trace is not None:
                    trace.send(rank, iteration, task, peer, now, arrival)
            request_decision(now, rank)
        elif kind == _ARRIVE:
            state.mark_arrived(task)
            if not busy[rank]:
                request_decision(now, rank)
        else:
            decision_pending[rank] = False
            if busy[rank] or state.finished:
                continue
            chosen = policies[rank].next(state)
            if chosen is None:
                if idle_since[rank] is None:
                    idle_since[rank] = now
                continue
            if trace is not None and idle_since[rank] is not None and now > idle_since[rank]:
                trace.wait(rank, iteration, idle_since[rank], now)
            idle_since[rank] = None
            state.mark_started(chosen)
            busy[rank] = True
            duration = durations.us(rank, chosen)
            busy_us[rank] += duration
            if trace is not None:
                trace.compute(rank, iteration, chosen, now, now + duration)
            push(now + duration, _FINISH, rank, chosen)
    if not all(state.finished for state in states):
        raise ScheduleStallError(stall_report(states, policies))
    if trace is not None:
        for rank in range(P):
            trace.iteration(rank, iteration, start_us, end_us[rank])
    return IterationOutcome(iteration=iteration, start_us=start_us, end_us=max(end_us), busy_us=busy_us,
                            peak_activations=[state.peak_activations for state in states],
                            peak_activation_sizes=[state.peak_size for state in states], planning_s=planning_s,
                            orders=[state.done_tasks for state in states])
