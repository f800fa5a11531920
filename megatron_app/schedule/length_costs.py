"""Task duration as a function of a microbatch's composition, learnt per (kind, chunk) from observed durations.

A transformer layer's time on a microbatch is a + b*T + c*S: T its tokens (MLP and projections are linear in
tokens) and S the sum over its attention blocks of their squared lengths (attention's score matrix): a packed
microbatch of documents l_1..l_k has T = sum l_i, S = sum l_i^2; a padded one of r rows of longest length L has
T = r*L, S = r*L^2. A caller that gives only a length L means one block of L tokens (S = L^2), so a padded
microbatch of one length is a special case of the same fit. Each (kind, chunk) keeps a least-squares fit on
[1, T, S]. Until a (kind, chunk) has seen three distinct compositions, its prediction is proportional to T, scaled
by what was seen (or by the prior backward = 2 x forward).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import ScheduleConfigError
from .tasks import Kind

_PRIOR_SECONDS_PER_TOKEN = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0}
_FEATURES = 3
_RIDGE = 1e-9          # keeps the normal equations solvable when compositions repeat
_FLOOR_SHARE = 0.1     # never predict below this share of the proportional estimate (extrapolation guard)


class _Fit:
    """Running normal equations of one (kind, chunk) regression, tokens scaled by the first microbatch seen."""

    def __init__(self, scale: float):
        self.scale = scale
        self.gram = [[0.0] * _FEATURES for _ in range(_FEATURES)]
        self.moment = [0.0] * _FEATURES
        self.compositions = set()
        self.seconds_per_token_sum = 0.0
        self.samples = 0
        self._coefficients: Optional[List[float]] = None

    def add(self, tokens: float, squared: float, seconds: float) -> None:
        features = (1.0, tokens / self.scale, squared / self.scale ** 2)
        for i in range(_FEATURES):
            self.moment[i] += features[i] * seconds
            for j in range(_FEATURES):
                self.gram[i][j] += features[i] * features[j]
        self.compositions.add((tokens, squared))
        self.seconds_per_token_sum += seconds / tokens
        self.samples += 1
        self._coefficients = None

    def affine(self) -> Optional[Tuple[float, float, float]]:
        """(a, b, c) of seconds = a + b*T + c*S in unscaled units, or None while the fit is proportional."""
        if len(self.compositions) < _FEATURES:
            return None
        if self._coefficients is None:
            self._coefficients = _solve(self.gram, self.moment)
        a, b, c = self._coefficients
        return a, b / self.scale, c / self.scale ** 2

    def predict(self, tokens, squared):
        """Works on floats and numpy arrays alike."""
        linear = self.seconds_per_token_sum / self.samples * tokens
        affine = self.affine()
        if affine is None:
            return linear
        a, b, c = affine
        return np.maximum(a + b * tokens + c * squared, _FLOOR_SHARE * linear)


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


def _squared_or_default(length: float, squared_tokens: Optional[float]) -> float:
    return float(length) ** 2 if squared_tokens is None else float(squared_tokens)


class LengthCostModel:
    """duration = f(tokens, squared tokens) per (kind, chunk); `observe` adds a sample, `seconds` predicts.
    squared_tokens=None means one attention block of `length` tokens (length^2)."""

    def __init__(self):
        self._fits: Dict[Tuple[Kind, int], _Fit] = {}

    def observe(self, kind: Kind, chunk: int, length: float, seconds: float,
                squared_tokens: Optional[float] = None) -> None:
        if not length > 0:
            raise ScheduleConfigError(f"a microbatch length must be > 0, got {length!r}")
        if not seconds >= 0.0:   # also rejects NaN
            raise ScheduleConfigError(f"observed duration must be >= 0 seconds, got {seconds!r}")
        squared = _squared_or_default(length, squared_tokens)
        if not squared > 0:
            raise ScheduleConfigError(f"squared tokens must be > 0, got {squared_tokens!r}")
        key = (kind, chunk)
        if key not in self._fits:
            self._fits[key] = _Fit(scale=float(length))
        self._fits[key].add(float(length), squared, float(seconds))

    @property
    def calibrated(self) -> bool:
        """Predictions are in seconds once any duration was observed (before, the prior is a relative scale)."""
        return bool(self._fits)

    def samples(self, kind: Kind, chunk: int) -> int:
        fit = self._fits.get((kind, chunk))
        return 0 if fit is None else fit.samples

    def seconds(self, kind: Kind, chunk: int, length: float, squared_tokens: Optional[float] = None) -> float:
        """Predicted duration. Unseen (kind, chunk): the mean over the same kind's chunks, else the other kind's
        scaled by the prior ratio, else the prior (1 per token forward, 2 backward: a relative scale only)."""
        return float(self.seconds_of(kind, chunk, float(length), _squared_or_default(length, squared_tokens)))

    def seconds_of(self, kind: Kind, chunk: int, tokens, squared):
        """seconds() on numpy arrays of tokens and squared tokens (one entry per microbatch)."""
        fit = self._fits.get((kind, chunk))
        if fit is not None:
            return fit.predict(tokens, squared)
        for source in (kind, Kind.BACKWARD if kind is Kind.FORWARD else Kind.FORWARD):
            seen = [f for (k, _), f in self._fits.items() if k is source]
            if seen:
                mean = sum(f.predict(tokens, squared) for f in seen) / len(seen)
                return mean * _PRIOR_SECONDS_PER_TOKEN[kind] / _PRIOR_SECONDS_PER_TOKEN[source]
        return _PRIOR_SECONDS_PER_TOKEN[kind] * tokens

    def duration_table(self, kinds: Sequence[Kind], num_chunks: int, tokens: Sequence[float],
                       squared: Sequence[float]) -> np.ndarray:
        """len(kinds)*num_chunks x m predicted durations, rows kind-major (the plan evaluator's layout)."""
        t = np.asarray(tokens, dtype=float)
        s = np.asarray(squared, dtype=float)
        return np.array([np.broadcast_to(self.seconds_of(kind, chunk, t, s), t.shape)
                         for kind in kinds for chunk in range(num_chunks)], dtype=float)
