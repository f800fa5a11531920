"""Per-iteration plans for variable-length microbatches: Megatron's interleaved order over a chosen microbatch order
(and a chosen warm-up depth), picked by evaluating candidates on predicted task durations under a memory cap.

A plan is (start_order, extra_warmup): start_order is the order in which microbatches enter the pipeline (the same
on every rank), extra_warmup the forwards a rank runs before its first backward beyond Megatron's count (one number
for every rank, or one per rank). Every rank derives its task order from the plan by Megatron's construction
(megatron_order.py), so a plan is cheap to share: it is a function of the lengths and the cost model only
(deterministic search, no clocks, no randomness that is not seeded by the lengths). Per-rank warm-ups can make the
ranks' orders wait on each other; the search rejects such plans (PlanGraph.acyclic), so every plan it returns
completes whatever the task durations.

Why this family (measured with megatron_app.sim, see BENCHMARKS.md): Megatron's order is the best schedule when all
microbatches cost the same; with variable lengths it loses in the fill and drain phases (a long microbatch first
delays every rank's start, a long one last delays every rank's end) and to convoys in the steady phase. Greedy
readiness-first orders lose more than they win at Megatron's memory. Reordering the microbatches keeps Megatron's
steady 1F1B rhythm, which is what makes it memory-frugal, and the search keeps each rank's peak of held tokens
within the allowed cap. The search itself (measured, BENCHMARKS.md): annealing over start orders and per-rank
warm-ups with a batched evaluator, 528 candidates, finds 1.12x over Megatron's order at P=4 V=2 m=16 (corpus
lengths, 1.0x memory, exact costs) where 150 one-at-a-time pair swaps found 1.07x, in about the same CPU time.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np

from .errors import ScheduleConfigError
from .megatron_order import megatron_slot_order, order_over, order_peak_size  # noqa: F401 (order_peak_size: the one peak function, re-exported)
from .plan_graph import PlanGraph
from .shape import PipelineShape
from .tasks import Task

# durations[kind index (Kind.index): 0 forward, 1 backward, 2 weight][chunk][microbatch] -> predicted time (any unit, the same for all)
# (or [kind][rank * V + chunk][microbatch]: a duration per pipeline rank, plan_graph.PlanGraph.evaluate)
DurationTable = Sequence[Sequence[Sequence[float]]]

DEFAULT_EVALUATIONS = 528       # 16 seeded candidates + 16 rounds of 32 neighbours (BATCH): about 1.5% of an iteration (BENCHMARKS.md)
BATCH = 32
MAX_EXTRA_WARMUP = 3
TEMPERATURE = 0.01               # x the best seeded makespan: how much worse a neighbour may be and still be taken
_WARMUP_MOVE_SHARE = 0.3         # rounds that also change one rank's warm-up


@dataclass(frozen=True)
class Plan:
    start_order: Tuple[int, ...]
    extra_warmup: Union[int, Tuple[int, ...]] = 0      # the same for every rank, or one per rank

    def extra_for(self, rank: int) -> int:
        return self.extra_warmup if isinstance(self.extra_warmup, int) else self.extra_warmup[rank]

    def check(self, shape: PipelineShape) -> None:
        """Raise ScheduleConfigError unless this plan names every microbatch once and valid warm-ups."""
        m, P = shape.num_microbatches, shape.num_stages
        if sorted(self.start_order) != list(range(m)):
            raise ScheduleConfigError(f"a plan must order microbatches 0..{m - 1} once each, got "
                                      f"{list(self.start_order)}")
        per_rank = isinstance(self.extra_warmup, tuple)
        extras = list(self.extra_warmup) if per_rank else [self.extra_warmup]
        if (per_rank and len(extras) != P) or not all(
                isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in extras):
            raise ScheduleConfigError(f"a plan's extra warm-up must be an int >= 0 or one per rank ({P}), got "
                                      f"{self.extra_warmup!r}")

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
    """Rank `rank`'s forwards and backwards under `plan`: Megatron's interleaved order (1F1B when V == 1) over
    plan.start_order, with the plan's extra warm-up (W tasks, when split, are placed by the policy at run time)."""
    return order_over(_slot_order(shape, rank, plan.extra_for(rank)), plan.start_order)


def _slot_order(shape: PipelineShape, rank: int, extra_warmup: int):
    return megatron_slot_order(shape, rank, extra_warmup, with_weights=False)


def predicted_makespan(shape: PipelineShape, orders: Sequence[Sequence[Task]], durations: DurationTable,
                       transfer: float = 0.0) -> float:
    """Makespan when every rank runs its order as listed, tasks take `durations` (a table per kind, as the plan
    search's), messages `transfer`; inf when the orders deadlock. The plan evaluator (PlanGraph) on these orders,
    with each microbatch in its own slot."""
    slot_orders = [tuple((task.kind, task.chunk, task.microbatch) for task in order) for order in orders]
    graph = PlanGraph(shape, (0,) * shape.num_stages, slot_orders)
    m = shape.num_microbatches
    table = _stacked(durations)
    makespans, _ = graph.evaluate(np.arange(m, dtype=np.int64)[None, :], table, np.zeros(m),
                                  [float("inf")] * shape.num_stages, transfer)
    return float(makespans[0])


class PlanSearch:
    """Chooses a Plan for one iteration's lengths: the data order and a few seeded orders (ascending cost, short at
    both ends, alternating short/long), each with the same 0..max_extra_warmup extra warm-up forwards on every rank,
    then simulated annealing from the best: each round evaluates `batch` neighbours of the current plan at once
    (PlanGraph) -- one pair swap, move or reversed run of the start order each, sometimes with one rank's warm-up
    one deeper or shallower -- and moves to the best of them when it is better, or with a probability that falls
    with the loss and the remaining budget. Seeded by the lengths and costs (deterministic); bounded by
    `evaluations` or `stop`, asked before each round."""

    def __init__(self, shape: PipelineShape, evaluations: int = DEFAULT_EVALUATIONS,
                 max_extra_warmup: int = MAX_EXTRA_WARMUP, batch: int = BATCH, temperature: float = TEMPERATURE):
        self.shape = shape
        self.evaluations = evaluations
        self.max_extra_warmup = max_extra_warmup
        self.batch = batch
        self.temperature = temperature

    def choose(self, sizes: Sequence[float], caps: Sequence[float], durations: DurationTable,
               transfer: float = 0.0, stop: Optional[Callable[[float], bool]] = None,
               seeded: Optional[PlanChoice] = None) -> PlanChoice:
        """sizes: activation size per microbatch; caps: per rank, the peak of held sizes a plan may reach;
        stop: asked before each round with the data order's predicted makespan (a driver's time budget, which may
        be a share of the iteration being planned: policies read no clocks). seeded: what a search with no rounds
        (evaluations=0) and the same max_extra_warmup returned for these same arguments (a screen): its seeds are
        not evaluated again, and the search goes on from there as it would have."""
        shape = self.shape
        P, m = shape.num_stages, shape.num_microbatches
        table = _stacked(durations)
        size_array = np.asarray(sizes, dtype=float)
        count = 0

        def evaluate(extras: Tuple[int, ...], orders: np.ndarray):
            nonlocal count
            count += len(orders)
            return _graph(shape, extras).evaluate(orders, table, size_array, caps, transfer)

        work = table.sum(axis=0)
        ascending = tuple(sorted(range(m), key=lambda i: (work[i], i)))
        seeds = np.array([tuple(range(m)), ascending, _short_ends(ascending), _alternating(ascending)],
                         dtype=np.int64)
        best = None                              # (makespan, start order, extras, peaks)
        if seeded is not None:
            count = seeded.evaluations
            data_makespan = seeded.predicted_data_order_makespan
            best = (seeded.predicted_makespan, np.array(seeded.plan.start_order, dtype=np.int64),
                    tuple(seeded.plan.extra_for(rank) for rank in range(P)), np.array(seeded.admission_needs))
        for extra in range(self.max_extra_warmup + 1 if seeded is None else 0):
            extras = (extra,) * P
            values, peaks = evaluate(extras, seeds)
            if extra == 0:
                data_makespan = float(values[0])
            index = int(np.argmin(values))
            if best is None or values[index] < best[0]:
                best = (float(values[index]), seeds[index].copy(), extras, peaks[index])
        current = best
        rng = np.random.default_rng(_seed_of(sizes, work))
        scale = self.temperature * best[0] if np.isfinite(best[0]) else 0.0
        while count + self.batch <= self.evaluations and not (stop is not None and stop(data_makespan)):
            extras = current[2]
            if self.max_extra_warmup > 0 and rng.random() < _WARMUP_MOVE_SHARE:
                changed = list(extras)
                rank = int(rng.integers(P))
                changed[rank] = int(min(self.max_extra_warmup, max(0, changed[rank] + rng.choice((-1, 1)))))
                extras = tuple(changed)
            candidates = np.repeat(current[1][None, :], self.batch, axis=0)
            _move(candidates[1 if extras != current[2] else 0:], rng)
            values, peaks = evaluate(extras, candidates)
            index = int(np.argmin(values))
            value = float(values[index])
            heat = scale * max(0.0, 1.0 - count / self.evaluations)
            if value < current[0] or (np.isfinite(value) and heat > 0
                                      and rng.random() < np.exp(-(value - current[0]) / heat)):
                current = (value, candidates[index].copy(), extras, peaks[index])
                if value < best[0]:
                    best = current
        value, order, extras, peaks = best
        plan = Plan(tuple(int(mb) for mb in order), extras[0] if len(set(extras)) == 1 else extras)
        return PlanChoice(plan, value, data_makespan, tuple(float(p) for p in peaks), count)


def _stacked(durations: DurationTable) -> np.ndarray:
    """A DurationTable as the plan evaluator's one table: the kinds' rows one after the other."""
    return np.array([list(row) for per_kind in durations for row in per_kind], dtype=float)


@functools.lru_cache(maxsize=512)
def _graph(shape: PipelineShape, extras: Tuple[int, ...]) -> PlanGraph:
    return PlanGraph(shape, extras, [_slot_order(shape, rank, extra) for rank, extra in enumerate(extras)])


def plan_graph_for(shape: PipelineShape, extras: Tuple[int, ...]) -> PlanGraph:
    """The (cached) evaluator graph of plans with these per-rank warm-ups: the search's, for a plan's timeline."""
    return _graph(shape, tuple(extras))


def _move(orders: np.ndarray, rng: np.random.Generator) -> None:
    """One random neighbour per row, in place: swap two microbatches, move one, or reverse the run between two."""
    rows, m = orders.shape
    if m < 2 or rows == 0:
        return
    first = rng.integers(m, size=rows)
    second = rng.integers(m - 1, size=rows)
    second += second >= first                 # two distinct positions
    kinds = rng.integers(3, size=rows)
    for row, a, b, kind in zip(orders, first.tolist(), second.tolist(), kinds.tolist()):
        i, j = (a, b) if a < b else (b, a)
        if kind == 0:
            row[i], row[j] = row[j], row[i]
        elif kind == 1:
            moved = row[i]                                  # i moves to j
            row[i:j] = row[i + 1:j + 1].copy()
            row[j] = moved
        else:
            row[i:j + 1] = row[i:j + 1][::-1].copy()


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
