"""The scenarios tools/bench_schedule.py runs: flag key -> scenario name, and the ones run only when asked
(variable lengths from a real corpus; whole documents of the copyright corpus, composed per row)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCENARIO_KEYS = {"homogeneous": "homogeneous", "slow-rank": "slow rank 1.5x", "jitter": "jitter +-30%",
                 "stragglers": "stragglers 10% x3", "slow-link": "slow link"}
# Run only when asked (--scenarios variable-length): microbatch lengths drawn from a real corpus's token counts.
VARIABLE_LENGTH_KEY, VARIABLE_LENGTH = "variable-length", "variable length"


@dataclass(frozen=True)
class CompositionScenario:
    name: str
    lengths_file: Path
    documents_per_microbatch: int   # whole documents a loader microbatch


# Run only when asked: whole documents of the copyright corpus, several a loader microbatch, composed per row.
LENGTHS_DIR = REPO / "docs" / "results" / "lengths"
COMPOSITION_SCENARIOS = {
    "copyright-2048": CompositionScenario("copyright 2048", LENGTHS_DIR / "copyright_2048.txt", 2),
    "copyright-8192": CompositionScenario("copyright 8192", LENGTHS_DIR / "copyright_8192.txt", 2),
}
COMPOSITION_SCENARIO_NAMES = {scenario.name for scenario in COMPOSITION_SCENARIOS.values()}
ALL_SCENARIO_KEYS = {**SCENARIO_KEYS, VARIABLE_LENGTH_KEY: VARIABLE_LENGTH,
                     **{key: scenario.name for key, scenario in COMPOSITION_SCENARIOS.items()}}
# torch.distributed.pipelining's PipelineStage (torch 2.13, stage.py) sets up its receive buffers once, on the first
# step, from one input/output shape per stage (given, or inferred from the first microbatch), and receives every
# later microbatch into them: its schedules cannot run microbatches of different lengths.
FIXED_SHAPE_NOTE = ("torch.distributed.pipelining skipped: its PipelineStage receives every microbatch into buffers "
                    "of one shape per stage, fixed on the first step")
# The host-cost probe: a run of near-zero compute (forward, backward ms) whose time is the runtime's own per task.
HOST_PROBE, HOST_PROBE_COMPUTE = "host cost probe", "0.1,0.2"


def scenario_flags(name: str, slow_link: str, lengths_file) -> dict:
    """The trainer flags (as run fields) of a scenario; "jitter" goes into --emulate-compute."""
    return {
        "homogeneous": {},
        "slow rank 1.5x": {"slow_rank": 1, "slow_factor": 1.5},
        "jitter +-30%": {"jitter": 0.3},
        "stragglers 10% x3": {"straggler_prob": 0.1, "straggler_factor": 3.0},
        "slow link": {"slow_link": slow_link},
        VARIABLE_LENGTH: {"lengths_file": lengths_file},
        HOST_PROBE: {},
        **{scenario.name: {"lengths_file": str(scenario.lengths_file),
                           "documents_per_microbatch": scenario.documents_per_microbatch}
           for scenario in COMPOSITION_SCENARIOS.values()},
    }[name]
