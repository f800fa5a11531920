"""One iteration's plan, from planning to execution: the contract between the loop and the runtime.

A global batch is a list of whole documents, positions 0..n-1 in the loader's order (Megatron's pretraining sampler:
microbatch step k covers positions [k*b*D, (k+1)*b*D), data-parallel replica r takes [k*b*D + r*b, ... + b)). Its
plan (IterationPlan) says, for every data-parallel replica, which documents it computes (ReplicaPlan.documents),
how they form its microbatches (.composition, groups over the replica's own documents, in entry order), the order
and per-rank warm-ups its `planned` policy adopts (.plan; None: the policy plans the call itself), and what the
plan predicted (.predicted_s, in the cost model's seconds). It also carries the batch's lengths and the document ids
dropout keys on, so every rank can derive tokens, squared tokens and where each document lies in its microbatch.

plan_iteration(request, costs) is the one planning function: the trainer, the plugin's data wrapper, the simulator
and the benchmarks call it (the runtime through runtime/composition.decide_iteration_plan, which runs it on one rank
and broadcasts the result to every rank of the job, so tensor-, data- and pipeline-parallel ranks execute the same
plan; a call told only its microbatches' tokens goes through plan_told_microbatches, planned on its pipeline's
first rank). Compositions (schedule/composition.py):
  loader, packed  each replica its loader share, the loader's microbatches padded / packed;
  dp-balanced     Megatron-LM's DpBalancedScheduler: the whole global batch in loader order packed up to a token
                  budget, tail packs split until the count is a multiple of D with a count per replica the pipeline
                  accepts, pack i*D+j to replica j (not cost-aware);
  balanced        documents go to replicas by predicted cost (learnt costs, scaled by each replica's speed), then
                  each replica's microbatches, order and warm-ups are planned (composition_plan.py); the
                  replica-local plan (each replica its loader share) is planned too, and the plan whose slowest
                  replica is predicted faster is kept, so moving documents never predicts worse than not moving
                  (a job beyond the planner's large-batch threshold plans only the moved one, each replica as at
                  scale);
  balanced-local  the same planning within each replica's loader share only (no document moves).
With plan_order (the runtime sets it when the `planned` policy runs the calls), the fixed microbatches of loader,
packed and dp-balanced get their order and warm-ups here too, as that policy would choose them, with a prediction:
every composition's iteration is then planned and predicted in one place, with costs learnt per pipeline rank.

Memory: with D > 1 a `balanced` plan caps every pipeline rank at the largest held-token peak Megatron's order
reaches on that rank over the replicas' loader microbatches (the activation memory the job provisions on that
stage), so a replica that receives more documents still holds no more than the job's baseline on any rank.

With a per-token loss (losses and token counts summed over all replicas before dividing) the gradient of the global
batch is the same whichever replica computes a document: tests prove it against D=1 P=1.

Pure: no torch, no I/O, no clocks (a caller's stop() is its time budget).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

from .composition import (DP_BALANCED, LOADER, LOCAL_BALANCED, PACKED, PLANNED_COMPOSITIONS, Composition,
                          check_composition_name, loader_composition)
from .composition_plan import LARGE_TASKS, CompositionPlanner, document_costs, valid_microbatch_counts
from .errors import ScheduleConfigError
from .length_costs import LengthCostModel
from .plan_search import Plan
from .planned import DEFAULT_MEMORY_FACTOR
from .shape import PipelineShape


@dataclass(frozen=True)
class PipelineSpec:
    """One replica's pipeline as the planner sees it (every replica has the same)."""
    num_stages: int = 1
    num_chunks: int = 1
    split_backward: bool = False
    microbatch_group_size: Optional[int] = None
    memory_factor: float = DEFAULT_MEMORY_FACTOR
    planner_evaluations: Optional[int] = None   # the final search's evaluations (default: the planner's)

    @classmethod
    def of_shape(cls, shape: PipelineShape, memory_factor: float = DEFAULT_MEMORY_FACTOR,
                 planner_evaluations: Optional[int] = None) -> "PipelineSpec":
        """The pipeline of a call's shape (its microbatch count aside: the plan chooses or keeps it)."""
        return cls(shape.num_stages, shape.num_chunks, split_backward=shape.split_backward,
                   microbatch_group_size=shape.microbatch_group_size, memory_factor=memory_factor,
                   planner_evaluations=planner_evaluations)

    def valid_counts(self, most: int) -> Tuple[int, ...]:
        return valid_microbatch_counts(self.num_stages, self.num_chunks, most, self.microbatch_group_size,
                                       self.split_backward)

    def planner(self) -> CompositionPlanner:
        return CompositionPlanner(self.num_stages, self.num_chunks, split_backward=self.split_backward,
                                  microbatch_group_size=self.microbatch_group_size, memory_factor=self.memory_factor,
                                  **({} if self.planner_evaluations is None
                                     else {"final_evaluations": self.planner_evaluations}))


@dataclass(frozen=True)
class PlanRequest:
    lengths: Tuple[int, ...]                 # every document of the global batch, in the loader's order
    composition: str
    micro_batch_size: int                    # documents per loader microbatch
    pipeline: PipelineSpec = PipelineSpec()
    num_replicas: int = 1
    document_ids: Optional[Tuple[int, ...]] = None    # what dropout keys each document on (default: its position)
    token_budget: Optional[int] = None       # dp-balanced's tokens per pack (default: micro batch size x longest)
    replica_speeds: Optional[Tuple[float, ...]] = None   # relative throughput per replica (default: all 1.0)
    min_gain: float = 0.0                    # balanced: predicted gain over packing needed to regroup (model error)
    plan_order: bool = False                 # loader, packed, dp-balanced: plan each replica's order and predict it
                                             # (the `planned` policy runs the call; balanced always plans)
    groups: Optional[Tuple[Tuple[int, ...], ...]] = None   # packed, one replica: these microbatches (positions
                                             # in loader order) instead of the loader's (synthetic compositions)
    microbatches_run: Optional[int] = None   # balanced: the most microbatches a call of a replica has run (0: none
                                             # yet; None: no bound); bounds its counts (composition_plan.count_limit)

    def check(self) -> None:
        check_composition_name(self.composition)
        if not self.lengths or min(self.lengths) < 1:
            raise ScheduleConfigError(f"document lengths must be positive integers, got {list(self.lengths)!r}")
        n, b, D = len(self.lengths), self.micro_batch_size, self.num_replicas
        if b < 1 or D < 1 or n % (b * D):
            raise ScheduleConfigError(f"a global batch of {n} documents does not split into {D} replica(s) x "
                                      f"microbatches of {b}")
        if self.document_ids is not None and len(self.document_ids) != n:
            raise ScheduleConfigError(f"{len(self.document_ids)} document ids for {n} documents")
        if self.replica_speeds is not None and (len(self.replica_speeds) != D or min(self.replica_speeds) <= 0):
            raise ScheduleConfigError(f"replica speeds must be {D} positive numbers, got {self.replica_speeds!r}")
        if self.microbatches_run is not None and self.microbatches_run < 0:
            raise ScheduleConfigError(f"microbatches run must be >= 0, got {self.microbatches_run!r}")
        if self.groups is not None:
            if self.composition != PACKED or D != 1:
                raise ScheduleConfigError(f"given microbatches are packed on one replica, not {self.composition} "
                                          f"on {D}")
            Composition(tuple(tuple(g) for g in self.groups), packed=True).check(n)

    @property
    def speeds(self) -> Tuple[float, ...]:
        return tuple(self.replica_speeds) if self.replica_speeds is not None else (1.0,) * self.num_replicas


@dataclass(frozen=True)
class DocumentSegment:
    """Where one document lies in its microbatch: row and first position, and its length."""
    document: int
    row: int
    start: int
    length: int


@dataclass(frozen=True)
class ReplicaPlan:
    documents: Tuple[int, ...]          # global-batch positions this replica computes (composition indexes these)
    composition: Composition            # microbatches over 0..len(documents)-1, in entry order
    plan: Optional[Plan] = None         # order and warm-ups to adopt (None: the policy decides)
    predicted_s: Optional[float] = None  # predicted makespan of this replica's pipeline (its speed applied)
    speed: float = 1.0                  # the speed the plan assumed for this replica
    packed_fallback: bool = False       # balanced kept the loader's microbatches packed (gain within the error)

    @property
    def nominal_predicted_s(self) -> Optional[float]:
        """The prediction at nominal speed (what replica speeds are learnt against)."""
        return None if self.predicted_s is None else self.predicted_s * self.speed

    @property
    def num_microbatches(self) -> int:
        return self.composition.num_microbatches


@dataclass(frozen=True)
class IterationPlan:
    composition_name: str
    lengths: Tuple[int, ...]            # the global batch, loader order
    document_ids: Tuple[int, ...]
    replicas: Tuple[ReplicaPlan, ...]
    predicted_loader_s: Optional[float] = None   # the loader's padded microbatches in Megatron's order, slowest replica
    cross_replica: bool = False         # documents moved between replicas
    planning_s: float = 0.0             # planning time on the critical path, on the deciding rank (set by the driver)
    calibrated: bool = False            # predictions in seconds (learnt costs), not the prior's relative scale
    planned_ahead: bool = False         # made a call early, off the critical path (runtime/plan_ahead.py)
    planner_s: Optional[float] = None   # the planner's own time (planned ahead: the worker's CPU time)
    outside_pipeline_s: Optional[float] = None   # predicted time of the iteration outside the pipeline (the driver's:
                                                 # recent iterations' reduction, optimizer, loss, plus this planning)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def predicted_s(self) -> Optional[float]:
        """The slowest replica's predicted makespan (the iteration waits for it), None when not predicted."""
        values = [replica.predicted_s for replica in self.replicas]
        return None if any(v is None for v in values) else max(values)

    def replica(self, dp_rank: int) -> ReplicaPlan:
        if not 0 <= dp_rank < len(self.replicas):
            raise ScheduleConfigError(f"data-parallel rank {dp_rank} outside a plan of {len(self.replicas)} replicas")
        return self.replicas[dp_rank]

    def replica_lengths(self, dp_rank: int) -> Tuple[int, ...]:
        return tuple(self.lengths[p] for p in self.replica(dp_rank).documents)

    def microbatch_tokens(self, dp_rank: int) -> Tuple[int, ...]:
        replica = self.replica(dp_rank)
        return replica.composition.microbatch_tokens(self.replica_lengths(dp_rank))

    def microbatch_squared_tokens(self, dp_rank: int) -> Tuple[int, ...]:
        replica = self.replica(dp_rank)
        return replica.composition.microbatch_squared_tokens(self.replica_lengths(dp_rank))

    def document_segments(self, dp_rank: int) -> Tuple[Tuple[DocumentSegment, ...], ...]:
        """Per microbatch of the replica, where each document lies: packed, one after the other in row 0; padded,
        one per row from position 0."""
        replica = self.replica(dp_rank)
        layout = []
        for group in replica.composition.groups:
            segments, start = [], 0
            for row, local in enumerate(group):
                position = replica.documents[local]
                length = self.lengths[position]
                if replica.composition.packed:
                    segments.append(DocumentSegment(self.document_ids[position], 0, start, length))
                    start += length
                else:
                    segments.append(DocumentSegment(self.document_ids[position], row, 0, length))
            layout.append(tuple(segments))
        return tuple(layout)

    def report(self, dp_rank: int) -> dict:
        """What this plan chose for a log line: replica dp_rank's microbatches and the prediction (milliseconds)."""
        replica = self.replica(dp_rank)
        lengths = self.replica_lengths(dp_rank)
        predicted = self.predicted_s if self.calibrated else None
        iteration = None if predicted is None else predicted + (self.outside_pipeline_s or 0.0)
        loader = self.predicted_loader_s if self.calibrated else None
        return {"composition": self.composition_name, "num_microbatches": replica.num_microbatches,
                "microbatch_tokens": list(self.microbatch_tokens(dp_rank)),
                "padding_tokens": replica.composition.padding_tokens(lengths),
                "replica_microbatches": [r.num_microbatches for r in self.replicas],
                "cross_replica": self.cross_replica,
                "packed_fallback": [r.packed_fallback for r in self.replicas],
                "predicted_ms": None if iteration is None else iteration * 1e3,
                "predicted_pipeline_ms": None if predicted is None else predicted * 1e3,
                "predicted_loader_ms": None if loader is None else loader * 1e3,
                "planning_ms": self.planning_s * 1e3, "planned_ahead": self.planned_ahead,
                "planner_ms": None if self.planner_s is None else self.planner_s * 1e3}

    def check(self) -> None:
        """Raise ScheduleConfigError unless every document of the batch is computed exactly once."""
        seen = sorted(p for replica in self.replicas for p in replica.documents)
        if seen != list(range(len(self.lengths))):
            raise ScheduleConfigError("an iteration plan must give every document of the global batch to exactly "
                                      "one replica")
        for replica in self.replicas:
            replica.composition.check(len(replica.documents))


def loader_shares(num_documents: int, micro_batch_size: int, num_replicas: int) -> Tuple[Tuple[int, ...], ...]:
    """Each replica's share of the global batch as Megatron's pretraining sampler gives it, in its reading order."""
    span = micro_batch_size * num_replicas
    return tuple(tuple(start + r * micro_batch_size + i for start in range(0, num_documents, span)
                       for i in range(micro_batch_size)) for r in range(num_replicas))


def dp_balanced_packs(lengths: Sequence[int], token_budget: int, num_replicas: int,
                      valid_counts: Sequence[int]) -> List[List[int]]:
    """Megatron-LM's DpBalancedScheduler's packing: documents in loader order into packs of at most token_budget
    tokens (a longer document alone); while the count is not num_replicas x a count the pipeline accepts, the last
    document of the last multi-document pack becomes a pack of its own."""
    packs: List[List[int]] = []
    current, tokens = [], 0
    for position, length in enumerate(lengths):
        if current and tokens + length > token_budget:
            packs.append(current)
            current, tokens = [], 0
        current.append(position)
        tokens += length
    packs.append(current)
    valid = set(valid_counts)
    while len(packs) % num_replicas or len(packs) // num_replicas not in valid:
        splittable = [k for k, pack in enumerate(packs) if len(pack) > 1]
        if not splittable:
            raise ScheduleConfigError(f"{len(lengths)} documents cannot form {num_replicas} replica(s) x a valid "
                                      "number of microbatches")
        packs.append([packs[splittable[-1]].pop()])
    return packs


def assign_by_cost(weights: Sequence[float], speeds: Sequence[float], min_documents: int
                   ) -> Tuple[Tuple[int, ...], ...]:
    """Documents to replicas so that each replica's work over its speed is near-equal: most expensive first, each
    to the replica that would finish it first; then every replica is topped up to min_documents with the cheapest
    documents of the replica holding most. Positions come back sorted (loader order); deterministic."""
    D = len(speeds)
    if len(weights) < D * min_documents:
        raise ScheduleConfigError(f"{len(weights)} documents cannot give {D} replicas {min_documents} each")
    shares: List[List[int]] = [[] for _ in range(D)]
    loads = [0.0] * D
    for document in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        r = min(range(D), key=lambda j: ((loads[j] + weights[document]) / speeds[j], j))
        shares[r].append(document)
        loads[r] += weights[document]
    for r in range(D):
        while len(shares[r]) < min_documents:
            donor = max(range(D), key=lambda j: (len(shares[j]), -j))
            cheapest = min(shares[donor], key=lambda i: (weights[i], i))
            shares[donor].remove(cheapest)
            shares[r].append(cheapest)
    return tuple(tuple(sorted(share)) for share in shares)


def _fixed_plan(request: PlanRequest, shares, packed: bool, costs: Optional[LengthCostModel], stop
                ) -> IterationPlan:
    replicas = tuple(ReplicaPlan(share, loader_composition(len(share), request.micro_batch_size, packed))
                     for share in shares)
    return _ordered(request, replicas, costs, stop)


def _ordered(request: PlanRequest, replicas: Sequence[ReplicaPlan], costs: Optional[LengthCostModel], stop
             ) -> IterationPlan:
    """Fixed microbatches: with plan_order, each replica's order and warm-ups planned and predicted (what the
    `planned` policy would choose for the call), else left to the policy."""
    if not request.plan_order:
        return _iteration(request, replicas)
    costs = costs or LengthCostModel()
    planner = request.pipeline.planner()
    ordered = []
    for replica in replicas:
        choice = planner.plan_order(replica.composition, [request.lengths[p] for p in replica.documents], costs,
                                    stop=stop)
        ordered.append(replace(replica, plan=choice.plan, predicted_s=choice.predicted_makespan))
    return _iteration(request, ordered, calibrated=costs.calibrated)


def _iteration(request: PlanRequest, replicas, predicted_loader_s=None, cross_replica=False,
               calibrated=False) -> IterationPlan:
    ids = request.document_ids if request.document_ids is not None else tuple(range(len(request.lengths)))
    plan = IterationPlan(request.composition, tuple(request.lengths), tuple(ids), tuple(replicas), predicted_loader_s,
                         cross_replica, calibrated=calibrated)
    plan.check()
    return plan


def _at_scale(request: PlanRequest) -> bool:
    """The whole job's tasks (every replica's) beyond the planner's large-batch threshold: each replica is planned
    as at scale (screened by estimate, a short final search) and the replica-local alternative is not planned."""
    pipeline = request.pipeline
    return 2 * pipeline.num_chunks * pipeline.num_stages * len(request.lengths) > LARGE_TASKS


def _plan_replicas(request: PlanRequest, shares, costs: LengthCostModel, caps, baseline: float,
                   stop) -> Tuple[ReplicaPlan, ...]:
    planner = request.pipeline.planner()
    large = _at_scale(request)
    replicas = []
    for share, speed in zip(shares, request.speeds):
        composed = planner.plan([request.lengths[p] for p in share], request.micro_batch_size, costs, stop=stop,
                                caps=caps, loader_makespan=baseline, large=large, min_gain=request.min_gain,
                                microbatches_run=request.microbatches_run)
        replicas.append(ReplicaPlan(tuple(share), composed.composition, composed.plan,
                                    composed.predicted_makespan / speed, speed, composed.packed_fallback))
    return tuple(replicas)


def _plan_balanced(request: PlanRequest, costs: LengthCostModel, stop) -> IterationPlan:
    pipeline, b, speeds = request.pipeline, request.micro_batch_size, request.speeds
    shares = loader_shares(len(request.lengths), b, request.num_replicas)
    planner = pipeline.planner()
    share_lengths = [[request.lengths[p] for p in share] for share in shares]
    share_caps = [planner.loader_caps(lengths, b) for lengths in share_lengths]
    caps = tuple(max(column) for column in zip(*share_caps))
    loader_s = max(planner.loader_makespan(lengths, b, costs, caps) / speed
                   for lengths, speed in zip(share_lengths, speeds))
    calibrated = costs.calibrated
    local = None
    if request.num_replicas == 1 or request.composition == LOCAL_BALANCED or not _at_scale(request):
        local = _plan_replicas(request, shares, costs, caps, loader_s, stop)
    if request.num_replicas == 1 or request.composition == LOCAL_BALANCED:
        return _iteration(request, local, loader_s, calibrated=calibrated)
    weights = document_costs(costs, pipeline.num_chunks, request.lengths)
    moved_shares = assign_by_cost(weights, speeds, min(pipeline.valid_counts(len(request.lengths))))
    moved = _plan_replicas(request, moved_shares, costs, caps, loader_s, stop)
    if local is None or max(r.predicted_s for r in moved) < max(r.predicted_s for r in local):
        return _iteration(request, moved, loader_s, cross_replica=True, calibrated=calibrated)
    return _iteration(request, local, loader_s, calibrated=calibrated)


def plan_iteration(request: PlanRequest, costs: Optional[LengthCostModel] = None,
                   stop: Optional[Callable[[float], bool]] = None) -> IterationPlan:
    """The plan of one iteration (module doc). costs: the learnt cost model `balanced` plans with (default: the
    prior); stop(predicted_loader_s): the caller's time budget for the search (None: the whole search)."""
    request.check()
    shares = loader_shares(len(request.lengths), request.micro_batch_size, request.num_replicas)
    if request.groups is not None:
        composition = Composition(tuple(tuple(g) for g in request.groups), packed=True)
        return _ordered(request, (ReplicaPlan(tuple(range(len(request.lengths))), composition),), costs, stop)
    if request.composition in (LOADER, PACKED):
        return _fixed_plan(request, shares, request.composition == PACKED, costs, stop)
    if request.composition == DP_BALANCED:
        budget = request.token_budget or request.micro_batch_size * max(request.lengths)
        D = request.num_replicas
        packs = dp_balanced_packs(request.lengths, budget, D,
                                  request.pipeline.valid_counts(len(request.lengths) // D))
        replicas = []
        for r in range(D):
            mine = packs[r::D]
            documents = tuple(p for pack in mine for p in pack)
            groups, start = [], 0
            for pack in mine:
                groups.append(tuple(range(start, start + len(pack))))
                start += len(pack)
            replicas.append(ReplicaPlan(documents, Composition(tuple(groups), packed=True)))
        return replace(_ordered(request, replicas, costs, stop), cross_replica=D > 1)
    assert request.composition in PLANNED_COMPOSITIONS
    return _plan_balanced(request, costs or LengthCostModel(), stop)


def plan_told_microbatches(tokens: Sequence[int], pipeline: PipelineSpec, costs: Optional[LengthCostModel] = None,
                           stop: Optional[Callable[[float], bool]] = None) -> IterationPlan:
    """A call for which only its microbatches' tokens are known (a loop's set_microbatch_lengths; the simulator's
    lengths): planned by plan_iteration as one replica's loader batch of one document per microbatch, with its order
    and warm-ups (plan_order), so told lengths and composed batches go through the same search."""
    request = PlanRequest(tuple(int(t) for t in tokens), LOADER, 1, pipeline, plan_order=True)
    return plan_iteration(request, costs, stop)


class PredictionError:
    """How far the cost model's pipeline predictions miss the measured times, beyond a common scale (a constant
    overhead the model does not see scales every plan alike and cannot change which is faster): an average of
    |measured / (scale x predicted) - 1| over recent measurements. 0.0 until two were seen after the first.

    The first prediction seen is left out: its plan was made from the first call's samples alone, which the cost
    model itself keeps only until later ones arrive (length_costs._Fit). On an H200 (P=1, hidden 4096) it predicted
    161 ms of a 329 ms pipeline, the next one 325 of 333 ms; taken as the common scale, it kept this error at 0.22-0.50
    for seven iterations, and `balanced` kept the loader's grouping that long (its regrouping measured 1.2x faster)."""

    def __init__(self, smoothing: float = 0.7):
        self.smoothing = smoothing
        self._scale: Optional[float] = None
        self._error: Optional[float] = None
        self._first_seen = False

    def observe(self, predicted_s: Optional[float], measured_s: Optional[float]) -> None:
        if not predicted_s or not measured_s or predicted_s <= 0 or measured_s <= 0:
            return
        if not self._first_seen:
            self._first_seen = True
            return
        ratio = measured_s / predicted_s
        if self._scale is not None:
            miss = abs(ratio / self._scale - 1.0)
            self._error = miss if self._error is None else self.smoothing * self._error + (1 - self.smoothing) * miss
            self._scale = self.smoothing * self._scale + (1 - self.smoothing) * ratio
        else:
            self._scale = ratio

    @property
    def relative(self) -> float:
        return 0.0 if self._error is None else self._error


class ReplicaSpeeds:
    """Each replica's speed relative to the fastest, learnt from its predicted (nominal) against its measured
    pipeline time: a slower device or a straggling node measures longer than the cost model predicts. Smoothed over
    iterations; None until every replica has been measured, or while every replica is within `tolerance` of the
    fastest (timing noise must not move documents)."""

    def __init__(self, num_replicas: int, smoothing: float = 0.5, tolerance: float = 0.03):
        self.num_replicas = num_replicas
        self.smoothing = smoothing
        self.tolerance = tolerance
        self._rates: List[Optional[float]] = [None] * num_replicas     # predicted over measured

    def observe(self, replica: int, nominal_predicted_s: Optional[float], measured_s: Optional[float]) -> None:
        if not nominal_predicted_s or not measured_s or nominal_predicted_s <= 0 or measured_s <= 0:
            return
        rate = nominal_predicted_s / measured_s
        old = self._rates[replica]
        self._rates[replica] = rate if old is None else self.smoothing * old + (1 - self.smoothing) * rate

    def speeds(self) -> Optional[Tuple[float, ...]]:
        if any(rate is None for rate in self._rates):
            return None
        fastest = max(self._rates)
        speeds = tuple(rate / fastest for rate in self._rates)
        return None if min(speeds) >= 1.0 - self.tolerance else speeds
