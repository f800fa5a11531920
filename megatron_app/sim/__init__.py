"""Discrete-event simulator of a pipeline running megatron_app.schedule's own policies under a cost model.

    from megatron_app.sim import SimConfig, ComputeCosts, simulate
    result = simulate(SimConfig(shape, ComputeCosts.uniform(shape, 10_000, 20_000)), "interleaved")

Command line: python -m megatron_app.sim --help
"""

from .bounds import LowerBounds, lower_bounds
from .costs import ComputeCosts, ComputePerturbations, draw_durations
from .engine import IterationOutcome, run_iteration
from .network import LinkCosts, Network, SlowLink, pipeline_links
from .simulator import SimConfig, SimResult, simulate

__all__ = [
    "ComputeCosts", "ComputePerturbations", "IterationOutcome", "LinkCosts", "LowerBounds", "Network", "SimConfig",
    "SimResult", "SlowLink", "draw_durations", "lower_bounds", "pipeline_links", "run_iteration", "simulate",
]
