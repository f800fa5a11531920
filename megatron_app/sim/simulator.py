"""simulate(): run one policy for some iterations under a SimConfig; results, lower bounds and optional traces."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

from megatron_app.schedule import PipelineShape, Policy, ScheduleConfigError
from megatron_app.schedule.admission import check_memory_cap
from megatron_app.schedule.planned import check_memory_factor, megatron_peak_sizes
from megatron_app.trace.bounds import MIN_TRANSFER_KEY

from .bounds import LowerBounds, lower_bounds
from .costs import ComputeCosts, ComputePerturbations, draw_durations
from .engine import IterationOutcome, TaskTable, make_policies, run_iteration
from .lengths import MicrobatchLengths
from .network import LinkCosts, Network
from .trace_output import SimTrace


@dataclass(frozen=True)
class SimConfig:
    shape: PipelineShape
    compute: ComputeCosts
    links: LinkCosts = field(default_factory=LinkCosts)
    perturbations: ComputePerturbations = field(default_factory=ComputePerturbations)
    iterations: int = 1
    seed: int = 0
    memory_cap: Optional[int] = None     # None: each policy's default (Megatron's interleaved peak per rank)
    lengths: Optional[MicrobatchLengths] = None   # variable-length microbatches (per-microbatch cost and memory)
    memory_factor: Optional[float] = None         # planned: activation tokens per rank, x Megatron's peak

    def __post_init__(self):
        if not isinstance(self.shape, PipelineShape):
            raise ScheduleConfigError(f"shape must be a PipelineShape, got {self.shape!r}")
        if self.shape.forward_only:
            raise ScheduleConfigError("the simulator models training iterations; forward_only shapes are not "
                                      "supported")
        for name in ("iterations", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "iterations" else 0):
                raise ScheduleConfigError(f"{name} must be an int >= {1 if name == 'iterations' else 0}, "
                                          f"got {value!r}")
        if self.memory_cap is not None:
            check_memory_cap(self.shape, self.memory_cap)
        if self.memory_factor is not None:
            check_memory_factor(self.memory_factor)
        if self.lengths is not None and not isinstance(self.lengths, MicrobatchLengths):
            raise ScheduleConfigError(f"lengths must be a MicrobatchLengths, got {self.lengths!r}")
        self.compute.check_shape(self.shape)
        self.perturbations.check_shape(self.shape)
        self.links.check_shape(self.shape)

    def describe(self) -> dict:
        """Plain-JSON summary (trace header extra, --json output)."""
        p, links = self.perturbations, self.links
        return {
            "pipeline_parallel": self.shape.num_stages, "model_chunks": self.shape.num_chunks,
            "microbatches": self.shape.num_microbatches, "iterations": self.iterations, "seed": self.seed,
            "memory_cap": self.memory_cap, "memory_factor": self.memory_factor,
            "lengths": None if self.lengths is None else self.lengths.describe(),
            "forward_us": [list(row) for row in self.compute.forward_us],
            "backward_us": [list(row) for row in self.compute.backward_us],
            "slow_rank": p.slow_rank, "slow_factor": p.slow_factor, "jitter": p.jitter,
            "straggler_prob": p.straggler_prob, "straggler_factor": p.straggler_factor,
            "link_latency_us": links.latency_us, "link_gbps": None if math.isinf(links.gbps) else links.gbps,
            "tensor_bytes": links.tensor_bytes, "slow_links": [str(s) for s in links.slow_links],
        }


@dataclass
class SimResult:
    policy: str
    iterations: List[IterationOutcome]
    bounds: List[LowerBounds]      # per iteration
    wall_s: float
    megatron_peaks: List[List[float]] = field(default_factory=list)   # per iteration, per rank (tokens)

    @property
    def makespan_us(self) -> float:
        """Mean iteration makespan."""
        return sum(it.makespan_us for it in self.iterations) / len(self.iterations)

    @property
    def bubble_ratio(self) -> float:
        return sum(it.bubble_ratio for it in self.iterations) / len(self.iterations)

    @property
    def peak_activations(self) -> List[int]:
        """Per rank, the most activations held in any iteration."""
        return [max(values) for values in zip(*(it.peak_activations for it in self.iterations))]

    @property
    def peak_activation_tokens(self) -> List[float]:
        """Per rank, the most activation tokens held in any iteration (variable lengths; else activations)."""
        return [max(values) for values in zip(*(it.peak_activation_sizes for it in self.iterations))]

    @property
    def peak_tokens_over_megatron(self) -> float:
        """Largest ratio, over ranks and iterations, of held activation tokens to Megatron's data-order peak."""
        return max(peak / reference for it, references in zip(self.iterations, self.megatron_peaks)
                   for peak, reference in zip(it.peak_activation_sizes, references))

    @property
    def planning_s(self) -> float:
        """Mean CPU time spent planning per iteration (rank 0)."""
        return sum(it.planning_s for it in self.iterations) / len(self.iterations)

    @property
    def lower_bound_us(self) -> float:
        """Mean over iterations of the tightest lower bound."""
        return sum(b.best_us for b in self.bounds) / len(self.bounds)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy, "makespan_us": self.makespan_us, "bubble_ratio": self.bubble_ratio,
            "peak_activations": self.peak_activations, "lower_bound_us": self.lower_bound_us,
            "makespan_over_lower_bound": self.makespan_us / self.lower_bound_us if self.lower_bound_us else None,
            "iteration_makespans_us": [it.makespan_us for it in self.iterations],
            "work_bound_us": [b.work_us for b in self.bounds], "path_bound_us": [b.path_us for b in self.bounds],
            "wall_s": self.wall_s, "peak_activation_tokens": self.peak_activation_tokens,
            "peak_tokens_over_megatron": self.peak_tokens_over_megatron, "planning_s": self.planning_s,
        }


def simulate(config: SimConfig, policy: Union[str, Sequence[Policy]],
             trace_dir: Optional[Union[str, os.PathLike]] = None) -> SimResult:
    """Run `policy` (a name for make_policy, or one Policy per rank) for config.iterations iterations.

    trace_dir: when given, writes trace_rank<r>.jsonl files there (source 'sim', simulated microseconds).
    Raises ScheduleConfigError on bad options and ScheduleStallError if the policy would hang the pipeline.
    """
    shape = config.shape
    if isinstance(policy, str):
        policies = make_policies(shape, policy, config.memory_cap, config.memory_factor)
    else:
        policies = list(policy)
        if len(policies) != shape.num_stages:
            raise ScheduleConfigError(f"need one policy per rank ({shape.num_stages}), got {len(policies)}")
    name = policies[0].name
    network = Network(config.links)
    table = TaskTable(shape)
    trace = None
    if trace_dir is not None:
        trace = SimTrace(trace_dir, shape, name, config.links.tensor_bytes,
                         run_id=f"sim-{name}-seed{config.seed}",
                         extra=config.describe() | {MIN_TRANSFER_KEY: config.links.min_transfer_us})
    began = time.perf_counter()
    outcomes, bounds, megatron_peaks = [], [], []
    start_us = 0.0
    try:
        for iteration in range(config.iterations):
            lengths = factors = weight_factors = None
            if config.lengths is not None:
                lengths = config.lengths.draw(shape.num_microbatches, config.seed, iteration)
                factors = [config.lengths.cost_factor(length) for length in lengths]
                weight_factors = [config.lengths.weight_share_factor(length) for length in lengths]
            durations = draw_durations(shape, config.compute, config.perturbations, config.seed, iteration,
                                       factors, weight_factors)
            outcome = run_iteration(shape, policies, durations, network, iteration, start_us, trace, table,
                                    lengths=lengths)
            outcomes.append(outcome)
            megatron_peaks.append(list(megatron_peak_sizes(shape, lengths or [1] * shape.num_microbatches)))
            bounds.append(lower_bounds(shape, durations, config.links.min_transfer_us))
            start_us = outcome.end_us
    finally:
        if trace is not None:
            trace.close()
    return SimResult(policy=name, iterations=outcomes, bounds=bounds, wall_s=time.perf_counter() - began,
                     megatron_peaks=megatron_peaks)
