"""Compute cost model: base forward/backward time per (rank, chunk), and the perturbations applied to it.

Random perturbations are drawn per task from a stream keyed by (seed, iteration, rank), never in execution order,
so every policy meets exactly the same task durations: comparisons between policies are paired, and the lower
bound (which depends only on the durations) is the same for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from megatron_app.schedule import KINDS_BY_INDEX, Kind, PipelineShape, ScheduleConfigError, Task

from .checks import check_number

FORWARD_INDEX, BACKWARD_INDEX, WEIGHT_INDEX = Kind.FORWARD.index, Kind.BACKWARD.index, Kind.WEIGHT.index
# The share of a backward's time that is its weight-gradient half when the backward is split (B + W = backward).
DEFAULT_WEIGHT_SHARE = 0.5


class DurationTable:
    """Microseconds of every task of one iteration, per rank: `us(rank, task)`. Built from a (ranks, kinds,
    chunks, microbatches) array (kinds in Kind.index order); np.asarray(table) gives that array back and
    table[rank] the rank's [kind][chunk][microbatch] rows."""

    __slots__ = ("_array", "_rows")

    def __init__(self, times):
        array = np.array(times, dtype=float)
        if array.ndim != 4 or array.shape[1] != len(KINDS_BY_INDEX):
            raise ScheduleConfigError(f"durations must be a (ranks, {len(KINDS_BY_INDEX)} kinds, chunks, "
                                      f"microbatches) table, got shape {array.shape}")
        array.setflags(write=False)
        self._array = array
        self._rows = array.tolist()     # nested lists: the simulator reads one task at a time

    def us(self, rank: int, task: Task) -> float:
        return self._rows[rank][task.kind.index][task.chunk][task.microbatch]

    @property
    def num_ranks(self) -> int:
        return self._array.shape[0]

    def __getitem__(self, rank: int) -> List[List[List[float]]]:
        return self._rows[rank]

    def __len__(self) -> int:
        return self.num_ranks

    def __iter__(self):
        return iter(self._rows)

    def __array__(self, dtype=None, copy=None):
        return self._array if dtype is None else self._array.astype(dtype)

    def __repr__(self) -> str:
        ranks, kinds, chunks, microbatches = self._array.shape
        return f"DurationTable(ranks={ranks}, kinds={kinds}, chunks={chunks}, microbatches={microbatches})"


_JITTER_STREAM, _STRAGGLER_STREAM = 1, 2


@dataclass(frozen=True)
class ComputeCosts:
    """Unperturbed task times in microseconds, one row per rank, one column per model chunk. backward_us is the
    whole backward; a split backward runs it as B = (1 - weight_share) x backward and W = weight_share x backward."""

    forward_us: tuple
    backward_us: tuple
    weight_share: float = DEFAULT_WEIGHT_SHARE

    def __post_init__(self):
        check_number("weight_share", self.weight_share, 0.0, maximum=1.0)
        tables = [tuple(tuple(check_number(f"{name}[{r}][{c}]", v, 0.0) for c, v in enumerate(row))
                        for r, row in enumerate(getattr(self, name))) for name in ("forward_us", "backward_us")]
        widths = {len(row) for table in tables for row in table}
        if not tables[0] or len(tables[0]) != len(tables[1]) or len(widths) != 1 or 0 in widths:
            raise ScheduleConfigError("forward_us and backward_us must be non-empty ranks x chunks tables of the "
                                      "same shape")
        object.__setattr__(self, "forward_us", tables[0])
        object.__setattr__(self, "backward_us", tables[1])

    @classmethod
    def uniform(cls, shape: PipelineShape, forward_us: float, backward_us: float) -> "ComputeCosts":
        return cls.per_chunk(shape, [forward_us] * shape.num_chunks, [backward_us] * shape.num_chunks)

    @classmethod
    def per_chunk(cls, shape: PipelineShape, forward_us: Sequence[float], backward_us: Sequence[float]
                  ) -> "ComputeCosts":
        """Same per-chunk times on every rank."""
        return cls(tuple(tuple(forward_us) for _ in range(shape.num_stages)),
                   tuple(tuple(backward_us) for _ in range(shape.num_stages)))

    def check_shape(self, shape: PipelineShape) -> None:
        expected = (shape.num_stages, shape.num_chunks)
        if (len(self.forward_us), len(self.forward_us[0])) != expected:
            raise ScheduleConfigError(f"cost tables are {len(self.forward_us)} ranks x {len(self.forward_us[0])} "
                                      f"chunks, the pipeline is {expected[0]} x {expected[1]}")


@dataclass(frozen=True)
class ComputePerturbations:
    """slow_rank runs every task slow_factor times longer; jitter scales each task by U(1-jitter, 1+jitter);
    each task independently becomes a straggler (straggler_factor times longer) with straggler_prob."""

    slow_rank: Optional[int] = None
    slow_factor: float = 1.0
    jitter: float = 0.0
    straggler_prob: float = 0.0
    straggler_factor: float = 1.0

    def __post_init__(self):
        if self.slow_rank is not None and (isinstance(self.slow_rank, bool) or not isinstance(self.slow_rank, int)
                                           or self.slow_rank < 0):
            raise ScheduleConfigError(f"slow_rank must be a rank number >= 0, got {self.slow_rank!r}")
        check_number("slow_factor", self.slow_factor, 1.0)
        check_number("jitter", self.jitter, 0.0, maximum=1.0, max_inclusive=False)
        check_number("straggler_prob", self.straggler_prob, 0.0, maximum=1.0)
        check_number("straggler_factor", self.straggler_factor, 1.0)

    def check_shape(self, shape: PipelineShape) -> None:
        if self.slow_rank is not None and self.slow_rank >= shape.num_stages:
            raise ScheduleConfigError(f"slow_rank {self.slow_rank} is outside 0..{shape.num_stages - 1}")


def draw_durations(shape: PipelineShape, costs: ComputeCosts, perturbations: ComputePerturbations, seed: int,
                   iteration: int, microbatch_factors: Optional[Sequence[float]] = None,
                   weight_share_factors: Optional[Sequence[float]] = None) -> DurationTable:
    """Every task's duration for one iteration (see the module doc for why draws are keyed per rank).
    microbatch_factors: per microbatch, a factor on all its tasks (its cost for its length; lengths.py).
    A split backward's B and W share one drawn backward time, W taking costs.weight_share of it (times the
    microbatch's weight_share_factors entry, at most all of it: lengths.py), so split and whole runs meet the same
    draws; W times are 0 when the backward is not split."""
    costs.check_shape(shape)
    perturbations.check_shape(shape)
    V, m = shape.num_chunks, shape.num_microbatches
    result = []
    for rank in range(shape.num_stages):
        base = np.array([costs.forward_us[rank], costs.backward_us[rank]], dtype=float)     # (2, V)
        times = np.broadcast_to(base[:, :, None], (2, V, m)).copy()
        if microbatch_factors is not None:
            times *= np.asarray(microbatch_factors, dtype=float)[None, None, :]
        if rank == perturbations.slow_rank:
            times *= perturbations.slow_factor
        if perturbations.jitter > 0:
            rng = np.random.default_rng([seed, _JITTER_STREAM, iteration, rank])
            times *= rng.uniform(1.0 - perturbations.jitter, 1.0 + perturbations.jitter, size=times.shape)
        if perturbations.straggler_prob > 0:
            rng = np.random.default_rng([seed, _STRAGGLER_STREAM, iteration, rank])
            times = np.where(rng.random(times.shape) < perturbations.straggler_prob,
                             times * perturbations.straggler_factor, times)
        share = np.full(m, costs.weight_share) if weight_share_factors is None else np.minimum(
            1.0, costs.weight_share * np.asarray(weight_share_factors, dtype=float))
        weight = times[1] * share[None, :] if shape.split_backward else np.zeros_like(times[1])
        times[1] -= weight
        result.append(np.concatenate([times, weight[None]]))
    return DurationTable(result)


def with_host_cost(shape: PipelineShape, durations: DurationTable, host_us: float) -> DurationTable:
    """Every task present in the shape (F, B, and W with a split backward) plus host_us: the runtime's own time per
    task (Python loop, Megatron's step functions, transport calls) that does not scale with the compute."""
    if not host_us:
        return durations
    table = np.array(durations, dtype=float)
    present = [kind.index for kind in shape.kinds]
    table[:, present] += host_us
    return DurationTable(table)
