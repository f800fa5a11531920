"""`planned` (the default policy): per iteration, choose the microbatch order and each rank's warm-up depth from the
microbatches' lengths under an activation-memory cap (plan_search.py), then run it like `adaptive` (keep the plan
while it is on time, let a critical backward go first when a plan input is late).

  * Costs: duration = f(tokens) per (kind, chunk), learnt from observe() (length_costs.py).
  * Memory: a chunk's activation is sized by its microbatch's tokens; the cap per rank is memory_factor x the peak
    of held tokens that Megatron's interleaved order reaches on that rank for the same microbatches in data order.
    The plan's own peak must stay within it (plan_search.py); run-time deviations are backwards only, which free
    memory, so the peak never exceeds the plan's.
  * Agreement: one rank plans (iteration_plan.plan_iteration; for lengths told alone plan_told_microbatches) and
    every rank adopts that plan (use_plan): the simulator hands it over, the runtime broadcasts it. Each rank's
    order is then Megatron's order over the same microbatch order, so all orders together complete (adaptive.py's
    argument (a)) whatever each rank learnt.
  * Without lengths (a loop that tells none) or under an explicit count cap (memory_cap), the plan is Megatron's
    order in data order: the policy is then `adaptive` exactly.
  * `planned-fixed` is the same policy with run-time reordering off (deviates=False, adaptive.py): the same plans,
    each rank waiting for its plan's next task (W's of a split backward still fill the waits). Under the default
    cap it runs every rank's plan order exactly, which completes by adaptive.py's argument (a) (no backward moved);
    it is the comparison row for what deviating at run time buys (tools/bench_straggler.py).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from .adaptive import DEFAULT_PATIENCE, AdaptivePolicy, plan_peak
from .admission import check_memory_cap
from .errors import ScheduleConfigError
from .length_costs import LengthCostModel
from .megatron_order import megatron_interleaved_cap, megatron_order, megatron_peak_sizes, without_fill  # noqa: F401 (megatron_peak_sizes re-exported)
from .plan_search import DEFAULT_EVALUATIONS, Plan, plan_graph_for, plan_order
from .greedy import make_dfc
from .shape import PipelineShape
from .state import RankState
from .tasks import KINDS_BY_INDEX, Kind, Task

DEFAULT_MEMORY_FACTOR = 1.0
FIXED_NAME = "planned-fixed"   # the registry's name for PlannedPolicy(deviates=False)


def check_memory_factor(memory_factor) -> float:
    if isinstance(memory_factor, bool) or not isinstance(memory_factor, (int, float)) or not memory_factor >= 1.0:
        raise ScheduleConfigError(f"memory factor must be a number >= 1 (x Megatron's peak activation bytes), "
                                  f"got {memory_factor!r}")
    return float(memory_factor)


class PlannedPolicy(AdaptivePolicy):
    name = "planned"
    plans_iterations = True

    def __init__(self, shape: PipelineShape, rank: int, memory_cap: Optional[int] = None,
                 memory_factor: Optional[float] = None, evaluations: int = DEFAULT_EVALUATIONS,
                 patience: int = DEFAULT_PATIENCE, deviates: bool = True):
        """deviates: False = `planned-fixed` (run-time reordering off; module doc)."""
        self.reorders = memory_cap is None     # an explicit count cap keeps data order (module doc)
        if memory_cap is None:
            memory_cap = megatron_interleaved_cap(shape, rank)
        check_memory_cap(shape, memory_cap)
        super().__init__(shape, rank, memory_cap, without_fill(megatron_order(shape, rank)),
                         below_plan_cap=make_dfc(shape, rank, memory_cap),
                         keeps_oldest_moving=not self.reorders, patience=patience, deviates=deviates)
        if not deviates:
            self.name = FIXED_NAME
        self.memory_factor = check_memory_factor(DEFAULT_MEMORY_FACTOR if memory_factor is None else memory_factor)
        self.costs = LengthCostModel()
        self.evaluations = evaluations        # the order search's budget (iteration_plan.PipelineSpec)
        self.lengths: Optional[Tuple[int, ...]] = None
        self.squared_tokens: Optional[Tuple[float, ...]] = None
        self.current_plan = Plan(tuple(range(shape.num_microbatches)))
        self.predicted: Dict[Task, Tuple[float, float]] = {}   # this iteration's tasks as the plan predicts them

    # ---- adoption (every rank) -----------------------------------------------------------------------------------
    @property
    def orders_told_lengths(self) -> bool:
        """Whether a call told only its lengths gets a planned order (iteration_plan.plan_told_microbatches, on one
        rank): not under an explicit count cap, which keeps data order (module doc), nor for a forward-only call."""
        return self.reorders and not self.shape.forward_only

    def use_plan(self, lengths: Optional[Sequence[int]], plan: Optional[Plan],
                 squared_tokens: Optional[Sequence[float]] = None) -> None:
        """Run the next iteration (next fresh RankState) by `plan` (None: data order); lengths (tokens) and
        squared_tokens (per microbatch, the sum of its attention blocks' squared lengths; None: one block of its
        length) feed learning."""
        self.costs.start_call(self.rank)   # the rank's first call warms up (length_costs._Fit)
        self.lengths = None if lengths is None else _check_lengths(self.shape, lengths)
        self.squared_tokens = None if squared_tokens is None or lengths is None else tuple(squared_tokens)
        plan = plan or Plan(tuple(range(self.shape.num_microbatches)))
        plan.check(self.shape)
        if plan != self.current_plan:
            order = plan_order(self.shape, self.rank, plan)
            self.current_plan = plan
            self.plan = order
            self._position = {task: index for index, task in enumerate(order)}
            self.follows_plan = self.reorders or self.memory_cap >= plan_peak(self.shape, order)
            self._state = None     # re-synchronise the cursor on the next state
        self.predicted = self._predicted_timeline(plan)

    def _predicted_timeline(self, plan: Plan) -> Dict[Task, Tuple[float, float]]:
        """This rank's tasks under `plan` as the learnt costs predict them: task -> (start, duration) in seconds
        from the iteration's start, every rank assumed to cost what this one learnt (empty before any cost was
        learnt or without lengths)."""
        shape = self.shape
        if self.lengths is None or not self.costs.calibrated or shape.forward_only:
            return {}
        squared = self.squared_tokens or [length * length for length in self.lengths]
        table = self.costs.duration_table((Kind.FORWARD, Kind.BACKWARD), shape.num_chunks, self.lengths, squared,
                                          num_stages=shape.num_stages)
        extras = tuple(plan.extra_for(rank) for rank in range(shape.num_stages))
        graph = plan_graph_for(shape, extras)
        if not graph.acyclic:
            return {}
        gap = self.costs.gap_seconds(self.rank)   # in the table's durations, not in a task's own span
        return {Task(KINDS_BY_INDEX[kind], chunk, microbatch): (start, duration - gap)
                for kind, chunk, microbatch, start, duration in graph.timeline(self.rank, plan.start_order, table)}

    # ---- learning -----------------------------------------------------------------------------------------------
    def observe_gap(self, seconds_per_task: float) -> None:
        self.costs.observe_gap(seconds_per_task, rank=self.rank, warmup=self.costs.warming_up(self.rank))

    def observe(self, task: Task, duration_s: float) -> None:
        super().observe(task, duration_s)
        if self.lengths is not None:
            squared = None if self.squared_tokens is None else self.squared_tokens[task.microbatch]
            self.costs.observe(task.kind, task.chunk, self.lengths[task.microbatch], duration_s, squared,
                               rank=self.rank, warmup=self.costs.warming_up(self.rank))

    def _fits(self, state: RankState, task: Task) -> bool:
        # With reordering every rank runs the same plan, whose peak was checked against the byte cap when it was
        # chosen; the count cap (Megatron's) does not bound a plan with extra warm-up. The plan's peak counts each W
        # right after its B, so with a split backward a forward waits for the ready W's (they free memory first).
        if self.reorders:
            return task.kind is not Kind.FORWARD or not state.ready_fill()
        return super()._fits(state, task)


def _check_lengths(shape: PipelineShape, lengths: Sequence[int]) -> Tuple[int, ...]:
    values = tuple(lengths)
    if len(values) != shape.num_microbatches or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0 for v in values):
        raise ScheduleConfigError(f"need {shape.num_microbatches} positive microbatch lengths, got {list(values)!r}")
    return values


def make_planned(shape: PipelineShape, rank: int, memory_cap: Optional[int] = None,
                 memory_factor: Optional[float] = None) -> PlannedPolicy:
    return PlannedPolicy(shape, rank, memory_cap, memory_factor=memory_factor)


def make_planned_fixed(shape: PipelineShape, rank: int, memory_cap: Optional[int] = None,
                       memory_factor: Optional[float] = None) -> PlannedPolicy:
    """`planned` with run-time reordering off: each rank waits for its plan's next task."""
    return PlannedPolicy(shape, rank, memory_cap, memory_factor=memory_factor, deviates=False)
