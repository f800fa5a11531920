"""`adaptive`: Megatron's own per-rank order as the plan, kept while it is on time; a late plan input lets a ready
backward that is at least as critical run first. Learns task durations from observe() to rank criticality.

Why this shape (measured with megatron_app.sim; numbers in tests/test_sim_scenarios.py and the sim's report):
  * With uniform costs Megatron's order meets the path lower bound (sim/bounds.py): no schedule beats it there.
  * Greedy policies (dfc/bfc: run any ready task at once) lose 5-45% to it, worst when messages take time: every
    plan input is then a little late, and running something else in the gap derails the pipeline. So the plan
    is left only after the rank stayed idle through `patience` arrivals of other inputs (clock-free evidence
    that the input is really late: policies read no clocks).
  * A deviation can delay the planned task by its whole duration, so it must be at least as critical: only a
    backward whose remaining dependency chain (estimated from the learned (kind, chunk) costs) is at least the
    planned task's. Backwards only: each frees an activation early, so the plan's forwards stay within the cap.
  * Below the plan's memory need (a cap smaller than Megatron's peak) the plan cannot be kept; the policy then
    delegates to dfc, which was the fastest greedy order under such caps (bfc was 5-70% slower there).

Deadlock freedom. Every forward passes forward_fits (admission.py); Megatron's order passes it at its own peak
(tested) and early backwards only lower what is held. (a) Default cap: every rank runs its plan order with some
ready backwards moved earlier. Megatron's orders complete with asynchronous sends, so dependencies plus per-rank
plan orders form an acyclic graph; removing finished tasks keeps it acyclic, so while tasks remain a lowest one is
ready, is its rank's plan-next, fits, and runs. (b) An explicit cap may leave some ranks below their plan (dfc)
while others follow it, and (a) no longer holds; so with an explicit cap a rank that chooses nothing else runs a
ready task of its oldest in-flight microbatch (or of the next one to start). By admission.py the globally lowest
unfinished microbatch g is exactly that microbatch on the rank holding g's next task, and that task fits: g always
progresses. (That guard costs up to ~3% at V=1 under a slow rank, which is why the default case goes without it.)

When it fires. A deviation needs a ready backward behind the late planned one. Every rank's plan (Megatron's order,
or `planned`'s over a start order) takes its backward inputs in the (chunk, microbatch) sequence in which its one
gradient source sends them, and a link delivers in order (the transport sends one message at a time per peer; the
simulator's links are FIFO), so a late planned backward has no ready backward behind it, and a ready backward behind a
late planned forward may not jump it (its chain is shorter). So with in-order links the step finds nothing to run:
in the simulator, under slow ranks, jitter, stragglers and slow links, it never fired and `planned` ran the same
orders as `planned-fixed` (tests/test_schedule_run_time_reordering.py). It acts when inputs arrive out of plan order
(the property tests' random delivery). `deviations` counts the tasks it moved.

Run-time reordering off (`deviates=False`, the policy `planned-fixed`): the deviation step above is skipped, so a
rank whose plan input is late waits for it (W's still fill the wait) and, under the default cap, runs exactly its
plan order, forwards and backwards (the comparison row that measures what run-time reordering buys). Argument (a)
covers it unchanged: it is the case with no backward moved earlier. With an explicit cap the progress guard of (b)
stays (it is what makes mixed plan-following and dfc ranks complete, not a choice made for speed).

Split backward (W tasks). The plan holds forwards and B's only; W's float. The rank runs its plan's next task when it
is ready and admitted; otherwise it fills the wait with a W (a W is never on another rank's path, B is); a ready
backward deviates as above only once the plan's input stayed late through `patience` decisions (a W that ends
counts as one), since a critical B then beats a W; a planned forward that does not fit because W's hold memory runs
the oldest W first; once the plan is done the remaining W's run. Deadlock freedom: a ready W never waits on
another rank (admission.py rule (3)), and after its ready W's the rank holds what the whole-backward plan holds at
that point, where (a) and (b) apply unchanged.
Default cap with a split backward: the pipeline's peak (Megatron's rank 0 peak) on every rank, as ZB-H1 does. At
each rank's own Megatron peak a W cannot be deferred past the next forward, and with uniform costs the policy then
runs exactly Megatron's order (measured in the logical driver: P=4, V=1, m=8, F=B=W=1: 30 task-times at the per-rank
cap, 27 at the pipeline's, which is ZB-H1's 3m + P - 1). A smaller explicit cap trades that back.
"""

from __future__ import annotations

from typing import Dict, Optional, Set, Tuple

from .admission import check_memory_cap, forward_fits
from .errors import ScheduleConfigError
from .megatron_order import (megatron_interleaved_cap, megatron_order, megatron_pipeline_cap,
                             peak_activations_of_order, with_fill_after_sources, without_fill)
from .greedy import make_dfc
from .policy import Policy
from .shape import PipelineShape
from .state import RankState
from .tasks import Kind, Task

DEFAULT_PATIENCE = 1
DEFAULT_SMOOTHING = 0.3
# Relative costs assumed before the first observation (a backward is about twice a forward).
# A split backward's B and W are each about a forward.
_PRIOR_SECONDS = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0, Kind.WEIGHT: 1.0}


class DurationEstimates:
    """Exponential moving average of observed task durations per (kind, chunk)."""

    def __init__(self, smoothing: float = DEFAULT_SMOOTHING):
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 < smoothing <= 1.0:
            raise ScheduleConfigError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = float(smoothing)
        self._seconds: Dict[Tuple[Kind, int], float] = {}

    def observe(self, task: Task, duration_s: float) -> None:
        if not duration_s >= 0.0:   # also rejects NaN
            raise ScheduleConfigError(f"observed duration of {task} must be >= 0 seconds, got {duration_s!r}")
        key = (task.kind, task.chunk)
        old = self._seconds.get(key)
        self._seconds[key] = duration_s if old is None else old + self.smoothing * (duration_s - old)

    def seconds(self, kind: Kind, chunk: int) -> float:
        """The estimate. Before (kind, chunk) was seen: the kind's mean over the chunks seen, else the other
        kind's mean scaled by the prior ratio (a backward is about twice a forward), else that prior alone."""
        value = self._seconds.get((kind, chunk))
        if value is not None:
            return value
        for source in (kind, *(other for other in _PRIOR_SECONDS if other is not kind)):
            seen = [v for (k, _), v in self._seconds.items() if k is source]
            if seen:
                return sum(seen) / len(seen) * _PRIOR_SECONDS[kind] / _PRIOR_SECONDS[source]
        return _PRIOR_SECONDS[kind]


class AdaptivePolicy(Policy):
    name = "adaptive"

    def __init__(self, shape: PipelineShape, rank: int, memory_cap: int, plan: Tuple[Task, ...],
                 below_plan_cap: Policy, keeps_oldest_moving: bool = True, patience: int = DEFAULT_PATIENCE,
                 smoothing: float = DEFAULT_SMOOTHING, deviates: bool = True):
        """plan: every task of the rank in an order that completes when all ranks follow theirs (the deadlock
        argument above needs that; make_adaptive passes Megatron's); below_plan_cap: the policy used when
        memory_cap is under the plan's peak; keeps_oldest_moving: when nothing else is chosen, run a ready task
        of the oldest microbatch here (needed unless every rank is known to follow its plan; module doc);
        deviates: False turns run-time reordering off (a late plan input is waited for; module doc)."""
        super().__init__(shape, rank, memory_cap)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ScheduleConfigError(f"patience must be an int >= 0, got {patience!r}")
        if not isinstance(deviates, bool):
            raise ScheduleConfigError(f"deviates must be True or False, got {deviates!r}")
        planned_tasks = [task for task in shape.tasks(rank) if task.kind not in shape.fill_kinds]
        if sorted(plan, key=_task_key) != sorted(planned_tasks, key=_task_key):
            raise ScheduleConfigError(f"the plan for rank {rank} must list each of its tasks exactly once (W "
                                      f"tasks excepted: they are not planned)")
        self.plan = tuple(plan)
        self.patience = patience
        self.deviates = deviates
        self.deviations = 0       # tasks run ahead of the plan (run-time reordering) since the policy was made
        self.estimates = DurationEstimates(smoothing)
        self.follows_plan = memory_cap >= plan_peak(shape, self.plan)
        self.below_plan_cap = below_plan_cap
        self.keeps_oldest_moving = keeps_oldest_moving
        self._position = {task: index for index, task in enumerate(self.plan)}
        # Per-RankState bookkeeping: RankState has no "was this started" query, and one policy object may serve
        # several iterations, each with a fresh state.
        self._state: Optional[RankState] = None
        self._started: Set[Task] = set()
        self._cursor = 0          # plan index of the first task not started
        self._idle_calls = 0      # next() answers of None since the last task was handed out

    # ---- learning ---------------------------------------------------------------------------------------------
    def observe(self, task: Task, duration_s: float) -> None:
        self.estimates.observe(task, duration_s)
        self.below_plan_cap.observe(task, duration_s)

    def chain_after_seconds(self, task: Task) -> float:
        """Estimated work that must still follow `task` on its microbatch's dependency chain (the remaining
        forward stages, then the backward ones), assuming every rank's chunk costs what this rank measured."""
        P, V = self.shape.num_stages, self.shape.num_chunks
        stage = self.shape.virtual_stage(self.rank, task.chunk)
        backward = [self.estimates.seconds(Kind.BACKWARD, c) for c in range(V)]
        if task.kind is Kind.BACKWARD:
            return sum(backward[v // P] for v in range(stage))
        forward = [self.estimates.seconds(Kind.FORWARD, c) for c in range(V)]
        return sum(forward[v // P] for v in range(stage + 1, V * P)) + sum(backward) * P

    # ---- decisions ----------------------------------------------------------------------------------------
    def expected_next(self, state: RankState) -> Optional[Task]:
        """The plan's next task (None below the plan's cap, where no order is followed)."""
        if not self.follows_plan:
            return None
        self._sync(state)
        return self.plan[self._cursor] if self._cursor < len(self.plan) else None

    def next(self, state: RankState) -> Optional[Task]:
        if not self.follows_plan:
            return self.below_plan_cap.next(state)
        planned = self.expected_next(state)
        if planned is None:    # the plan is done; W's left (split backward) close the iteration
            fill = state.ready_fill()
            return fill[0] if fill else None
        choice = self._choose(state, planned)
        if choice is None or choice.kind in self.shape.fill_kinds:
            self._idle_calls += 1     # a W fills a wait for the plan's input: the wait goes on
        else:
            self._idle_calls = 0
        if choice is not None:
            self._started.add(choice)     # the driver starts it right away; _sync checks that it did
            self._advance_cursor()
        return choice

    def _choose(self, state: RankState, planned: Task) -> Optional[Task]:
        fill = state.ready_fill()
        if state.is_ready(planned):
            if self._fits(state, planned):
                return planned
            if fill:                # W's hold the memory the planned forward needs
                return fill[0]
        if self.deviates and self._idle_calls >= self.patience:
            deviation = self._critical_backward(state, floor=self.chain_after_seconds(planned))
            if deviation is not None:
                self.deviations += 1
                return deviation
        if fill:
            return fill[0]
        return self._oldest_microbatch_task(state) if self.keeps_oldest_moving else None

    def _fits(self, state: RankState, task: Task) -> bool:
        return task.kind is not Kind.FORWARD or forward_fits(state, task, self.memory_cap)

    def _critical_backward(self, state: RankState, floor: float) -> Optional[Task]:
        """The ready backward with the longest remaining chain, if that chain is at least `floor`."""
        best, best_key = None, None
        for task in state.ready():
            if task.kind is Kind.BACKWARD:
                chain = self.chain_after_seconds(task)
                key = (chain, -self._position[task])
                if chain >= floor and (best_key is None or key > best_key):
                    best, best_key = task, key
        return best

    def _oldest_microbatch_task(self, state: RankState) -> Optional[Task]:
        """A ready, admissible task of the lowest microbatch in flight here (or of the next one to start when none
        is). This is what guarantees progress when other ranks do not follow the plan (see the module doc)."""
        in_flight = state.in_flight_microbatches()
        oldest = in_flight[0] if in_flight else state.lowest_unstarted_microbatch
        for task in state.ready():
            if task.microbatch == oldest and self._fits(state, task):
                return task
        return None

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def _sync(self, state: RankState) -> None:
        """Re-read which tasks are started when the state is new or was advanced by someone else."""
        if state is self._state and state.started_count == len(self._started):
            return
        self._state = state
        self._started = set(state.done_tasks) | set(state.in_progress)
        self._cursor = 0
        self._idle_calls = 0
        self._advance_cursor()

    def _advance_cursor(self) -> None:
        while self._cursor < len(self.plan) and self.plan[self._cursor] in self._started:
            self._cursor += 1


def _task_key(task: Task):
    return task.kind.value, task.chunk, task.microbatch


def plan_peak(shape: PipelineShape, plan) -> int:
    """Peak activations of a forward/backward plan, each W counted as running right after its B."""
    return peak_activations_of_order(shape, with_fill_after_sources(shape, plan))


def make_adaptive(shape: PipelineShape, rank: int, memory_cap: Optional[int] = None,
                  patience: int = DEFAULT_PATIENCE) -> AdaptivePolicy:
    """The `adaptive` policy for one rank; memory_cap None = Megatron's interleaved peak (as for dfc/bfc)."""
    # With the default cap every rank runs its plan at Megatron's peak, so each knows the others follow theirs.
    # An explicit cap may differ between ranks (some below their plan), so progress must be guarded.
    guarded = memory_cap is not None
    if memory_cap is None:   # the pipeline's peak for a split backward (module doc); every rank follows its plan
        memory_cap = megatron_pipeline_cap(shape) if shape.split_backward else megatron_interleaved_cap(shape, rank)
    check_memory_cap(shape, memory_cap)
    return AdaptivePolicy(shape, rank, memory_cap, without_fill(megatron_order(shape, rank)),
                          below_plan_cap=make_dfc(shape, rank, memory_cap), keeps_oldest_moving=guarded,
                          patience=patience)
