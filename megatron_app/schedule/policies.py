"""The policy registry: every policy name, its factory, whether it is a fixed order, and its one-line summary.

Everything that lists policies reads POLICIES: make_policy, the trainer's and install()'s flag choices, settings
validation, the simulator, tools/bench_schedule.py and the README table (checked by tests/test_policy_registry.py).
Adding a policy: one module with its factory, one entry below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from .adaptive import make_adaptive
from .errors import ScheduleConfigError
from .greedy import make_bfc, make_dfc
from .planned import FIXED_NAME, check_memory_factor, make_planned, make_planned_fixed
from .policy import Policy
from .shape import PipelineShape
from .static_order import make_megatron_1f1b, make_megatron_interleaved
from .zero_bubble import make_zb_h1

PolicyFactory = Callable[[PipelineShape, int, Optional[int]], Policy]


@dataclass(frozen=True)
class PolicyOption:
    """An option of one policy: its keyword in the factory, its check, and what it means (flags, settings, the
    simulator and the benchmarks read it from here)."""

    name: str
    check: Callable[[Any], Any]
    summary: str


MEMORY_FACTOR = PolicyOption("memory_factor", check_memory_factor,
                             "activation bytes a rank may hold, x Megatron's peak for the same microbatches (>= 1)")


@dataclass(frozen=True)
class PolicyEntry:
    """factory(shape, rank, memory_cap or None) -> Policy. static: a fixed order (chosen with --schedule NAME);
    otherwise an adaptive rule of the `app` schedule (chosen with --policy NAME). single_chunk: V == 1 only.
    split_only: needs a split backward (W tasks). options: the policy's own options, passed to its factory as
    keywords when set."""

    factory: PolicyFactory
    static: bool
    summary: str
    single_chunk: bool = False
    split_only: bool = False
    options: Tuple[PolicyOption, ...] = ()

    def takes(self, option: str) -> bool:
        return any(declared.name == option for declared in self.options)

    def applies_to(self, shape: PipelineShape) -> bool:
        return not (self.single_chunk and shape.num_chunks > 1) and not (self.split_only and not shape.split_backward)


POLICIES: Dict[str, PolicyEntry] = {
    "dfc": PolicyEntry(make_dfc, static=False, summary="greedy, backward first, depth first (same microbatch "
                       "through more chunks)"),
    "bfc": PolicyEntry(make_bfc, static=False, summary="greedy, backward first, breadth first (same chunk, more "
                       "microbatches of one group)"),
    "1f1b": PolicyEntry(make_megatron_1f1b, static=True, single_chunk=True,
                        summary="Megatron-Core's 1F1B order (V = 1)"),
    "interleaved": PolicyEntry(make_megatron_interleaved, static=True,
                               summary="Megatron-Core's interleaved 1F1B order"),
    "adaptive": PolicyEntry(make_adaptive, static=False, summary="Megatron's order while inputs are on time; when "
                            "its next input is late, the ready backward with the longest remaining path runs first "
                            "(durations learnt at run time)"),
    "planned": PolicyEntry(make_planned, static=False, summary="the default. Per iteration, the microbatch order "
                           "and per-rank warm-up depths of Megatron's order chosen from the microbatches' lengths "
                           "under an activation-bytes cap (x Megatron's peak); then as adaptive. Without lengths: "
                           "adaptive", options=(MEMORY_FACTOR,)),
    FIXED_NAME: PolicyEntry(make_planned_fixed, static=False, summary="planned's per-iteration plan kept at run "
                            "time: waits for the plan's next task, never reorders (the comparison row for run-time "
                            "reordering)", options=(MEMORY_FACTOR,)),
    "zb-h1": PolicyEntry(make_zb_h1, static=True, split_only=True,
                         summary="ZB-H1-style order for a split backward: Megatron's order of forwards and input-"
                         "gradient backwards, rank r deferring r weight-gradient tasks into its tail"),
}

# The policy run_single.sh, install() and the trainer use unless told otherwise: within 0.984-1.002x of Megatron's
# order in the five uniform benchmark scenarios (quiet machine) and faster on variable lengths, at no more memory
# (BENCHMARKS.md, "The default policy").
DEFAULT_POLICY = "planned"
# Megatron-Core's own order: the baseline that comparisons (simulator scenarios, benchmarks) divide by.
BASELINE_POLICY = "interleaved"

POLICY_NAMES: Tuple[str, ...] = tuple(POLICIES)
ADAPTIVE_POLICY_NAMES: Tuple[str, ...] = tuple(name for name, entry in POLICIES.items() if not entry.static)
STATIC_POLICY_NAMES: Tuple[str, ...] = tuple(name for name, entry in POLICIES.items() if entry.static)


def policies_for(shape: PipelineShape) -> Tuple[str, ...]:
    """The policy names that can run `shape`, in registry order."""
    return tuple(name for name, entry in POLICIES.items() if entry.applies_to(shape))


def policies_taking(option: str) -> Tuple[str, ...]:
    """The policy names that declare `option`."""
    return tuple(name for name, entry in POLICIES.items() if entry.takes(option))


def make_policy(name: str, shape: PipelineShape, rank: int, memory_cap: Optional[int] = None,
                **options: Any) -> Policy:
    """A policy for one rank. memory_cap: most activations held at once; None = what Megatron's order holds.
    options: the policy's own (its entry's `options`, e.g. memory_factor); one left at None is not passed."""
    entry = POLICIES.get(name)
    if entry is None:
        raise ScheduleConfigError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    shape.check_rank(rank)
    given = {option: value for option, value in options.items() if value is not None}
    for option in given:
        if not entry.takes(option):
            takers = policies_taking(option)
            raise ScheduleConfigError(f"{option} applies to policy {' or '.join(map(repr, takers)) or 'none'} only, "
                                      f"not {name!r}")
    checked = {declared.name: declared.check(given[declared.name]) for declared in entry.options
               if declared.name in given}
    return entry.factory(shape, rank, memory_cap, **checked)
