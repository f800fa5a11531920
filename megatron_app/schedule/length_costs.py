"""Task duration as a function of a microbatch's composition, learnt per (kind, chunk, pipeline rank) from observed
durations.

A transformer layer's time on a microbatch is a + b*T + c*S: T its tokens (MLP and projections are linear in
tokens) and S the sum over its attention blocks of their squared lengths (attention's score matrix): a packed
microbatch of documents l_1..l_k has T = sum l_i, S = sum l_i^2; a padded one of r rows of longest length L has
T = r*L, S = r*L^2. A caller that gives only a length L means one block of L tokens (S = L^2), so a padded
microbatch of one length is a special case of the same fit.

What real kernels taught the form (CPU GPT, traces of P=2 V=2 runs; docs/variable-lengths.md has the numbers):
  * Per pipeline rank, not per chunk alone: the last stage's chunk also runs the output layer and the loss, the
    first the embedding, so the same chunk index costs up to a third more on one rank than on another. The rank
    that plans learns every rank's tasks (the runtime gathers them); a rank not seen yet costs what the seen ranks
    of the same chunk cost on average.
  * Non-negative coefficients: an unconstrained fit on a narrow range of sizes can put a negative intercept or
    token term against a large square term, which extrapolates badly to the larger microbatches a plan builds
    (up to 3x off in tests). Each fit keeps the non-negative least-squares solution (the best over the feature
    subsets whose solution is non-negative).
  * Plain squared error over the most recent samples: on a shared machine a task is only ever slowed (another
    process preempts it), never sped up, so what predicts an iteration is the mean duration, which least squares
    estimates; fits that discount the slow tasks (relative weights, Huber) predicted 4-6 points shorter than the
    measured iterations on the traces tried (bench/cost_model_replay.py). Only the last WINDOW samples are kept,
    so a machine whose speed changes (a competing process starts) is followed within a few iterations.
  * Growth samples aside: the first microbatch above every earlier size grows the allocator and touches new pages
    (28% slow on a CPU GPT); fitted, these largest samples set the slope and a P=1 `balanced` run was predicted
    3-8% long for many iterations. They are left out while the other samples determine the fit (_Fit).
Until a fit has seen three distinct compositions, its prediction is proportional to T, scaled by what was seen (or
by the prior backward = 2 x forward).

Besides its tasks, a rank spends time between them: taking an input, deciding the next task, posting a send, tracing
(0.1 ms a task on a CPU GPT of 1 ms tasks: predictions of P=2 V=2 runs came out 4-20% short). That per-task gap is
learnt per pipeline rank from each call (observe_gap: the mean time from one task's end to the next's start where the
rank waited for no input in between) and added to every task of the plan evaluator's tables (duration_table), never
to a task's own duration (seconds, seconds_of), which is what a trace's task span measures.
"""

from __future__ import annotations

import statistics
from collections import deque
from itertools import combinations
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import ScheduleConfigError
from .tasks import KINDS_BY_INDEX, Kind

_PRIOR_SECONDS_PER_TOKEN = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0}
_FEATURES = 3
_RIDGE = 1e-9          # keeps the normal equations solvable when compositions repeat
_FLOOR_SHARE = 0.1     # never predict below this share of the proportional estimate (extrapolation guard)
_UNREPORTED_MOST = 16384   # samples kept for the planning rank when nobody collects them (oldest dropped)
_GAP_CALLS = 8         # the per-task gap is the median over a rank's most recent calls (a slow call moves it little)
_GAP_SAMPLE = -1       # the kind index of a gap in take_unreported's tuples
WINDOW = 512           # the most recent samples each fit keeps: a machine whose speed changes is followed
# Every non-empty subset of the features, the fuller first: the non-negative solution is the best feasible one.
_SUBSETS = tuple(subset for size in range(_FEATURES, 0, -1) for subset in combinations(range(_FEATURES), size))


class _Fit:
    """One regression over its most recent samples, tokens scaled by the first microbatch seen. Warm-up samples
    (the first iteration's: CUDA and cuBLAS initialisation, allocator growth, first-use caches; on an H200 its
    first task took 20x its later ones) count only until a sample of a later iteration arrives. Growth samples (a
    microbatch larger than any this fit saw before: the allocator grows to hold it, first touches its pages, a
    kernel meets a new shape) are left out while the others alone determine the fit: on a CPU GPT the first
    2,154-token forward took 28% over its later like, and as the largest microbatches seen such samples set the
    slope, every later iteration predicted 3-8% long (BENCHMARKS.md, "What each feature buys")."""

    def __init__(self, scale: float, non_negative: bool = True, window: Optional[int] = WINDOW,
                 set_aside_growth: bool = True):
        self.scale = scale
        self.non_negative = non_negative
        self.set_aside_growth = set_aside_growth
        self.recent = deque(maxlen=window)       # (tokens, squared tokens, seconds, growth)
        self.warmup = deque(maxlen=window)       # the same, of the warm-up iteration
        self.samples = 0
        self.largest = 0.0                       # the most tokens of any sample so far (warm-up's included)
        self._coefficients: Optional[np.ndarray] = None
        self._seconds_per_token: Optional[float] = None
        self._fitted: Optional[Tuple[np.ndarray, int]] = None   # fitted's answer until the next sample

    def add(self, tokens: float, squared: float, seconds: float, warmup: bool = False) -> None:
        growth = self.set_aside_growth and self.samples > 0 and tokens > self.largest
        self.largest = max(self.largest, tokens)
        if warmup:
            self.warmup.append((tokens, squared, seconds, growth))
        else:
            self.recent.append((tokens, squared, seconds, growth))
            self.warmup.clear()
        self.samples += 1
        self._coefficients = None
        self._seconds_per_token = None
        self._fitted = None

    def affine(self) -> Optional[Tuple[float, float, float]]:
        """(a, b, c) of seconds = a + b*T + c*S in unscaled units, or None while the fit is proportional."""
        if self._coefficients is None:
            self._coefficients = self._solve()
        if not len(self._coefficients):
            return None
        a, b, c = self._coefficients
        return a, b / self.scale, c / self.scale ** 2

    @property
    def fitted(self) -> Tuple[np.ndarray, int]:
        """The samples the fit uses, as an N x 3 array of (tokens, squared tokens, seconds), and how many distinct
        compositions they hold: the recent ones but growth samples when the rest hold enough distinct compositions
        for the fit, all recent ones when not, the warm-up's while there are none. Kept until the next sample (a
        plan asks every fit several times)."""
        if self._fitted is None:
            samples = self.recent or self.warmup
            steady = [sample[:3] for sample in samples if not sample[3]]
            distinct = len({(t, s) for t, s, _ in steady})
            if distinct < _FEATURES:
                steady = [sample[:3] for sample in samples]
                distinct = len({(t, s) for t, s, _ in steady})
            self._fitted = (np.array(steady, dtype=float).reshape(-1, 3), distinct)
        return self._fitted

    def _solve(self) -> np.ndarray:
        fitted, distinct = self.fitted
        if distinct < _FEATURES:
            return np.zeros(0)
        tokens, squared, seconds = fitted.T
        features = np.stack([np.ones_like(tokens), tokens / self.scale, squared / self.scale ** 2], axis=1)
        return _least_squares(features.T @ features, features.T @ seconds,
                              _SUBSETS if self.non_negative else _SUBSETS[:1])

    def predict(self, tokens, squared):
        """Works on floats and numpy arrays alike."""
        if self._seconds_per_token is None:
            fitted, _ = self.fitted
            self._seconds_per_token = float(np.mean(fitted[:, 2] / fitted[:, 0]))
        linear = self._seconds_per_token * tokens
        affine = self.affine()
        if affine is None:
            return linear
        a, b, c = affine
        return np.maximum(a + b * tokens + c * squared, _FLOOR_SHARE * linear)


def _least_squares(gram: np.ndarray, moment: np.ndarray, subsets) -> np.ndarray:
    """argmin over c >= 0 of c'Gc - 2c'm (least squares from its normal equations): the best of the subsets'
    unconstrained solutions that are non-negative (with 3 features and every subset, the exact non-negative least
    squares; given the full set alone, the unconstrained solution)."""
    best, best_value = np.zeros(len(moment)), 0.0
    for subset in subsets:
        index = list(subset)
        block = gram[np.ix_(index, index)]
        block = block + _RIDGE * np.diag(np.where(np.diag(block) > 0, np.diag(block), 1.0))
        try:
            solution = np.linalg.solve(block, moment[index])
        except np.linalg.LinAlgError:
            continue
        if len(subsets) > 1 and (solution < 0).any():
            continue
        value = -float(solution @ moment[index])    # c'Gc - 2c'm at the subset's optimum
        if value < best_value:
            best_value = value
            best = np.zeros(len(moment))
            best[index] = solution
    return best


def _squared_or_default(length: float, squared_tokens: Optional[float]) -> float:
    return float(length) ** 2 if squared_tokens is None else float(squared_tokens)


class LengthCostModel:
    """duration = f(tokens, squared tokens) per (kind, chunk, pipeline rank); `observe` adds a sample, `seconds`
    predicts. squared_tokens=None means one attention block of `length` tokens (length^2)."""

    def __init__(self, per_rank: bool = True, non_negative: bool = True, window: Optional[int] = WINDOW,
                 set_aside_growth: bool = True, task_gaps: bool = True):
        """The switches turn this model's features off to measure what each buys (bench/cost_model_replay.py):
        per_rank False pools every rank's samples per (kind, chunk); non_negative False keeps the unconstrained fit;
        window None keeps every sample; set_aside_growth False fits growth samples like any other (_Fit);
        task_gaps False leaves the time between a rank's tasks out of the tables (observe_gap)."""
        self._fits: Dict[Tuple[Kind, int, int], _Fit] = {}
        self._gaps: Dict[int, deque] = {}    # pipeline rank -> seconds between tasks, one per recent call
        self._gap_of: Dict[Optional[int], float] = {}   # gap_seconds' answers until the next gap (planning asks often)
        self.task_gaps = task_gaps
        self._unreported = deque(maxlen=_UNREPORTED_MOST)
        self.per_rank, self.non_negative, self.window = per_rank, non_negative, window
        self.set_aside_growth = set_aside_growth
        self._calls: Dict[int, int] = {}    # pipeline rank -> calls started (start_call): the first warms up

    def start_call(self, rank: int = 0) -> None:
        """A call of pipeline rank `rank` begins: its samples are the warm-up's only in that rank's first call. Counted
        here, where the samples go, not per policy: the policies of a rank's microbatch counts share this model (a
        `balanced` run changes its count from iteration to iteration), and the first call of a second count is no
        warm-up (counted per policy, its samples were set aside as one)."""
        self._calls[rank] = self._calls.get(rank, 0) + 1

    def warming_up(self, rank: int = 0) -> bool:
        """Whether rank `rank` runs its first call (or none yet)."""
        return self._calls.get(rank, 0) <= 1

    def observe(self, kind: Kind, chunk: int, length: float, seconds: float,
                squared_tokens: Optional[float] = None, rank: int = 0, report: bool = True,
                warmup: bool = False) -> None:
        """One measured task. report: keep it for take_unreported() too (a sample this process measured; False for
        samples another rank reported). warmup: measured in the warm-up iteration (_Fit)."""
        if not length > 0:
            raise ScheduleConfigError(f"a microbatch length must be > 0, got {length!r}")
        if not seconds >= 0.0:   # also rejects NaN
            raise ScheduleConfigError(f"observed duration must be >= 0 seconds, got {seconds!r}")
        squared = _squared_or_default(length, squared_tokens)
        if not squared > 0:
            raise ScheduleConfigError(f"squared tokens must be > 0, got {squared_tokens!r}")
        key = (kind, chunk, rank if self.per_rank else 0)
        if key not in self._fits:
            self._fits[key] = _Fit(float(length), self.non_negative, self.window, self.set_aside_growth)
        self._fits[key].add(float(length), squared, float(seconds), warmup)
        if report:
            self._unreported.append((kind.index, chunk, rank, float(length), squared, float(seconds), warmup))

    def observe_gap(self, seconds: float, rank: int = 0, report: bool = True, warmup: bool = False) -> None:
        """A call's time between its tasks on pipeline rank `rank`: the mean from one task's end to the next's
        start where the rank waited for no input in between. A warm-up call's is left out (first-call costs)."""
        if not seconds >= 0.0:
            raise ScheduleConfigError(f"a gap between tasks must be >= 0 seconds, got {seconds!r}")
        if not warmup:
            self._gaps.setdefault(rank, deque(maxlen=_GAP_CALLS)).append(float(seconds))
            self._gap_of.clear()
        if report:
            self._unreported.append((_GAP_SAMPLE, 0, rank, 0.0, 0.0, float(seconds), warmup))

    def gap_seconds(self, rank: Optional[int] = None) -> float:
        """The learnt per-task gap of pipeline rank `rank` (None, or a rank not seen: the mean over the ranks seen;
        0.0 before any, or with task_gaps off)."""
        if not self.task_gaps or not self._gaps:
            return 0.0
        if rank not in self._gap_of:
            medians = {seen: statistics.median(gaps) for seen, gaps in self._gaps.items()}
            self._gap_of[rank] = medians[rank] if rank in medians else sum(medians.values()) / len(medians)
        return self._gap_of[rank]

    def take_unreported(self) -> List[Tuple[int, int, int, float, float, float, bool]]:
        """The samples observed here since the last call, as (kind index, chunk, rank, tokens, squared tokens,
        seconds, warm-up), gaps between tasks with kind index -1: what a rank sends the rank that plans
        (observe_reported there)."""
        samples = list(self._unreported)
        self._unreported.clear()
        return samples

    def observe_reported(self, samples) -> None:
        """Samples another rank measured (take_unreported's tuples)."""
        for kind, chunk, rank, tokens, squared, seconds, *warmup in samples:
            if kind == _GAP_SAMPLE:
                self.observe_gap(seconds, rank, report=False, warmup=bool(warmup and warmup[0]))
                continue
            self.observe(KINDS_BY_INDEX[kind], chunk, tokens, seconds, squared, rank=rank, report=False,
                         warmup=bool(warmup and warmup[0]))

    @property
    def calibrated(self) -> bool:
        """Predictions are in seconds once any duration was observed (before, the prior is a relative scale)."""
        return bool(self._fits)

    def ranks_seen(self) -> Tuple[int, ...]:
        return tuple(sorted({rank for _, _, rank in self._fits}))

    def samples(self, kind: Kind, chunk: int, rank: Optional[int] = None) -> int:
        return sum(fit.samples for (k, c, r), fit in self._fits.items()
                   if k is kind and c == chunk and (rank is None or r == rank))

    def seconds(self, kind: Kind, chunk: int, length: float, squared_tokens: Optional[float] = None,
                rank: Optional[int] = None) -> float:
        """Predicted duration on pipeline rank `rank` (None: the mean over the ranks seen). Unseen: see seconds_of."""
        return float(self.seconds_of(kind, chunk, float(length), _squared_or_default(length, squared_tokens), rank))

    def seconds_of(self, kind: Kind, chunk: int, tokens, squared, rank: Optional[int] = None):
        """seconds() on numpy arrays of tokens and squared tokens (one entry per microbatch). An unseen (kind, chunk,
        rank) costs the mean over the ranks seen for (kind, chunk); an unseen (kind, chunk) the mean over the same
        kind's fits, else the other kind's scaled by the prior ratio, else the prior (1 per token forward, 2
        backward: a relative scale only)."""
        fit = None if rank is None else self._fits.get((kind, chunk, rank))
        if fit is not None:
            return fit.predict(tokens, squared)
        same = [f for (k, c, _), f in self._fits.items() if k is kind and c == chunk]
        if same:
            return sum(f.predict(tokens, squared) for f in same) / len(same)
        for source in (kind, Kind.BACKWARD if kind is Kind.FORWARD else Kind.FORWARD):
            seen = [f for (k, _, _), f in self._fits.items() if k is source]
            if seen:
                mean = sum(f.predict(tokens, squared) for f in seen) / len(seen)
                return mean * _PRIOR_SECONDS_PER_TOKEN[kind] / _PRIOR_SECONDS_PER_TOKEN[source]
        return _PRIOR_SECONDS_PER_TOKEN[kind] * tokens

    def duration_table(self, kinds: Sequence[Kind], num_chunks: int, tokens: Sequence[float],
                       squared: Sequence[float], num_stages: Optional[int] = None) -> np.ndarray:
        """Predicted durations, one row per kind and chunk (num_stages None: every rank alike, rows kind * V +
        chunk) or per kind, pipeline rank and chunk (rows (kind * P + rank) * V + chunk), m columns: the plan
        evaluator's layouts (plan_graph.PlanGraph reads either). Each task's with its rank's gap before the next
        (gap_seconds): what the task holds the rank."""
        t = np.asarray(tokens, dtype=float)
        s = np.asarray(squared, dtype=float)
        ranks = (None,) if num_stages is None else range(num_stages)
        return np.array([np.broadcast_to(self.seconds_of(kind, chunk, t, s, rank) + self.gap_seconds(rank), t.shape)
                         for kind in kinds for rank in ranks for chunk in range(num_chunks)], dtype=float)


def by_kind(table: np.ndarray):
    """A duration_table of forwards and backwards as the plan search takes it: [forward rows, backward rows]."""
    half = len(table) // 2
    return [table[:half], table[half:]]
