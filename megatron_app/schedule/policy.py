"""The Policy interface: given a RankState, which task should this rank run next?

Policies never change the state: the driver (runtime, simulator or schedule.driver) calls mark_started / mark_done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

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

    # Planning policies choose each iteration's plan on one rank and every rank adopts it (the simulator hands it
    # over, the runtime broadcasts it); for the others both calls do nothing.
    plans_iterations = False

    def plan_iteration(self, lengths: Optional[Sequence[int]],
                       stop: Optional[Callable[[float], bool]] = None) -> Optional[Plan]:
        """The plan for the next iteration, given its microbatch lengths (None: not told). stop(predicted_s), when
        given, is asked during the search with the predicted iteration time in seconds; True ends the search."""
        return None

    def use_plan(self, lengths: Optional[Sequence[int]], plan: Optional[Plan],
                 squared_tokens: Optional[Sequence[float]] = None) -> None:
        """Adopt `plan` (from some rank's plan_iteration) for the next iteration."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, memory_cap={self.memory_cap})"
