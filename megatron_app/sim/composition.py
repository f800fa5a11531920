"""Simulated iterations of one global batch of documents under a composition: which documents form each microbatch.

Rows (COMPOSITION_ROWS), all on the same drawn documents per iteration (MicrobatchLengths.draw, keyed by seed and
iteration):
  loader       the loader's microbatches (micro_batch_size consecutive documents), padded to their longest, in
               Megatron's interleaved order: today's baseline.
  packed       the same groups packed into one row each (no padding), Megatron's order: isolates padding.
  dp-balanced  documents in loader order packed into microbatches up to a token budget, a variable count made valid
               for interleaving by splitting the last multi-document microbatches (the way Megatron-LM's
               NaiveSequencePackingScheduler in megatron/core/datasets/data_schedule.py does it; not cost-aware),
               Megatron's order.
  balanced     composition_plan.CompositionPlanner (cost-balanced packing + order + warm-ups), run by `planned`.

A microbatch costs base x (linear * T + quadratic * S) / (linear + quadratic), T its tokens and S its attention
blocks' squared lengths, both over the mean document length (packed: the documents; padded: rows of the longest):
the same model as MicrobatchLengths.cost_factor for one document. Every task also pays `host_us`, the runtime's own
time per task (Python loop, Megatron's step functions, transport calls) that does not scale with tokens.
The planner learns its costs from the tasks it saw in earlier iterations (rank 0's, as the runtime's policy would).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_app.schedule import Kind, PipelineShape, ScheduleConfigError, make_policy
from megatron_app.schedule.composition import (BALANCED, DP_BALANCED, LOADER, LOCAL_BALANCED, PACKED,
                                               PLANNED_COMPOSITIONS, loader_composition)
from megatron_app.schedule.composition_plan import loader_peak_caps
from megatron_app.schedule.iteration_plan import (PipelineSpec, PlanRequest, ReplicaSpeeds, loader_shares,
                                                  plan_iteration)
from megatron_app.schedule.length_costs import LengthCostModel
from megatron_app.schedule.planned import DEFAULT_MEMORY_FACTOR

from .bounds import lower_bounds
from .cost_curves import CostCurves
from .costs import DurationTable, draw_durations, ComputeCosts, ComputePerturbations, with_host_cost
from .engine import TaskTable, run_iteration
from .lengths import MicrobatchLengths
from .network import LinkCosts, Network

US_PER_S = 1e6

# The rows are the compositions of schedule/composition.py, each run by its order (balanced: `planned`).
LOADER_ROW, PACKED_ROW, DP_BALANCED_ROW, BALANCED_ROW = LOADER, PACKED, DP_BALANCED, BALANCED
LOCAL_BALANCED_ROW = LOCAL_BALANCED     # balanced, each replica only its loader share (no document moves)
COMPOSITION_ROWS = (LOADER_ROW, PACKED_ROW, DP_BALANCED_ROW, BALANCED_ROW)
DATA_PARALLEL_ROWS = (LOADER_ROW, PACKED_ROW, DP_BALANCED_ROW, LOCAL_BALANCED_ROW, BALANCED_ROW)
# The runtime's own time per task: issue 23's figure (about 0.4 ms with near-zero compute on a 2-core machine), not
# measured here. tools/bench_schedule.py measures it in every run with composition rows (its host-cost probe,
# bench/schedule/analysis.py's measure_host_cost) and feeds that to its predictions; set it from such a measurement.
DEFAULT_HOST_US = 400.0


def dp_balanced_token_budget(lengths: MicrobatchLengths, documents_per_microbatch: int) -> int:
    """The dp-balanced packer's default tokens per microbatch: the loader's microbatch at the corpus's longest
    document (its truncation), as Megatron's packer fills up to max_seqlen x micro batch size."""
    return documents_per_microbatch * max(lengths.corpus or (4 * lengths.median_tokens,))


@dataclass(frozen=True)
class CompositionSimConfig:
    num_stages: int
    num_chunks: int
    loader_microbatches: int          # the loader's microbatches per iteration (m)
    documents_per_microbatch: int     # micro_batch_size: documents per loader microbatch
    lengths: MicrobatchLengths        # the documents' token counts (a corpus) and the cost model
    forward_us: float = 10_000.0      # a chunk's forward on one document of the mean length
    backward_us: float = 20_000.0
    host_us: float = DEFAULT_HOST_US
    iterations: int = 3
    warmup_iterations: int = 1        # not averaged: the planner's costs are still the prior in the first
    seed: int = 0
    memory_factor: float = DEFAULT_MEMORY_FACTOR
    token_budget: Optional[int] = None   # dp-balanced: tokens per microbatch (default: m. b. size x longest doc)
    data_parallel: int = 1               # replicas; each computes m x K documents of the loader's global batch
    replica_speeds: Optional[Tuple[float, ...]] = None   # each replica's speed (a slower device: < 1.0)
    speed_aware: bool = True             # balanced: the planner learns the replicas' speeds (False: plans them equal)
    allreduce_us: float = 0.0            # the gradient all-reduce after the slowest replica (D > 1)
    cost_curves: Optional[CostCurves] = None   # task costs fitted on a real trace (cost_curves.py) instead of the
    num_layers: int = 8                        # analytic model; the model's layers they are spread over

    @property
    def speeds(self) -> Tuple[float, ...]:
        return tuple(self.replica_speeds) if self.replica_speeds is not None else (1.0,) * self.data_parallel


@dataclass
class CompositionIteration:
    makespan_us: float
    lower_bound_us: float
    num_microbatches: int
    peak_tokens: List[float]           # per rank
    loader_peak_tokens: List[float]    # per rank: the baseline's (loader, padded, Megatron's order)
    padding_share: float               # padding tokens / computed tokens
    planning_s: float
    replica_makespans_us: List[float] = field(default_factory=list)
    replica_work_share: float = 1.0    # max over mean of the replicas' compute


@dataclass
class CompositionResult:
    row: str
    iterations: List[CompositionIteration] = field(default_factory=list)

    def _mean(self, name):
        return float(np.mean([getattr(it, name) for it in self.iterations]))

    @property
    def makespan_us(self) -> float:
        return self._mean("makespan_us")

    @property
    def lower_bound_us(self) -> float:
        return self._mean("lower_bound_us")

    @property
    def padding_share(self) -> float:
        return self._mean("padding_share")

    @property
    def planning_s(self) -> float:
        return self._mean("planning_s")

    @property
    def num_microbatches(self) -> float:
        return self._mean("num_microbatches")

    @property
    def replica_work_share(self) -> float:
        return self._mean("replica_work_share")

    @property
    def peak_tokens(self) -> List[float]:
        return [max(v) for v in zip(*(it.peak_tokens for it in self.iterations))]

    @property
    def peak_over_loader(self) -> float:
        """Largest ratio over ranks and iterations of this row's held tokens to the baseline's peak."""
        return max(p / q for it in self.iterations for p, q in zip(it.peak_tokens, it.loader_peak_tokens))

    def to_dict(self) -> dict:
        return {"row": self.row, "makespan_us": self.makespan_us, "lower_bound_us": self.lower_bound_us,
                "padding_share": self.padding_share, "planning_s": self.planning_s,
                "num_microbatches": self.num_microbatches, "peak_tokens": self.peak_tokens,
                "peak_over_loader": self.peak_over_loader, "replica_work_share": self.replica_work_share,
                "iteration_makespans_us": [it.makespan_us for it in self.iterations]}


def composed_durations(config: CompositionSimConfig, shape: PipelineShape, tokens: Sequence[float],
                       squared: Sequence[float], iteration: int) -> DurationTable:
    if config.cost_curves is not None:     # costs measured on a real run, not the planner's analytic model
        return with_host_cost(shape, config.cost_curves.durations(shape, config.num_layers, tokens, squared),
                              config.host_us)
    factors = [config.lengths.composed_cost_factor(t, s) for t, s in zip(tokens, squared)]
    costs = ComputeCosts.uniform(shape, config.forward_us, config.backward_us)
    return with_host_cost(shape, draw_durations(shape, costs, ComputePerturbations(), config.seed, iteration, factors),
                          config.host_us)


def _replica_durations(config: CompositionSimConfig, shape: PipelineShape, tokens, squared, iteration: int,
                       speed: float) -> DurationTable:
    durations = composed_durations(config, shape, tokens, squared, iteration)
    return durations if speed == 1.0 else DurationTable(np.asarray(durations, dtype=float) / speed)


def simulate_composition(config: CompositionSimConfig, row: str,
                         planner_evaluations: Optional[int] = None) -> CompositionResult:
    """Each iteration: the global batch (D x m x K documents) planned by schedule/iteration_plan.plan_iteration,
    every replica's pipeline simulated on its share; the iteration lasts as long as the slowest replica, plus the
    gradient all-reduce (allreduce_us)."""
    if row not in DATA_PARALLEL_ROWS:
        raise ScheduleConfigError(f"unknown composition row {row!r}; choose from {', '.join(DATA_PARALLEL_ROWS)}")
    P, V, K, D = config.num_stages, config.num_chunks, config.documents_per_microbatch, config.data_parallel
    speeds = config.speeds
    pipeline = PipelineSpec(P, V, memory_factor=config.memory_factor, planner_evaluations=planner_evaluations)
    costs = LengthCostModel()
    budget = config.token_budget or dp_balanced_token_budget(config.lengths, K)
    result = CompositionResult(row)
    learnt_speeds = ReplicaSpeeds(D)     # speed-aware rows learn the speeds as the runtime does
    for iteration in range(config.iterations):
        documents = config.lengths.draw(config.loader_microbatches * K * D, config.seed, iteration)
        request = PlanRequest(documents, row, K, pipeline, num_replicas=D, token_budget=budget,
                              replica_speeds=learnt_speeds.speeds() if config.speed_aware else None)
        began = time.process_time()
        plan = plan_iteration(request, costs)
        planning_s = time.process_time() - began if row in PLANNED_COMPOSITIONS else 0.0
        makespans, bounds, peaks, baseline_peaks, works, computed = [], [], [], [], [], 0
        for r, speed in enumerate(speeds):
            replica = plan.replica(r)
            tokens, squared = plan.microbatch_tokens(r), plan.microbatch_squared_tokens(r)
            shape = PipelineShape(P, V, replica.num_microbatches)
            durations = _replica_durations(config, shape, tokens, squared, iteration, speed)
            name = "planned" if row in PLANNED_COMPOSITIONS else "interleaved"
            policies = [make_policy(name, shape, rank) for rank in range(P)]
            outcome = run_iteration(shape, policies, durations, Network(LinkCosts()), iteration, 0.0, None,
                                    TaskTable(shape), lengths=tokens, plan=replica.plan)
            makespans.append(outcome.makespan_us)
            learnt_speeds.observe(r, replica.nominal_predicted_s, outcome.makespan_us / US_PER_S)
            bounds.append(lower_bounds(shape, durations, 0.0).best_us * speed)
            peaks.append(outcome.peak_activation_sizes)
            works.append(float(np.sum(durations)))
            computed += sum(tokens)
            share = loader_shares(len(documents), K, D)[r]
            loader = loader_composition(len(share), K, packed=False)
            baseline_peaks.append(loader_peak_caps(PipelineShape(P, V, loader.num_microbatches),
                                                   loader.microbatch_tokens([documents[p] for p in share])))
            if r == 0:   # replica 0's tasks teach the planner, every pipeline rank's (the runtime gathers them)
                for rank in range(P):
                    for kind in (Kind.FORWARD, Kind.BACKWARD):
                        for chunk in range(V):
                            for mb in range(shape.num_microbatches):
                                costs.observe(kind, chunk, tokens[mb],
                                              durations[rank][kind.index][chunk][mb] / US_PER_S, squared[mb],
                                              rank=rank)
        if iteration < config.warmup_iterations and config.iterations > config.warmup_iterations:
            continue
        job_baseline = [max(column) for column in zip(*baseline_peaks)]
        result.iterations.append(CompositionIteration(
            makespan_us=max(makespans) + (config.allreduce_us if D > 1 else 0.0),
            lower_bound_us=sum(bounds) / sum(speeds) + (config.allreduce_us if D > 1 else 0.0),
            num_microbatches=float(np.mean([r.num_microbatches for r in plan.replicas])),
            peak_tokens=[max(column) for column in zip(*peaks)], loader_peak_tokens=job_baseline,
            padding_share=(computed - sum(documents)) / computed, planning_s=planning_s,
            replica_makespans_us=makespans, replica_work_share=max(works) / float(np.mean(works))))
    return result


def format_composition_table(config: CompositionSimConfig, results: Sequence[CompositionResult]) -> str:
    base = results[0].makespan_us
    D = config.data_parallel
    replicas = "" if D == 1 else (f" D={D} replicas (speeds {','.join(f'{v:g}' for v in config.speeds)}, all-reduce "
                                  f"{config.allreduce_us / 1e3:g} ms; bound: the replicas' pipeline bounds pooled)")
    lines = [f"P={config.num_stages} V={config.num_chunks} loader m={config.loader_microbatches} "
             f"documents/microbatch={config.documents_per_microbatch} host {config.host_us / 1e3:g} ms/task "
             f"iterations={config.iterations} (first {config.warmup_iterations} not averaged) seed={config.seed}"
             + replicas,
             f"{'composition':<14} {'m':>5} {'makespan ms':>12} {'x loader':>9} {'bound ms':>10} {'x bound':>8} "
             f"{'padding':>8} {'peak/base':>10} {'plan ms':>8} " + (f"{'work max/mean':>13} " if D > 1 else "")
             + " peak activation tokens per rank"]
    for r in results:
        peaks = [int(round(p)) for p in r.peak_tokens]
        text = ",".join(map(str, peaks)) if len(peaks) <= 8 else f"max {max(peaks)}"
        balance = f"{r.replica_work_share:>13.3f} " if D > 1 else ""
        lines.append(f"{r.row:<14} {r.num_microbatches:>5.0f} {r.makespan_us / 1e3:>12.1f} "
                     f"{base / r.makespan_us:>9.3f} {r.lower_bound_us / 1e3:>10.1f} "
                     f"{r.makespan_us / r.lower_bound_us:>8.3f} {r.padding_share:>8.1%} {r.peak_over_loader:>10.3f} "
                     f"{r.planning_s * 1e3:>8.1f} {balance} {text}")
    return "\n".join(lines)
