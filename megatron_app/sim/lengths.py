"""Microbatch lengths (tokens) per iteration and the compute cost they imply.

A microbatch of L tokens costs base x (linear * x + quadratic * x^2) / (linear + quadratic) with x = L / mean length,
on every stage and chunk alike (a long microbatch is long everywhere): the base forward/backward times are the cost
of a microbatch of mean length. Its activations are sized by its tokens.

Lengths come from a lognormal distribution (median `median_tokens`, log-sd `sigma`) or from a list of real lengths
(a file, one per line: e.g. the token counts of a corpus), shuffled per iteration with the seed as a data loader
shuffles documents; the draws are keyed by (seed, iteration) so every policy meets the same lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from megatron_app.schedule import ScheduleConfigError

from .checks import check_number

_LENGTH_STREAM = 3
DEFAULT_LINEAR, DEFAULT_QUADRATIC = 0.7, 0.3
DEFAULT_MEDIAN_TOKENS = 256


@dataclass(frozen=True)
class MicrobatchLengths:
    sigma: Optional[float] = None               # lognormal log-sd; None when `corpus` gives the lengths
    corpus: Optional[Tuple[int, ...]] = None    # real lengths to draw from
    median_tokens: int = DEFAULT_MEDIAN_TOKENS
    linear: float = DEFAULT_LINEAR
    quadratic: float = DEFAULT_QUADRATIC

    def __post_init__(self):
        if (self.sigma is None) == (self.corpus is None):
            raise ScheduleConfigError("microbatch lengths need exactly one source: a lognormal sigma or a list")
        if self.sigma is not None:
            check_number("length sigma", self.sigma, 0.0)
        else:
            if not self.corpus or not all(isinstance(v, int) and v > 0 for v in self.corpus):
                raise ScheduleConfigError("the list of lengths must hold positive integers")
        if isinstance(self.median_tokens, bool) or not isinstance(self.median_tokens, int) or self.median_tokens < 1:
            raise ScheduleConfigError(f"median tokens must be an int >= 1, got {self.median_tokens!r}")
        check_number("linear cost coefficient", self.linear, 0.0)
        check_number("quadratic cost coefficient", self.quadratic, 0.0)
        if self.linear + self.quadratic <= 0:
            raise ScheduleConfigError("the length cost needs a positive linear or quadratic coefficient")

    @classmethod
    def from_file(cls, path, **options) -> "MicrobatchLengths":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ScheduleConfigError(f"cannot read lengths file {path}: {exc.strerror or exc}") from None
        values = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                value = int(line)
            except ValueError:
                raise ScheduleConfigError(f"{path}:{number}: expected a token count, got {line!r}") from None
            if value < 1:
                raise ScheduleConfigError(f"{path}:{number}: a length must be >= 1, got {value}")
            values.append(value)
        if not values:
            raise ScheduleConfigError(f"{path} holds no lengths")
        return cls(corpus=tuple(values), **options)

    @property
    def mean_tokens(self) -> float:
        if self.corpus is not None:
            return sum(self.corpus) / len(self.corpus)
        return self.median_tokens * math.exp(self.sigma ** 2 / 2)

    def draw(self, count: int, seed: int, iteration: int) -> Tuple[int, ...]:
        rng = np.random.default_rng([seed, _LENGTH_STREAM, iteration])
        if self.corpus is not None:
            picks = rng.permutation(len(self.corpus))[:count] if count <= len(self.corpus) else \
                rng.integers(0, len(self.corpus), size=count)
            return tuple(self.corpus[i] for i in picks)
        values = rng.lognormal(math.log(self.median_tokens), self.sigma, size=count)
        return tuple(max(1, int(round(v))) for v in values)

    def cost_factor(self, length: float) -> float:
        return self.composed_cost_factor(length, length * length)

    def composed_cost_factor(self, tokens: float, squared_tokens: float) -> float:
        """Cost of a microbatch over one mean-length document's: linear in its tokens, quadratic in each attention
        block's length (squared_tokens = the sum of the blocks' squared lengths: its documents packed, rows x
        longest^2 padded). The simulator's composition rows and the emulated tasks both use it."""
        mean = self.mean_tokens
        return (self.linear * tokens / mean + self.quadratic * squared_tokens / mean ** 2) / (self.linear
                                                                                            + self.quadratic)

    def weight_share_factor(self, length: float) -> float:
        """How a microbatch's length scales the weight-gradient share of its backward (1 at the mean length). The
        weight gradients are GEMMs linear in tokens; the quadratic term is attention, which has no weights and
        stays in B: W grows as x while the whole backward grows as cost_factor(x)."""
        x = length / self.mean_tokens
        return x / self.cost_factor(length) if x > 0 else 1.0

    def describe(self) -> dict:
        source = {"sigma": self.sigma, "median_tokens": self.median_tokens}
        if self.corpus is not None:
            source = {"corpus_lengths": len(self.corpus), "corpus_mean_tokens": self.mean_tokens}
        return {**source, "cost": f"{self.linear:g}x + {self.quadratic:g}x^2 (x = tokens / mean)"}
