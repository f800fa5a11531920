"""The simulator's view of an emulated run, and of a traced one.

simulate_emulation: megatron_app.sim's event loop fed with exactly what --emulate-compute runs (the same per-task
draws, the same slow-link rule, a fresh policy per iteration as the runtime's forward_backward_app makes one per
call), so its makespans predict the emulated runtime's.
replay_trace_iteration: the same loop fed with a traced iteration's measured task durations (issue 7 part 1's check
that the simulator explains real runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_app.schedule import PipelineShape
from megatron_app.sim import lower_bounds, run_iteration
from megatron_app.sim.costs import DurationTable, with_host_cost
from megatron_app.sim.engine import TaskTable, make_policies
from megatron_app.sim.network import SlowLink
from megatron_app.trace.bounds import pipeline_durations, pipeline_shape

from .spec import EmulationSpec


class SlowLinkNetwork:
    """megatron_app.sim's Network interface under the --link-delay rule (link_delay.py: a delay for messages posted
    inside each iteration's window, the link kept FIFO) plus a fixed latency on every message."""

    def __init__(self, spec: Optional[SlowLink], latency_us: float = 0.0):
        self.spec = spec
        self.latency_us = latency_us
        self.iteration_start_us = 0.0
        self._last_arrival: Dict[Tuple[int, int], float] = {}

    def begin_iteration(self, start_us: float) -> None:
        self.iteration_start_us = start_us

    @property
    def min_transfer_us(self) -> float:
        return self.latency_us

    def send(self, src: int, dst: int, posted_us: float) -> Tuple[float, float]:
        if src == dst:
            return posted_us, posted_us
        arrival = posted_us + self.latency_us
        if self.spec is not None and self.spec.joins(src, dst):
            arrival += self.spec.delay_at_us(src, dst, posted_us - self.iteration_start_us)
            arrival = max(arrival, self._last_arrival.get((src, dst), arrival))   # FIFO link
            self._last_arrival[(src, dst)] = arrival
        return posted_us, arrival


@dataclass(frozen=True)
class SimulatedIteration:
    makespan_us: float
    lower_bound_us: float
    bubble_ratio: float
    peak_activations: List[int]
    peak_activation_tokens: Optional[List[float]] = None   # per rank, with variable lengths


def simulate_emulation(spec: EmulationSpec, shape: PipelineShape, policy: str, iterations: int,
                       slow_link: Optional[SlowLink] = None, latency_us: float = 0.0,
                       memory_cap: Optional[int] = None,
                       memory_factor: Optional[float] = None, host_us: float = 0.0) -> List[SimulatedIteration]:
    """With spec.lengths, each iteration's microbatch lengths go to the policies (planning, token-sized memory).
    host_us: the runtime's own time per task, added to every task (sim.costs.with_host_cost)."""
    network = SlowLinkNetwork(slow_link, latency_us)
    table = TaskTable(shape)
    start_us = 0.0
    results = []
    # One set of policies for the whole run, as the runtime keeps its policy objects from call to call: what they
    # learn in one iteration (durations, f(tokens)) shapes the next one's decisions and plans.
    policies = make_policies(shape, policy, memory_cap, memory_factor)
    for iteration in range(iterations):
        durations = with_host_cost(shape, spec.draw(shape, iteration), host_us)
        lengths = spec.microbatch_lengths(shape, iteration)
        network.begin_iteration(start_us)
        outcome = run_iteration(shape, policies, durations, network, iteration, start_us, None, table,
                                lengths=lengths)
        results.append(SimulatedIteration(outcome.makespan_us, lower_bounds(shape, durations, latency_us).best_us,
                                          outcome.bubble_ratio, list(outcome.peak_activations),
                                          None if lengths is None else list(outcome.peak_activation_sizes)))
        start_us = outcome.end_us
    return results


def traced_shape(run, iteration: int) -> PipelineShape:
    """The pipeline a traced iteration ran (its first data/tensor-parallel replica): split backward when it has W
    ('weight') events."""
    return pipeline_shape(run.pipelines()[0], iteration, run.model_chunks)


def measured_durations(run, iteration: int) -> DurationTable:
    """The task durations (us) of one traced iteration, from the first TP/DP rank of each stage; ValueError when a
    task has no forward/backward event or more than one."""
    return DurationTable(pipeline_durations(run.pipelines()[0], iteration, run.model_chunks))


def replay_trace_iteration(run, iteration: int, policy: str, slow_link: Optional[SlowLink] = None,
                           latency_us: float = 0.0, memory_cap: Optional[int] = None,
                           lengths: Optional[Sequence[int]] = None,
                           memory_factor: Optional[float] = None) -> SimulatedIteration:
    """Simulate `policy` on a traced iteration's measured task durations (lengths: its microbatch lengths, which
    planning policies plan with)."""
    shape = traced_shape(run, iteration)
    durations = measured_durations(run, iteration)
    outcome = run_iteration(shape, make_policies(shape, policy, memory_cap, memory_factor), durations,
                            SlowLinkNetwork(slow_link, latency_us), iteration, 0.0, lengths=lengths)
    return SimulatedIteration(outcome.makespan_us, lower_bounds(shape, durations, latency_us).best_us,
                              outcome.bubble_ratio, list(outcome.peak_activations))
