"""The `balanced` composition: which documents form each microbatch, how many microbatches, their order and each
rank's warm-up, chosen together for one global batch (this replica's share) from the documents' lengths.

For every candidate microbatch count the documents are bin-packed whole (no document split) into cost-balanced
microbatches: longest-processing-time first (each document, most expensive first, into the cheapest microbatch so
far), then local moves and swaps between the most and least expensive microbatch while they narrow the spread. A
document's cost is the learnt per-(kind, chunk) model summed over the pipeline (length_costs.py: linear in tokens
plus attention's square of its own length). Every candidate is then scored by the plan evaluator
(plan_search.PlanSearch over plan_graph.PlanGraph, the one evaluator the `planned` policy uses): a short screening
(seeded orders x warm-ups) for every candidate, the full annealing over order and per-rank warm-ups for the best.
The loader's own microbatches, packed, are always a candidate, so the prediction never loses to them.

Memory: a microbatch's activation is sized by its tokens; each rank's cap is memory_factor x the peak of held tokens
Megatron's interleaved order reaches on that rank for the LOADER's own padded microbatches (what the user runs
today), so a plan holds at most that many activation tokens on every rank.

Microbatch counts: megatron-core 0.16.1's interleaved schedule (pipeline_parallel/schedules.py,
forward_backward_pipelining_with_interleaving) requires, with N = config.microbatch_group_size_per_vp_stage
(default P), P <= N <= m and m % N == 0 or m % N >= P; our PipelineShape enforces the same (and m >= P).
With the default N = P that means m is a multiple of P. Without interleaving (V = 1) any m >= 1 runs. The planner
only considers counts for which PipelineShape accepts the shape (valid_microbatch_counts), and at most one
microbatch per document.

Pure and deterministic: the same lengths and cost model give the same plan (no clocks; the search's seed is a hash
of its inputs). numpy only.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .composition import Composition, loader_composition
from .errors import ScheduleConfigError
from .length_costs import LengthCostModel, by_kind
from .megatron_order import megatron_peak_sizes
from .plan_graph import has_rank_rows
from .plan_search import Plan, PlanChoice, PlanSearch
from .shape import PipelineShape
from .tasks import Kind

PLANNED_KINDS = (Kind.FORWARD, Kind.BACKWARD)     # the evaluator's rows: forward chunks, then whole backwards
DEFAULT_FINAL_EVALUATIONS = 528                   # the full search on the best candidate (plan_search's default)
MAX_CANDIDATE_COUNTS = 10                         # beyond this many valid counts, a spread of them
LOCAL_MOVE_ROUNDS = 200
# Beyond this many tasks per iteration (2 V P x documents, at most one microbatch each) the planner screens fewer
# counts with the data order only and anneals briefly: measured at P=64 V=4 with 4096 documents, the full search
# took 138 s (26% of the predicted iteration), most of it building one PlanGraph per candidate count (~4 s each at
# m ~ 2000); at scale candidates are screened by interleaved_estimate instead and only the chosen one is searched.
LARGE_TASKS = 50_000
LARGE_COUNTS, LARGE_FINAL_EVALUATIONS = 4, 32


@dataclass(frozen=True)
class ComposedPlan:
    composition: Composition          # groups in entry order: microbatch k enters the pipeline k-th
    plan: Plan                        # start order 0..m-1 (the groups are already in order) and warm-ups
    predicted_makespan: float         # in the cost model's unit
    predicted_loader_makespan: float  # the loader's padded microbatches in Megatron's order, same model
    microbatch_tokens: Tuple[int, ...]
    microbatch_squared_tokens: Tuple[int, ...]
    caps: Tuple[float, ...]           # per rank, activation tokens a plan may hold
    peaks: Tuple[float, ...]          # per rank, the plan's own peak
    evaluations: int
    packed_fallback: bool = False     # the loader's microbatches packed, kept: the gain was within the model's error

    @property
    def num_microbatches(self) -> int:
        return self.composition.num_microbatches


def valid_microbatch_counts(num_stages: int, num_chunks: int, most: int,
                            microbatch_group_size: Optional[int] = None, split_backward: bool = False
                            ) -> Tuple[int, ...]:
    """Counts 1..most that Megatron's schedule accepts for this pipeline (PipelineShape's checks, see module doc)."""
    counts = []
    for count in range(1, most + 1):
        try:
            PipelineShape(num_stages, num_chunks, count, microbatch_group_size=microbatch_group_size,
                          split_backward=split_backward)
        except ScheduleConfigError:
            continue
        counts.append(count)
    return tuple(counts)


def loader_peak_caps(shape: PipelineShape, padded_tokens: Sequence[float], memory_factor: float = 1.0
                     ) -> Tuple[float, ...]:
    """Per rank: memory_factor x the held-token peak of Megatron's interleaved order on the loader's microbatches."""
    return tuple(memory_factor * peak for peak in megatron_peak_sizes(shape, padded_tokens))


def choose_order(shape: PipelineShape, tokens: Sequence[float], squared_tokens: Sequence[float],
                 costs: LengthCostModel, memory_factor: float, evaluations: int,
                 stop: Optional[Callable[[float], bool]] = None) -> PlanChoice:
    """The order and warm-ups of fixed microbatches (their tokens and squared tokens), as the `planned` policy
    chooses them: each rank capped at memory_factor x Megatron's peak on these microbatches, durations predicted by
    `costs`. The one search the policy and the iteration planner both run."""
    caps = loader_peak_caps(shape, tokens, memory_factor)
    table = costs.duration_table(PLANNED_KINDS, shape.num_chunks, tokens, squared_tokens, num_stages=shape.num_stages)
    return PlanSearch(shape, evaluations=evaluations).choose(tokens, caps, by_kind(table), stop=stop)


def document_costs(costs: LengthCostModel, num_chunks: int, lengths: Sequence[int]) -> np.ndarray:
    """Each document's share of a microbatch's time on the whole pipeline (intercepts removed: they are per
    microbatch, not per document)."""
    lengths = np.asarray(lengths, dtype=float)
    table = costs.duration_table(PLANNED_KINDS, num_chunks, lengths, lengths ** 2)
    intercept = costs.duration_table(PLANNED_KINDS, num_chunks, np.zeros(1), np.zeros(1))
    return np.maximum(table.sum(axis=0) - intercept.sum(), 1e-12 * table.sum(axis=0))


def balanced_groups(weights: Sequence[float], count: int) -> Tuple[Tuple[int, ...], ...]:
    """Whole documents into `count` groups of near-equal total weight: LPT, then moves/swaps between the heaviest
    and the lightest group while the spread narrows. Groups come back sorted by position; deterministic."""
    weights = [float(w) for w in weights]
    n = len(weights)
    if not 1 <= count <= n:
        raise ScheduleConfigError(f"cannot place {n} documents into {count} non-empty microbatches")
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    groups: List[List[int]] = [[] for _ in range(count)]
    loads = [0.0] * count
    heap = [(0.0, k) for k in range(count)]
    for position, document in enumerate(order):
        load, k = heapq.heappop(heap)
        groups[k].append(document)
        loads[k] = load + weights[document]
        heapq.heappush(heap, (loads[k], k))
    for _ in range(LOCAL_MOVE_ROUNDS):
        heavy = max(range(count), key=lambda k: (loads[k], -k))
        light = min(range(count), key=lambda k: (loads[k], k))
        gap = loads[heavy] - loads[light]
        if gap <= 0:
            break
        best = None       # (distance of the transferred weight from gap/2, move)
        if len(groups[heavy]) > 1:
            for d in groups[heavy]:
                if 0 < weights[d] < gap:
                    best = min(best or (np.inf, None), (abs(weights[d] - gap / 2), (d, None)), key=lambda x: x[0])
        for d in groups[heavy]:
            for e in groups[light]:
                delta = weights[d] - weights[e]
                if 0 < delta < gap:
                    best = min(best or (np.inf, None), (abs(delta - gap / 2), (d, e)), key=lambda x: x[0])
        if best is None:
            break
        d, e = best[1]
        groups[heavy].remove(d)
        groups[light].append(d)
        loads[heavy] -= weights[d]
        loads[light] += weights[d]
        if e is not None:
            groups[light].remove(e)
            groups[heavy].append(e)
            loads[light] -= weights[e]
            loads[heavy] += weights[e]
    return tuple(tuple(sorted(group)) for group in groups)


def count_limit(loader_count: int, microbatches_run: int) -> int:
    """The most microbatches a `balanced` plan may form when calls have run at most `microbatches_run` (0: none):
    the loader's count before any call, then up to twice the most run. A task's fixed cost (several ms a task at
    hidden 4096 on an H200) is what stops more microbatches from paying; the prior (cost proportional to tokens)
    has none, and a fit over one narrow range of sizes may put it near 0. Unbounded, the first call of a P=2 V=2
    run formed one microbatch per document (256 on an H200: 9.7 s against about 0.5 s for the loader's 8) and the
    second 50 (2.0 s). Each doubling is measured before the next."""
    return loader_count if microbatches_run < 1 else max(loader_count, 2 * microbatches_run)


def candidate_counts(valid: Sequence[int], loader_count: int, most: int = MAX_CANDIDATE_COUNTS) -> Tuple[int, ...]:
    """All valid counts when few, else a geometric spread of them that keeps the loader's count."""
    if len(valid) <= most:
        return tuple(valid)
    picks = {valid[int(round(i))] for i in np.geomspace(1, len(valid), most) - 1}
    return tuple(sorted(picks | {loader_count}))


def interleaved_estimate(num_stages: int, num_chunks: int, table: np.ndarray) -> float:
    """Cheap makespan estimate of Megatron's interleaved order (no graph): the busiest rank's work plus the fill
    and drain, (P - 1) x a chunk's forward + backward of the costliest microbatch (memory not checked: screening
    only). table: per (kind, chunk) rows, or per (kind, rank, chunk) (length_costs.duration_table)."""
    ranks = num_stages if has_rank_rows(table, num_stages, num_chunks) else 1
    rank_work = table.reshape(-1, ranks, num_chunks, table.shape[1]).sum(axis=(0, 2))   # ranks x m
    chunk_work = rank_work.sum(axis=0) / (ranks * num_chunks)
    return float(rank_work.sum(axis=1).max() + (num_stages - 1) * chunk_work.max())


class CompositionPlanner:
    """plan(lengths, micro_batch_size, costs) -> ComposedPlan for one pipeline (P stages x V chunks)."""

    def __init__(self, num_stages: int, num_chunks: int, split_backward: bool = False,
                 microbatch_group_size: Optional[int] = None, memory_factor: float = 1.0,
                 final_evaluations: int = DEFAULT_FINAL_EVALUATIONS, max_counts: int = MAX_CANDIDATE_COUNTS):
        self.num_stages, self.num_chunks = num_stages, num_chunks
        self.split_backward = split_backward
        self.microbatch_group_size = microbatch_group_size
        self.memory_factor = memory_factor
        self.final_evaluations = final_evaluations
        self.max_counts = max_counts

    def _shape(self, count: int) -> PipelineShape:
        return PipelineShape(self.num_stages, self.num_chunks, count, microbatch_group_size=self.microbatch_group_size,
                             split_backward=self.split_backward)

    def loader_caps(self, document_lengths: Sequence[int], micro_batch_size: int) -> Tuple[float, ...]:
        """Per rank, memory_factor x the held-token peak of Megatron's order on these documents' loader microbatches
        (padded): the cap a plan of these documents keeps to unless told another."""
        loader = loader_composition(len(document_lengths), micro_batch_size, packed=False)
        return loader_peak_caps(self._shape(loader.num_microbatches), loader.microbatch_tokens(document_lengths),
                                self.memory_factor)

    def loader_makespan(self, document_lengths: Sequence[int], micro_batch_size: int, costs: LengthCostModel,
                        caps: Optional[Sequence[float]] = None) -> float:
        """Predicted makespan of these documents' loader microbatches (padded) in Megatron's order."""
        lengths = tuple(int(v) for v in document_lengths)
        loader = loader_composition(len(lengths), micro_batch_size, packed=False)
        tokens = loader.microbatch_tokens(lengths)
        table = self._table(costs, tokens, loader.microbatch_squared_tokens(lengths))
        if 2 * self.num_chunks * self.num_stages * len(lengths) > LARGE_TASKS:
            return interleaved_estimate(self.num_stages, self.num_chunks, table)
        caps = self.loader_caps(lengths, micro_batch_size) if caps is None else caps
        return self._screen(self._shape(loader.num_microbatches), tokens, caps, table, max_extra_warmup=0).\
            predicted_data_order_makespan

    def plan(self, document_lengths: Sequence[int], micro_batch_size: int, costs: LengthCostModel,
             stop: Optional[Callable[[float], bool]] = None, caps: Optional[Sequence[float]] = None,
             loader_makespan: Optional[float] = None, large: Optional[bool] = None,
             min_gain: float = 0.0, microbatches_run: Optional[int] = None) -> ComposedPlan:
        """stop(predicted_loader_makespan): asked between candidates and search rounds (a driver's time budget).
        caps: per rank activation tokens (default: this batch's loader caps); loader_makespan: the baseline the
        budget is a share of (default: these documents' loader microbatches). Given both, the documents need not
        split into loader microbatches (a replica of a cross-replica plan); then no loader candidate is screened.
        large: plan as at scale (default: when this batch alone has more than LARGE_TASKS tasks; a job of many
        replicas says so for each of them). min_gain: the share by which another grouping must be predicted
        faster than the loader's microbatches packed to be chosen over them (the cost model's measured error: a
        smaller predicted gain may be the model's mistake); they are then run with the planned order.
        microbatches_run: the most microbatches a call has run so far (None: no bound; count_limit says how it
        bounds the counts tried)."""
        lengths = tuple(int(v) for v in document_lengths)
        if not lengths or min(lengths) < 1:
            raise ScheduleConfigError(f"document lengths must be positive integers, got {list(document_lengths)!r}")
        V = self.num_chunks
        caps = self.loader_caps(lengths, micro_batch_size) if caps is None else tuple(caps)
        loader_value = (self.loader_makespan(lengths, micro_batch_size, costs, caps) if loader_makespan is None
                        else loader_makespan)
        if large is None:
            large = 2 * V * self.num_stages * len(lengths) > LARGE_TASKS
        screen_warmup = 0 if large else 3
        weights = document_costs(costs, V, lengths)
        valid = valid_microbatch_counts(self.num_stages, V, len(lengths), self.microbatch_group_size,
                                        self.split_backward)
        if not valid:
            raise ScheduleConfigError(f"{len(lengths)} documents form no microbatch count this pipeline accepts")
        loader_count = len(lengths) // micro_batch_size
        if microbatches_run is not None:
            most = count_limit(loader_count, microbatches_run)
            valid = tuple(count for count in valid if count <= most) or valid[:1]
        candidates = []
        has_loader_candidate = len(lengths) % micro_batch_size == 0 and loader_count in valid
        if has_loader_candidate:     # always index 0
            candidates.append(loader_composition(len(lengths), micro_batch_size, packed=True))
        candidates += [Composition(balanced_groups(weights, count), packed=True)
                       for count in candidate_counts(valid, loader_count if loader_count in valid else valid[0],
                                                     LARGE_COUNTS if large else self.max_counts)]
        # Screened in order of a cheap estimate (interleaved_estimate: exact at P=1), the loader's first (the
        # fallback compares with it): a time budget that stops the screen early (short GPU iterations: an H100's
        # P=1 run screened only the loader's 16 microbatches after every 150 ms iteration, and ran 3x slower
        # than the 4 it chose after each long one) then has spent it on the likeliest counts. At least one count
        # besides the loader's is screened whatever the budget. Ties go to the candidates' own order, as before.
        tables = []
        for composition in candidates:
            tokens = composition.microbatch_tokens(lengths)
            tables.append((tokens, self._table(costs, tokens, composition.microbatch_squared_tokens(lengths))))
        # a microbatch larger than a rank's cap never runs there (each rank holds at least one): such counts last
        smallest_cap = min(caps)
        estimates = [interleaved_estimate(self.num_stages, V, table) if max(tokens) <= smallest_cap else math.inf
                     for tokens, table in tables]
        first = [0] if has_loader_candidate else []
        order = first + sorted(range(len(first), len(candidates)), key=lambda i: (estimates[i], i))
        screened = []          # (predicted makespan, index, composition)
        screens = {}           # index -> its screen's PlanChoice (the final search goes on from the winner's)
        for index in order:
            if len(screened) > len(first) and stop is not None and stop(loader_value):
                break
            composition = candidates[index]
            tokens, table = tables[index]
            if not large:
                screens[index] = self._screen(self._shape(composition.num_microbatches), tokens, caps, table,
                                              screen_warmup)
            value = estimates[index] if large else screens[index].predicted_makespan
            screened.append((value, index, composition))
        best_value, best_index, best = min(screened, key=lambda entry: entry[:2])
        packed_fallback = False
        if has_loader_candidate and best_index != 0 and screened[0][0] - best_value < min_gain * screened[0][0]:
            best, best_index, packed_fallback = screened[0][2], screened[0][1], True
        shape = self._shape(best.num_microbatches)
        tokens, table = tables[best_index]
        squared = best.microbatch_squared_tokens(lengths)
        evaluations = min(self.final_evaluations, LARGE_FINAL_EVALUATIONS) if large else self.final_evaluations
        choice = PlanSearch(shape, evaluations=evaluations, max_extra_warmup=screen_warmup).choose(
            tokens, caps, by_kind(table), stop=None if stop is None else (lambda _: stop(loader_value)),
            seeded=screens.get(best_index))
        order = choice.plan.start_order
        composition = Composition(tuple(best.groups[k] for k in order), packed=True)
        plan = Plan(tuple(range(len(order))), choice.plan.extra_warmup)
        return ComposedPlan(composition, plan, choice.predicted_makespan, loader_value,
                            tuple(tokens[k] for k in order), tuple(squared[k] for k in order), tuple(caps),
                            choice.admission_needs, choice.evaluations, packed_fallback)

    def plan_order(self, composition: Composition, document_lengths: Sequence[int], costs: LengthCostModel,
                   stop: Optional[Callable[[float], bool]] = None) -> PlanChoice:
        """The order and warm-ups of fixed microbatches (the loader's, packed or not; dp-balanced's), as the
        `planned` policy chooses them: each rank capped at memory_factor x Megatron's peak on these microbatches."""
        lengths = tuple(int(v) for v in document_lengths)
        return choose_order(self._shape(composition.num_microbatches), composition.microbatch_tokens(lengths),
                            composition.microbatch_squared_tokens(lengths), costs, self.memory_factor,
                            self.final_evaluations, stop=stop)

    def _screen(self, shape: PipelineShape, tokens, caps, table, max_extra_warmup: int = 3):
        """The seeded orders x warm-ups only (no annealing): a cheap score for one candidate composition."""
        search = PlanSearch(shape, evaluations=0, max_extra_warmup=max_extra_warmup)
        return search.choose(tokens, caps, by_kind(table))

    def _table(self, costs: LengthCostModel, tokens, squared) -> np.ndarray:
        """Predicted durations per (kind, pipeline rank, chunk) x microbatch (length_costs.duration_table)."""
        return costs.duration_table(PLANNED_KINDS, self.num_chunks, tokens, squared, num_stages=self.num_stages)

