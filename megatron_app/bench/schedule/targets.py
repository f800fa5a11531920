"""The issue's targets for tools/bench_schedule.py, as data (TARGETS), and their checks on a run's rows.

A Target compares one row with a baseline (a row key, the best of a group, or the row's lower bound) within one
family of rows of a scenario: "split" (issue 14: our split-backward rows), "whole" (every other row of our runtime
and torch), "variable" (the whole rows of a variable-length run: issue 13) or "composition" (issue 23's rows). Memory
and simulator checks follow fixed rules (check_targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_app.schedule import ADAPTIVE_POLICY_NAMES

from megatron_app.bench.schedule.analysis import COMPOSITION_BASELINE, Row
from megatron_app.bench.schedule.rows import MEGATRON_ROW

# Groups a Target's row or baseline may name instead of a row key: the fastest row of the group.
BEST_APP = "best APP"                     # our adaptive policies (ADAPTIVE_POLICY_NAMES)
BEST_STATIC = "best static"               # every other whole row: static orders, ours and torch's
BEST_WHOLE_STATIC = "best whole static"   # static rows that run each backward whole (not torch's ZeroBubble)
BEST_APP_SPLIT = "best APP split"         # our adaptive policies with a split backward
BOUND = "bound"                           # the row's own lower bound (the simulator's, nominal durations)

# Our runtime's split-backward rows (issue 14): checked against their own targets, kept out of the others'.
APP_SPLIT_KEYS = ("app-adaptive-split", "app-planned-split")
OUR_SPLIT_KEYS = (*APP_SPLIT_KEYS, "zb-h1", "torch-zb-order")
TORCH_SPLIT_KEYS = ("torch-zb",)          # static rows that split each backward
SIM_TOLERANCE = 0.15                      # whole rows of fixed lengths
SIM_TOLERANCE_LENGTHS = 0.10              # variable-length and composition rows
COMPOSITION_OURS = "balanced"
COMPOSITION_MEMORY_BOUND = 1.0            # ours: peak activation tokens over the baseline's, every rank

# Measured-value formats ({row}, {baseline}: labels; {speedup} = baseline ms / row ms, {ratio} = its inverse).
QUOTIENT = "{baseline_ms:.1f} / {row_ms:.1f} ms = {speedup:.3f}x"
VERSUS = "{row_ms:.1f} ms vs {baseline_ms:.1f} ms ({speedup:.3f}x)"


@dataclass(frozen=True)
class Target:
    family: str                     # "split", "whole", "variable" or "composition"
    text: str                       # as printed; {row} and {baseline} are the rows' labels
    measured: str                   # format of the measured values (QUOTIENT, VERSUS, ...)
    row: str                        # a row key or a group (BEST_APP, ...)
    baseline: str                   # a row key, a group or BOUND
    min_speedup: Optional[float] = None   # baseline ms / row ms at least this
    max_ratio: Optional[float] = None     # row ms at most this x baseline ms
    scenarios: Tuple[str, ...] = ()       # the scenarios it applies to (empty: all ...)
    other_than: Tuple[str, ...] = ()      # ... but these
    pipeline_parallel: Optional[int] = None   # only at this P (None: any) ...
    max_pipeline_parallel: Optional[int] = None   # ... or at most this P
    min_pipeline_parallel: Optional[int] = None   # ... or at least this P
    only_if_best_static_splits: bool = False  # compare with whole-backward rows only when the best static splits
    report_missing: bool = False          # a baseline row not run: report n/a instead of skipping

    def applies(self, scenario: str, pipeline_parallel: int) -> bool:
        return ((not self.scenarios or scenario in self.scenarios) and scenario not in self.other_than
                and self.pipeline_parallel in (None, pipeline_parallel)
                and (self.max_pipeline_parallel is None or pipeline_parallel <= self.max_pipeline_parallel)
                and (self.min_pipeline_parallel is None or pipeline_parallel >= self.min_pipeline_parallel))


HOMOGENEOUS, SLOW_RANK = "homogeneous", "slow rank 1.5x"
_ADAPTIVE_VS = "adaptive >= 1.15x faster than {baseline}"
TARGETS: List[Target] = [
    # issue 14: the best APP policy with a split backward vs torch's zero bubble and our best whole backward
    Target("split", "{row} >= 1.0x torch-zb", VERSUS, BEST_APP_SPLIT, "torch-zb", min_speedup=1.0,
           scenarios=(HOMOGENEOUS,)),
    Target("split", "{row} >= 1.0x best whole-backward APP ({baseline})", VERSUS, BEST_APP_SPLIT, BEST_APP,
           min_speedup=1.0, scenarios=(HOMOGENEOUS,)),
    Target("split", "{row} >= 1.1x torch-zb", VERSUS, BEST_APP_SPLIT, "torch-zb", min_speedup=1.1,
           other_than=(HOMOGENEOUS,)),
    Target("split", "{row} >= 1.1x best whole-backward APP ({baseline})", VERSUS, BEST_APP_SPLIT, BEST_APP,
           min_speedup=1.1, other_than=(HOMOGENEOUS,)),
    # issue 23: ours (balanced + planned) vs each reference composition
    Target("composition", "{row} >= 1.35x {baseline}", QUOTIENT, COMPOSITION_OURS, "loader-padded", min_speedup=1.35,
           scenarios=("copyright 2048",), pipeline_parallel=4, report_missing=True),
    Target("composition", "{row} >= 1.15x {baseline}", QUOTIENT, COMPOSITION_OURS, "loader-packed", min_speedup=1.15,
           scenarios=("copyright 2048",), pipeline_parallel=4, report_missing=True),
    Target("composition", "{row} >= 1.1x {baseline}", QUOTIENT, COMPOSITION_OURS, "dp-balanced", min_speedup=1.1,
           scenarios=("copyright 2048",), pipeline_parallel=4, report_missing=True),
    Target("composition", "{row} >= 2.0x {baseline}", QUOTIENT, COMPOSITION_OURS, "loader-padded", min_speedup=2.0,
           scenarios=("copyright 8192",), pipeline_parallel=4, report_missing=True),
    Target("composition", "{row} >= 1.3x {baseline}", QUOTIENT, COMPOSITION_OURS, "loader-packed", min_speedup=1.3,
           scenarios=("copyright 8192",), pipeline_parallel=4, report_missing=True),
    Target("composition", "{row} >= 1.4x {baseline}", QUOTIENT, COMPOSITION_OURS, "loader-packed", min_speedup=1.4,
           scenarios=("copyright 8192",), pipeline_parallel=8, report_missing=True),
    # better than `planned` alone measured (issue 23)
    Target("composition", "{row} >= 1.09x {baseline}", QUOTIENT, COMPOSITION_OURS, "loader-padded", min_speedup=1.09,
           scenarios=("variable length",), pipeline_parallel=4, report_missing=True),
    # issue 13: planned vs Megatron's interleaved order (data order) on variable lengths
    Target("variable", "{row} >= 1.25x faster than Megatron interleaved (data order)", QUOTIENT, "planned",
           "interleaved", min_speedup=1.25, max_pipeline_parallel=4),
    Target("variable", "{row} >= 1.4x faster than Megatron interleaved (data order)", QUOTIENT, "planned",
           "interleaved", min_speedup=1.4, min_pipeline_parallel=5),
    # the whole rows
    Target("whole", "best APP policy within 3% of the best static schedule",
           "{row} {row_ms:.1f} ms vs {baseline} {baseline_ms:.1f} ms ({ratio:.3f}x)", BEST_APP, BEST_STATIC,
           max_ratio=1.03, scenarios=(HOMOGENEOUS,)),
    # ZeroBubble splits each backward in two and fills bubbles with the halves; Megatron's backward_step (what our
    # runtime runs) cannot, so also compare with the schedules that run backwards whole.
    Target("whole", "best APP policy within 3% of the best static schedule with whole backwards",
           "{row_ms:.1f} ms vs {baseline} {baseline_ms:.1f} ms ({ratio:.3f}x)", BEST_APP, BEST_WHOLE_STATIC,
           max_ratio=1.03, scenarios=(HOMOGENEOUS,), only_if_best_static_splits=True),
    Target("whole", "best APP policy within 5% of the lower bound",
           "{row} {row_ms:.1f} ms vs bound {baseline_ms:.1f} ms ({ratio:.3f}x)", BEST_APP, BOUND, max_ratio=1.05,
           scenarios=(SLOW_RANK,)),
    Target("whole", "best APP policy never slower than the static orders",
           "{row_ms:.1f} ms vs fastest static {baseline} {baseline_ms:.1f} ms", BEST_APP, BEST_STATIC, max_ratio=1.0,
           scenarios=(SLOW_RANK,)),
    Target("whole", _ADAPTIVE_VS, QUOTIENT, "adaptive", "interleaved", min_speedup=1.15,
           other_than=(HOMOGENEOUS, SLOW_RANK)),
    Target("whole", _ADAPTIVE_VS, QUOTIENT, "adaptive", "torch-interleaved", min_speedup=1.15,
           other_than=(HOMOGENEOUS, SLOW_RANK)),
]


@dataclass
class TargetCheck:
    scenario: str
    target: str
    measured: str
    passed: Optional[bool]      # None: could not be evaluated (a row is missing)


def _fastest(rows: List[Row]) -> Optional[Row]:
    return min(rows, key=lambda r: r.iteration_ms) if rows else None


def _groups(group: List[Row]) -> Dict[str, Optional[Row]]:
    """The fastest row of each named group, and every row by key."""
    app = [row for row in group if row.key in ADAPTIVE_POLICY_NAMES]
    static = [row for row in group if row not in app]
    return {**{row.key: row for row in group}, BEST_APP: _fastest(app), BEST_STATIC: _fastest(static),
            BEST_WHOLE_STATIC: _fastest([row for row in static if row.key not in TORCH_SPLIT_KEYS]),
            BEST_APP_SPLIT: _fastest([row for row in group if row.key in APP_SPLIT_KEYS])}


def _check(target: Target, scenario: str, rows: Dict[str, Optional[Row]]) -> Optional[TargetCheck]:
    """None when the target does not apply to this run (a row it compares was not run)."""
    row = rows.get(target.row)
    if row is None:
        return None
    if target.only_if_best_static_splits and (rows[BEST_STATIC] is None
                                              or rows[BEST_STATIC].key not in TORCH_SPLIT_KEYS):
        return None
    if target.baseline == BOUND:
        baseline_label, baseline_ms = BOUND, row.bound_ms
    else:
        baseline = rows.get(target.baseline)
        if baseline is None:
            if target.report_missing:
                return TargetCheck(scenario, target.text.format(row=row.label, baseline=target.baseline),
                                   "row not run", None)
            return None
        baseline_label, baseline_ms = baseline.label, baseline.iteration_ms
    if baseline_ms is None:
        return None
    speedup, ratio = baseline_ms / row.iteration_ms, row.iteration_ms / baseline_ms
    passed = speedup >= target.min_speedup if target.min_speedup is not None else ratio <= target.max_ratio
    return TargetCheck(scenario, target.text.format(row=row.label, baseline=baseline_label),
                       target.measured.format(row=row.label, row_ms=row.iteration_ms, baseline=baseline_label,
                                              baseline_ms=baseline_ms, speedup=speedup, ratio=ratio), passed)


def _family_checks(family: str, scenario: str, group: List[Row], row_key: Optional[str] = None) -> List[TargetCheck]:
    rows = _groups(group)
    pipeline_parallel = len(group[0].peak_tokens or group[0].peak_activations)
    checks = [_check(target, scenario, rows) for target in TARGETS
              if target.family == family and target.applies(scenario, pipeline_parallel)
              and (row_key is None or target.row == row_key)]
    return [check for check in checks if check is not None]


def _sim_check(scenario: str, row: Row, tolerance: float) -> TargetCheck:
    return TargetCheck(scenario, f"simulator predicts {row.label} within {tolerance:.0%}",
                       f"measured {row.iteration_ms:.1f} ms vs sim {row.sim_ms:.1f} ms ({row.sim_error:+.1%})",
                       abs(row.sim_error) <= tolerance)


def check_targets(rows: List[Row]) -> List[TargetCheck]:
    checks: List[TargetCheck] = []
    for scenario in dict.fromkeys(row.scenario for row in rows):
        in_scenario = [row for row in rows if row.scenario == scenario]
        if any(row.key in APP_SPLIT_KEYS for row in in_scenario):
            checks += _family_checks("split", scenario, in_scenario)
        checks += _composition_checks(scenario, [row for row in in_scenario if row.composition])
        group = [row for row in in_scenario if row.key not in OUR_SPLIT_KEYS and not row.composition]
        app = [row for row in group if row.key in ADAPTIVE_POLICY_NAMES]
        if not app or len(app) == len(group):
            continue        # nothing to compare: no APP policy or no static schedule
        if group[0].peak_tokens:
            checks += _variable_length_checks(scenario, group)
            continue
        checks += _family_checks("whole", scenario, group)
        interleaved = next((row for row in group if row.key == MEGATRON_ROW), None)
        if interleaved is not None:
            worse = [f"{row.label} {row.peak_activations}" for row in app
                     if any(a > b for a, b in zip(row.peak_activations, interleaved.peak_activations))]
            checks.append(TargetCheck(scenario, "peak activations of every APP policy <= Megatron interleaved's",
                                      "; ".join(worse) if worse else
                                      f"all <= {interleaved.peak_activations}", not worse))
    checks += [_sim_check(row.scenario, row, SIM_TOLERANCE) for row in rows
               if row.system == "app" and row.sim_error is not None and not row.peak_tokens]
    return checks


def _variable_length_checks(scenario: str, group: List[Row]) -> List[TargetCheck]:
    """Issue 13: the "variable" targets, and every row of our runtime within its memory factor of interleaved's peak
    activation tokens on every rank; the simulator within 10% for every row."""
    interleaved = next((row for row in group if row.key == MEGATRON_ROW), None)
    checks = []
    if interleaved is not None:
        for row in group:
            if row.system != "app" or row.key == MEGATRON_ROW:
                continue
            checks += _family_checks("variable", scenario, group, row_key=row.key)
            speedup = interleaved.iteration_ms / row.iteration_ms
            allowed = row.memory_factor or 1.0
            over = max(a / b for a, b in zip(row.peak_tokens, interleaved.peak_tokens))
            checks.append(TargetCheck(scenario, f"{row.label} peak activation tokens <= {allowed:g}x interleaved's "
                                      "on every rank", f"{speedup:.3f}x speed-up, tokens {row.peak_tokens} vs "
                                      f"{interleaved.peak_tokens} (max {over:.3f}x)", over <= allowed + 1e-9))
    checks += [_sim_check(scenario, row, SIM_TOLERANCE_LENGTHS) for row in group if row.sim_error is not None]
    return checks


def _composition_checks(scenario: str, group: List[Row]) -> List[TargetCheck]:
    """Issue 23: the "composition" targets at <= COMPOSITION_MEMORY_BOUND x the baseline's peak activation tokens on
    every rank; the simulator within 10% of every composition row."""
    if not group:
        return []
    checks = _family_checks("composition", scenario, group)
    ours = next((row for row in group if row.key == COMPOSITION_OURS), None)
    if ours is not None and ours.peak_tokens_over_base is not None:
        base = next(row for row in group if row.key == COMPOSITION_BASELINE)
        checks.append(TargetCheck(scenario, f"{ours.label} peak activation tokens <= {COMPOSITION_MEMORY_BOUND:.1f}x "
                                  f"the baseline's on every rank", f"max {ours.peak_tokens_over_base:.3f}x "
                                  f"({ours.peak_tokens} vs {base.peak_tokens})",
                                  ours.peak_tokens_over_base <= COMPOSITION_MEMORY_BOUND + 1e-9))
    checks += [_sim_check(scenario, row, SIM_TOLERANCE_LENGTHS) for row in group if row.sim_error is not None]
    return checks
