"""Interval arithmetic on (start, end) pairs: union length, concurrency over time, busy fraction per window."""

from __future__ import annotations

from typing import Iterable, Sequence

Interval = tuple[float, float]


def union_length(intervals: Iterable[Interval]) -> float:
    """Total time covered by at least one interval (overlaps counted once)."""
    return sum(end - start for start, end in _merge(intervals))


def concurrency_steps(deltas: Iterable[tuple[float, int]]) -> list[tuple[float, int]]:
    """Running sum of (time, +n/-n) changes as (time, level) steps. At equal times decrements apply first, so an
    interval that ends exactly when another starts does not overlap it."""
    steps: list[tuple[float, int]] = []
    level = 0
    for time, delta in sorted(deltas):
        level += delta
        if steps and steps[-1][0] == time:
            steps[-1] = (time, level)
        else:
            steps.append((time, level))
    return steps


def max_concurrency(deltas: Iterable[tuple[float, int]]) -> int:
    return max((level for _, level in concurrency_steps(deltas)), default=0)


def interval_deltas(intervals: Iterable[Interval]) -> list[tuple[float, int]]:
    out: list[tuple[float, int]] = []
    for start, end in intervals:
        out.append((start, 1))
        out.append((end, -1))
    return out


def max_level_per_bin(steps: Sequence[tuple[float, int]], edges: Sequence[float]) -> list[int]:
    """Highest level of a step function (from concurrency_steps; 0 before the first step) within each bin
    [edges[i], edges[i+1]). Short peaks are kept, so sub-pixel sends still show."""
    out = []
    index = 0
    level = 0
    for lo, hi in zip(edges, edges[1:]):
        while index < len(steps) and steps[index][0] <= lo:
            level = steps[index][1]
            index += 1
        peak = level
        probe = index
        while probe < len(steps) and steps[probe][0] < hi:
            peak = max(peak, steps[probe][1])
            probe += 1
        out.append(peak)
    return out


def busy_fraction(intervals: Sequence[Interval], window_starts: Sequence[float], window: float) -> list[float]:
    """For each window [t, t + window), the fraction of it covered by the (non-overlapping after union) intervals."""
    merged = _merge(intervals)
    out = []
    for t in window_starts:
        lo, hi = t, t + window
        covered = sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in merged if start < hi and end > lo)
        out.append(covered / window if window > 0 else 0.0)
    return out


def _merge(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]
