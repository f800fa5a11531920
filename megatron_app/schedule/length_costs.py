"""Task duration as a function of the microbatch's tokens, learnt per (kind, chunk) from observed durations.

A transformer layer's time is a + b*L + c*L^2 in the sequence length L (the MLP and projections are linear in L,
attention's score matrix quadratic), so each (kind, chunk) keeps a least-squares fit on [1, L, L^2]. Until a
(kind, chunk) has seen three distinct lengths, its prediction is proportional to L, scaled by what was seen (or
by the prior backward = 2 x forward).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .errors import ScheduleConfigError
from .tasks import Kind

_PRIOR_SECONDS_PER_TOKEN = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0}
_FEATURES = 3
_RIDGE = 1e-9          # keeps the normal equations solvable when lengths repeat


class _Fit:
    """Running normal equations of one (kind, chunk) regression, lengths scaled by the first one seen."""

    def __init__(self, scale: float):
        self.scale = scale
        self.gram = [[0.0] * _FEATURES for _ in range(_FEATURES)]
        self.moment = [0.0] * _FEATURES
        self.lengths = set()
        self.seconds_per_token_sum = 0.0
        self.samples = 0
        self._coefficients: Optional[List[float]] = None

    def add(self, length: float, seconds: float) -> None:
        x = length / self.scale
        features = (1.0, x, x * x)
        for i in range(_FEATURES):
            self.moment[i] += features[i] * seconds
            for j in range(_FEATURES):
                self.gram[i][j] += features[i] * features[j]
        self.lengths.add(length)
        self.seconds_per_token_sum += seconds / length
        self.samples += 1
        self._coefficients = None

    def predict(self, length: float) -> float:
        if len(self.lengths) < _FEATURES:
            return self.seconds_per_token_sum / self.samples * length
        if self._coefficients is None:
            self._coefficients = _solve(self.gram, self.moment)
        a, b, c = self._coefficients
        x = length / self.scale
        linear = self.seconds_per_token_sum / self.samples * length
        value = a + b * x + c * x * x
        # An extrapolation far outside the lengths seen can turn negative; never predict below a tenth of the
        # proportional estimate.
        return max(value, 0.1 * linear)


def _solve(gram: List[List[float]], moment: List[float]) -> List[float]:
    """Gaussian elimination with partial pivoting on the (ridge-regularised) 3 x 3 normal equations."""
    n = len(moment)
    a = [[gram[i][j] + (_RIDGE * (gram[i][i] or 1.0) if i == j else 0.0) for j in range(n)] + [moment[i]]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0.0:
            return [0.0, moment[0] / (gram[0][1] or 1.0), 0.0]
        for row in range(col + 1, n):
            factor = a[row][col] / a[col][col]
            for k in range(col, n + 1):
                a[row][k] -= factor * a[col][k]
    solution = [0.0] * n
    for row in reversed(range(n)):
        solution[row] = (a[row][n] - sum(a[row][k] * solution[k] for k in range(row + 1, n))) / a[row][row]
    return solution


class LengthCostModel:
    """duration = f(tokens) per (kind, chunk); `observe` adds a sample, `seconds` predicts."""

    def __init__(self):
        self._fits: Dict[Tuple[Kind, int], _Fit] = {}

    def observe(self, kind: Kind, chunk: int, length: float, seconds: float) -> None:
        if not length > 0:
            raise ScheduleConfigError(f"a microbatch length must be > 0, got {length!r}")
        if not seconds >= 0.0:   # also rejects NaN
            raise ScheduleConfigError(f"observed duration must be >= 0 seconds, got {seconds!r}")
        key = (kind, chunk)
        if key not in self._fits:
            self._fits[key] = _Fit(scale=float(length))
        self._fits[key].add(float(length), float(seconds))

    def samples(self, kind: Kind, chunk: int) -> int:
        fit = self._fits.get((kind, chunk))
        return 0 if fit is None else fit.samples

    def seconds(self, kind: Kind, chunk: int, length: float) -> float:
        """Predicted duration. Unseen (kind, chunk): the mean over the same kind's chunks, else the other kind's
        scaled by the prior ratio, else the prior (1 per token forward, 2 backward: a relative scale only)."""
        fit = self._fits.get((kind, chunk))
        if fit is not None:
            return fit.predict(length)
        for source in (kind, Kind.BACKWARD if kind is Kind.FORWARD else Kind.FORWARD):
            seen = [f for (k, _), f in self._fits.items() if k is source]
            if seen:
                mean = sum(f.predict(length) for f in seen) / len(seen)
                return mean * _PRIOR_SECONDS_PER_TOKEN[kind] / _PRIOR_SECONDS_PER_TOKEN[source]
        return _PRIOR_SECONDS_PER_TOKEN[kind] * length
