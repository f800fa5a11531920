"""Per-iteration plans for variable-length microbatches: Megatron's interleaved order over a chosen microbatch order
(and a chosen warm-up depth), picked by evaluating candidates on predicted task durations under a memory cap.

A plan is (start_order, extra_warmup): start_order is the order in which microbatches enter the pipeline (the same
on every rank), extra_warmup the forwards each rank runs before its first backward beyond Megatron's count. Every
rank derives its task order from the plan with megatron-core's own table functions, so a plan is cheap to share:
it is a function of the lengths and the cost model only (deterministic search, no clocks, no randomness that is not
seeded by the lengths).

Why this family (measured with megatron_app.sim, see BENCHMARKS.md): Megatron's order is the best schedule when all
microbatches cost the same; with variable lengths it loses in the fill and drain phases (a long microbatch first
delays every rank's start, a long one last delays every rank's end) and to convoys in the steady phase. Greedy
readiness-first orders lose more than they win at Megatron's memory. Reordering the microbatches keeps Megatron's
steady 1F1B rhythm, which is what makes it memory-frugal, and the search keeps each rank's admission need (the cap
under which admission.py lets the plan run unchanged) within the allowed cap.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from .megatron_order import megatron_forward_sequence, megatron_warmup_microbatches
from .shape import PipelineShape
from .tasks import Kind, Task

# durations[kind index: 0 forward, 1 backward][chunk][microbatch] -> predicted time (any unit, the same for all)
DurationTable = Sequence[Sequence[Sequence[float]]]

DEFAULT_EVALUATIONS = 150


@dataclass(frozen=True)
class Plan:
    start_order: Tuple[int, ...]
    extra_warmup: int = 0

    def describe(self) -> str:
        return f"start order {list(self.start_order)}, extra warm-up {self.extra_warmup}"


@dataclass(frozen=True)
class PlanChoice:
    plan: Plan
    predicted_makespan: float
    predicted_data_order_makespan: float
    admission_needs: Tuple[float, ...]      # per rank
    evaluations: int


def plan_order(shape: PipelineShape, rank: int, plan: Plan) -> Tuple[Task, ...]:
    """Rank `rank`'s tasks under `plan`: Megatron's interleaved order (1F1B when V == 1) over plan.start_order."""
    return tuple(Task(kind, chunk, plan.start_order[slot])
                 for kind, chunk, slot in _slot_order(shape, rank, plan.extra_warmup))


@functools.lru_cache(maxsize=256)
def _slot_order(shape: PipelineShape, rank: int, extra_warmup: int) -> Tuple[Tuple[Kind, int, int], ...]:
    """Megatron's order with microbatches named by their entry slot, and `extra_warmup` more warm-up forwards
    (the same construction as megatron_order.py, with a deeper warm-up)."""
    V = shape.num_chunks
    sequence = megatron_forward_sequence(shape)
    forwards = [(Kind.FORWARD, chunk, slot) for slot, chunk in sequence]
    backwards = [(Kind.BACKWARD, V - 1 - chunk, slot) for slot, chunk in sequence]
    warmup = min(megatron_warmup_microbatches(shape, rank) + extra_warmup, len(forwards))
    order = forwards[:warmup]
    for k, forward in enumerate(forwards[warmup:]):
        order += (forward, backwards[k])
    order += backwards[len(forwards) - warmup:]
    return tuple(order)


def order_peak_size(order: Sequence[Task], sizes: Sequence[float]) -> float:
    """Largest sum of held activation sizes while a rank runs `order` (an activation lives from its forward's
    start to its backward's end, or its W's end when the order has W's: a split backward)."""
    releasing = Kind.WEIGHT if any(task.kind is Kind.WEIGHT for task in order) else Kind.BACKWARD
    held = peak = 0.0
    for task in order:
        if task.kind is Kind.FORWARD:
            held += sizes[task.microbatch]
            peak = max(peak, held)
        elif task.kind is releasing:
            held -= sizes[task.microbatch]
    return peak


def predicted_makespan(shape: PipelineShape, orders: Sequence[Sequence[Task]], durations: DurationTable,
                       transfer: float = 0.0) -> float:
    """Makespan when every rank runs its order as listed, tasks take `durations`, messages `transfer`; inf when
    the orders deadlock. (A list evaluation of the dependency graph: no event queue, no policy objects.)"""
    P = shape.num_stages
    steps = [[(task.kind is Kind.FORWARD, task.chunk, task.chunk * P + rank, task.microbatch) for task in order]
             for rank, order in enumerate(orders)]
    return _evaluate(shape, steps, None, durations, transfer)


def _evaluate(shape: PipelineShape, steps, start_order: Optional[Sequence[int]], durations: DurationTable,
              transfer: float) -> float:
    """steps[rank]: (is_forward, chunk, virtual stage, slot) per task; a slot names microbatch start_order[slot]
    (the slot itself when start_order is None)."""
    P, V, m = shape.num_stages, shape.num_chunks, shape.num_microbatches
    last = V * P - 1
    forward_time, backward_time = durations
    done_f = [[None] * m for _ in range(V * P)]
    done_b = [[None] * m for _ in range(V * P)]
    cursor = [0] * P
    free_at = [0.0] * P
    remaining = sum(len(s) for s in steps)
    while remaining:
        progressed = False
        for rank in range(P):
            rank_steps = steps[rank]
            position = cursor[rank]
            free = free_at[rank]
            while position < len(rank_steps):
                is_forward, chunk, vs, slot = rank_steps[position]
                mb = slot if start_order is None else start_order[slot]
                if is_forward:
                    if vs > 0:
                        before = done_f[vs - 1][mb]
                        if before is None:
                            break
                        free = max(before + transfer, free)
                    free += forward_time[chunk][mb]
                    done_f[vs][mb] = free
                else:
                    own = done_f[vs][mb]
                    if own is None:
                        break
                    if vs < last:
                        after = done_b[vs + 1][mb]
                        if after is None:
                            break
                        own = max(own, after + transfer)
                    free = max(own, free) + backward_time[chunk][mb]
                    done_b[vs][mb] = free
                position += 1
            if position != cursor[rank]:
                remaining -= position - cursor[rank]
                cursor[rank] = position
                free_at[rank] = free
                progressed = True
        if not progressed:
            return float("inf")
    return max(free_at)


@functools.lru_cache(maxsize=256)
def _slot_steps(shape: PipelineShape, rank: int, extra_warmup: int):
    P = shape.num_stages
    return tuple((kind is Kind.FORWARD, chunk, chunk * P + rank, slot)
                 for kind, chunk, slot in _slot_order(shape, rank, extra_warmup))


def _slot_peak(steps, start_order: Sequence[int], sizes: Sequence[float]) -> float:
    held = peak = 0.0
    for is_forward, _, _, slot in steps:
        if is_forward:
            held += sizes[start_order[slot]]
            if held > peak:
                peak = held
        else:
            held -= sizes[start_order[slot]]
    return peak


class PlanSearch:
    """Chooses a Plan for one iteration's lengths: the data order, a few seeded orders (ascending cost, short at both
    ends, alternating short/long), each with 0..max_extra_warmup extra warm-up forwards, then a local search of
    pair swaps from the best, seeded by the lengths (deterministic) and bounded by `evaluations` or `stop`."""

    def __init__(self, shape: PipelineShape, evaluations: int = DEFAULT_EVALUATIONS, max_extra_warmup: int = 2):
        self.shape = shape
        self.evaluations = evaluations
        self.max_extra_warmup = max_extra_warmup

    def choose(self, sizes: Sequence[float], caps: Sequence[float], durations: DurationTable,
               transfer: float = 0.0, stop: Optional[Callable[[], bool]] = None) -> PlanChoice:
        """sizes: activation size per microbatch; caps: per rank, the peak of held sizes a plan may reach;
        stop: asked before each local-search step (a driver's time budget: policies read no clocks)."""
        shape = self.shape
        m = shape.num_microbatches
        count = 0

        def score(plan: Plan) -> Tuple[float, Tuple[float, ...]]:
            nonlocal count
            count += 1
            steps = [_slot_steps(shape, rank, plan.extra_warmup) for rank in range(shape.num_stages)]
            needs = tuple(_slot_peak(steps[rank], plan.start_order, sizes) for rank in range(shape.num_stages))
            if any(need > cap * (1 + 1e-9) for need, cap in zip(needs, caps)):
                return float("inf"), needs
            return _evaluate(shape, steps, plan.start_order, durations, transfer), needs

        work = [sum(durations[k][c][i] for k in (0, 1) for c in range(shape.num_chunks)) for i in range(m)]
        data = Plan(tuple(range(m)))
        best_plan, (best, best_needs) = data, score(data)
        data_makespan = best
        ascending = tuple(sorted(range(m), key=lambda i: (work[i], i)))
        seeds = [ascending, _short_ends(ascending), _alternating(ascending)]
        for start_order in seeds:
            for extra in range(self.max_extra_warmup + 1):
                candidate = Plan(start_order, extra)
                value, needs = score(candidate)
                if value < best:
                    best_plan, best, best_needs = candidate, value, needs
        rng = random.Random(_seed_of(sizes, work))
        while count < self.evaluations and not (stop is not None and stop()):
            order = list(best_plan.start_order)
            i, j = rng.sample(range(m), 2)
            order[i], order[j] = order[j], order[i]
            extra = best_plan.extra_warmup
            if rng.random() < 0.25:
                extra = min(self.max_extra_warmup, max(0, extra + rng.choice((-1, 1))))
            candidate = Plan(tuple(order), extra)
            value, needs = score(candidate)
            if value < best:
                best_plan, best, best_needs = candidate, value, needs
        return PlanChoice(best_plan, best, data_makespan, best_needs, count)


def _short_ends(ascending: Sequence[int]) -> Tuple[int, ...]:
    """Shortest microbatches at both ends, longest in the middle (fast fill and fast drain)."""
    front, back = [], []
    for index, mb in enumerate(ascending):
        (front if index % 2 == 0 else back).append(mb)
    return tuple(front + back[::-1])


def _alternating(ascending: Sequence[int]) -> Tuple[int, ...]:
    """Short, long, short, long ... starting with the shortest (spreads long microbatches through the steady
    phase, where a long one next to a short one hides behind it)."""
    low, high = 0, len(ascending) - 1
    result = []
    while low <= high:
        result.append(ascending[low])
        low += 1
        if low <= high:
            result.append(ascending[high])
            high -= 1
    return tuple(result)


def _seed_of(sizes: Sequence[float], work: Sequence[float]) -> int:
    text = ",".join(f"{x:.6g}" for x in list(sizes) + list(work))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
