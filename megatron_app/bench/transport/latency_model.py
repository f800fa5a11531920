"""The latency model quoted in BENCHMARKS.md: time(n) = fixed + n / rate, fitted to one-way times per message size.

The fit minimises the *relative* error at each size (weighted least squares with weights 1/t^2): the sizes span
four orders of magnitude, and an ordinary fit would be decided by the largest message alone, leaving the fixed
cost meaningless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyModel:
    fixed_us: float  # per-message cost: what a 0-byte message would take
    gbs: float       # per-byte cost as a rate, 1e9 bytes/s (inf when the fit finds no per-byte cost)
    worst_relative_error: float  # largest |fit - measured| / measured over the fitted sizes

    def predict_us(self, size: int) -> float:
        return self.fixed_us + (0.0 if math.isinf(self.gbs) else size / self.gbs / 1e3)

    def describe(self) -> str:
        rate = "no per-byte cost" if math.isinf(self.gbs) else f"{self.gbs:.2f} GB/s"
        return f"{self.fixed_us:.1f} us + n / {rate} (worst fit error {self.worst_relative_error:.0%})"


def fit_latency_model(sizes, times_us) -> LatencyModel:
    """Fits fixed + n / rate to (size in bytes, one-way time in microseconds) pairs; at least two distinct sizes."""
    points = [(float(n), float(t)) for n, t in zip(sizes, times_us, strict=True)]
    if len({n for n, _ in points}) < 2:
        raise ValueError("a latency model needs times for at least two different sizes")
    if any(t <= 0 or not math.isfinite(t) for _, t in points):
        raise ValueError("times must be positive and finite")
    # Minimise sum(((a + b n - t) / t)^2): normal equations of the weighted problem with w = 1 / t^2.
    sw = sum(1 / t**2 for _, t in points)
    swn = sum(n / t**2 for n, t in points)
    swnn = sum(n * n / t**2 for n, t in points)
    swt = sum(1 / t for _, t in points)
    swnt = sum(n / t for n, t in points)
    determinant = sw * swnn - swn * swn
    fixed_us = (swt * swnn - swn * swnt) / determinant
    us_per_byte = (sw * swnt - swn * swt) / determinant
    gbs = math.inf if us_per_byte <= 0 else 1e-3 / us_per_byte
    model = LatencyModel(fixed_us, gbs, 0.0)
    worst = max(abs(model.predict_us(int(n)) - t) / t for n, t in points)
    return LatencyModel(fixed_us, gbs, worst)
