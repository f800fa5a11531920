"""Predicted against measured: how far the plan's picture of the model is from what ran.

A planned iteration's compute events carry, in `extra`, the plan's predicted start (`predicted_start_us`, on the same
clock as the event) and duration (`predicted_us`) of that task (runtime/executor.py, from the `planned` policy's
learnt costs). This module compares them per (kind, chunk), over the whole iteration (the predicted makespan: the
latest predicted end after the earliest predicted start, against the measured one over the same tasks) and names the
tasks that were mispredicted most. Traces without predictions give no report.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from .schema import TraceEvent

PREDICTED_START = "predicted_start_us"
PREDICTED_DURATION = "predicted_us"
WORST_SHOWN = 5


@dataclass
class KindChunkError:
    kind: str
    chunk: int
    tasks: int
    measured_mean_us: float
    predicted_mean_us: float
    median_abs_error: float      # |measured - predicted| / measured, median over tasks
    bias: float                  # sum(measured) / sum(predicted) - 1: > 0 the model is optimistic


@dataclass
class Mispredicted:
    rank: int
    kind: str
    chunk: int
    microbatch: int
    measured_us: float
    predicted_us: float


@dataclass
class PredictionReport:
    iteration: int
    measured_makespan_us: float
    predicted_makespan_us: float
    per_kind_chunk: List[KindChunkError] = field(default_factory=list)
    worst: List[Mispredicted] = field(default_factory=list)

    @property
    def makespan_error(self) -> float:
        return self.measured_makespan_us / self.predicted_makespan_us - 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "makespan_error": self.makespan_error}


def _predicted(event: TraceEvent) -> Optional[Tuple[float, float]]:
    start, duration = event.extra.get(PREDICTED_START), event.extra.get(PREDICTED_DURATION)
    if not isinstance(start, (int, float)) or not isinstance(duration, (int, float)):
        return None
    return float(start), float(duration)


def prediction_report(iteration: int, events: List[TraceEvent]) -> Optional[PredictionReport]:
    """From every rank's events of one iteration; None when no compute event carries a prediction."""
    planned = [(event, _predicted(event)) for event in events if event.is_compute]
    planned = [(event, p) for event, p in planned if p is not None]
    if not planned:
        return None
    groups: Dict[Tuple[str, int], list] = {}
    for event, (_, duration) in planned:
        groups.setdefault((event.kind, event.chunk), []).append((event.duration, duration))
    per_kind_chunk = []
    for (kind, chunk), pairs in sorted(groups.items()):
        measured = [m for m, _ in pairs]
        predicted = [p for _, p in pairs]
        per_kind_chunk.append(KindChunkError(
            kind, chunk, len(pairs), statistics.fmean(measured), statistics.fmean(predicted),
            statistics.median(abs(m - p) / m if m > 0 else 0.0 for m, p in pairs),
            sum(measured) / sum(predicted) - 1.0 if sum(predicted) > 0 else 0.0))
    worst = sorted(planned, key=lambda item: -abs(item[0].duration - item[1][1]))[:WORST_SHOWN]
    measured_span = max(e.end for e, _ in planned) - min(e.start for e, _ in planned)
    predicted_span = max(s + d for _, (s, d) in planned) - min(s for _, (s, _) in planned)
    return PredictionReport(iteration, measured_span, predicted_span, per_kind_chunk,
                            [Mispredicted(e.rank, e.kind, e.chunk, e.microbatch, e.duration, p[1]) for e, p in worst])


def format_report(report: PredictionReport) -> str:
    lines = [f"plan's prediction, iteration {report.iteration}: makespan predicted "
             f"{report.predicted_makespan_us / 1e3:.3f} ms, measured {report.measured_makespan_us / 1e3:.3f} ms "
             f"({report.makespan_error:+.1%})",
             f"  {'kind':<10} {'chunk':>5} {'tasks':>5} {'measured ms':>12} {'predicted ms':>13} "
             f"{'median |err|':>13} {'bias':>7}"]
    for row in report.per_kind_chunk:
        lines.append(f"  {row.kind:<10} {row.chunk:>5} {row.tasks:>5} {row.measured_mean_us / 1e3:>12.3f} "
                     f"{row.predicted_mean_us / 1e3:>13.3f} {row.median_abs_error:>13.1%} {row.bias:>+7.1%}")
    lines.append("  mispredicted most: " + "; ".join(
        f"rank {w.rank} {w.kind} {w.chunk}-{w.microbatch} {w.measured_us / 1e3:.2f} ms (predicted "
        f"{w.predicted_us / 1e3:.2f})" for w in report.worst))
    return "\n".join(lines)
