"""The Policy interface: given a RankState, which task should this rank run next?

Policies never change the state: the driver (runtime, simulator or schedule.driver) calls mark_started / mark_done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from .shape import PipelineShape
from .state import RankState
from .tasks import Task

if TYPE_CHECKING:    # plan_search's Plan, for the signatures only
    from .plan_search import Plan


class Policy:
    """Base: `next` decides; `expected_next` names the task a static order waits for; `observe` may learn."""

    name = "policy"

    def __init__(self, shape: PipelineShape, rank: int, memory_cap: int):
        shape.check_rank(rank)
        self.shape = shape
        self.rank = rank
        self.memory_cap = memory_cap

    def next(self, state: RankState) -> Optional[Task]:
        raise NotImplementedError

    def expected_next(self, state: RankState) -> Optional[Task]:
        return None

    def observe(self, task: Task, duration_s: float) -> None:
        """Called after each task with its measured duration; adaptive cost models override it."""

    def observe_gap(self, seconds_per_task: float) -> None:
        """Called after each call with its time between tasks, per task (length_costs.observe_gap); cost models
        that plan override it."""

    # Planning policies adopt each iteration's plan, chosen on one rank (schedule/iteration_plan.py: the simulator
    # hands it over, the runtime broadcasts it); for the others use_plan does nothing.
    plans_iterations = False
    orders_told_lengths = False   # a call told only its lengths gets a planned order (planned.py)

    def use_plan(self, lengths: Optional[Sequence[int]], plan: Optional[Plan],
                 squared_tokens: Optional[Sequence[float]] = None) -> None:
        """Adopt `plan` (iteration_plan's, chosen on some rank; None: data order) for the next iteration."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, memory_cap={self.memory_cap})"
