"""The issue's simulator scenarios: P=4, V=2, m=8, f=10 ms, b=20 ms; homogeneous, one rank 1.5x slower, 10% of tasks
3x slower, jitter +-30%, one slow link. Random scenarios are averaged over several seeds (the same draws for every
policy).

    python -m megatron_app.sim.scenarios [--seeds N]

The slow-link scenario needs messages that cost something: 16 MiB per message (e.g. sequence 4096 x hidden 2048 in
bf16) over 100 Gb/s with 20 us latency (1.36 ms per message); the link between ranks 1 and 2 is 10x slower during
the first 300 ms (about half an iteration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_app.schedule import POLICY_NAMES, PipelineShape, policies_for
from megatron_app.schedule.policies import BASELINE_POLICY

from .costs import ComputeCosts, ComputePerturbations
from .network import US_PER_MS, LinkCosts, SlowLink
from .simulator import SimConfig, simulate

ISSUE_SHAPE = PipelineShape(4, 2, 8)
FORWARD_MS, BACKWARD_MS = 10.0, 20.0
MESSAGE_LINK = dict(latency_us=20.0, gbps=100.0, tensor_bytes=16 * 2**20)
SCENARIOS: Dict[str, tuple] = {
    "homogeneous": (ComputePerturbations(), LinkCosts()),
    "slow rank 1.5x": (ComputePerturbations(slow_rank=1, slow_factor=1.5), LinkCosts()),
    "stragglers 10% x3": (ComputePerturbations(straggler_prob=0.1, straggler_factor=3.0), LinkCosts()),
    "jitter +-30%": (ComputePerturbations(jitter=0.3), LinkCosts()),
    "slow link 1-2": (ComputePerturbations(),
                      LinkCosts(**MESSAGE_LINK, slow_links=(SlowLink.parse("1-2:0-300:10"),))),
}
RANDOM_SCENARIOS = ("stragglers 10% x3", "jitter +-30%")
POLICY_WIDTH = max(12, *map(len, POLICY_NAMES))   # the table's policy column


@dataclass(frozen=True)
class ScenarioRow:
    scenario: str
    policy: str
    makespan_ms: float        # mean over seeds
    lower_bound_ms: float     # mean over seeds (the same for every policy)
    peak_activations: List[int]


def run_scenarios(seeds: Sequence[int] = range(5), shape: PipelineShape = ISSUE_SHAPE,
                  names: Optional[Sequence[str]] = None) -> List[ScenarioRow]:
    rows = []
    costs = ComputeCosts.uniform(shape, FORWARD_MS * US_PER_MS, BACKWARD_MS * US_PER_MS)
    for scenario in names or SCENARIOS:
        perturbations, links = SCENARIOS[scenario]
        scenario_seeds = list(seeds) if scenario in RANDOM_SCENARIOS else [0]
        for policy in policies_for(shape):
            results = [simulate(SimConfig(shape, costs, links=links, perturbations=perturbations, seed=seed), policy)
                       for seed in scenario_seeds]
            rows.append(ScenarioRow(
                scenario=scenario, policy=policy,
                makespan_ms=sum(r.makespan_us for r in results) / len(results) / US_PER_MS,
                lower_bound_ms=sum(r.lower_bound_us for r in results) / len(results) / US_PER_MS,
                peak_activations=[max(p) for p in zip(*(r.peak_activations for r in results))]))
    return rows


def format_rows(rows: List[ScenarioRow]) -> str:
    lines = [f"{'scenario':<20} {'policy':<{POLICY_WIDTH}} {'makespan ms':>12} {'bound ms':>9} {'x bound':>8} "
             f"{'interleaved/this':>17}  peak activations"]
    interleaved = {row.scenario: row.makespan_ms for row in rows if row.policy == BASELINE_POLICY}
    for row in rows:
        speedup = interleaved[row.scenario] / row.makespan_ms if row.scenario in interleaved else float("nan")
        lines.append(f"{row.scenario:<20} {row.policy:<{POLICY_WIDTH}} {row.makespan_ms:>12.1f} "
                     f"{row.lower_bound_ms:>9.1f} "
                     f"{row.makespan_ms / row.lower_bound_ms:>8.3f} {speedup:>17.3f}  "
                     f"{','.join(map(str, row.peak_activations))}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron_app.trace.cli import OneLineArgumentParser, positive_int

    parser = OneLineArgumentParser(prog="python -m megatron_app.sim.scenarios", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=positive_int, default=5, help="seeds averaged in random scenarios (5)")
    args = parser.parse_args(argv)
    print(format_rows(run_scenarios(range(args.seeds))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
