"""What compute emulation emulates: per-task forward/backward times and the simulator's perturbations.

Torch-free (the trainer validates flags with it before any process group exists). Task durations are
megatron_app.sim's own draws (sim.costs.draw_durations, keyed by (seed, iteration, rank)), so every schedule meets
the same durations and the simulator fed with the same spec predicts the same run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Sequence, Tuple

from megatron_app.schedule import Kind, PipelineShape, ScheduleConfigError
from megatron_app.sim.costs import ComputeCosts, ComputePerturbations, DurationTable, draw_durations
from megatron_app.sim.cost_curves import CostCurves
from megatron_app.sim.lengths import MicrobatchLengths

US_PER_MS = 1000.0
DEFAULT_SLOW_FACTOR = 1.5
DEFAULT_STRAGGLER_FACTOR = 3.0


@dataclass(frozen=True)
class EmulationSpec:
    """Base forward/backward time of one task of one model chunk, plus the simulator's perturbations."""

    forward_ms: float
    backward_ms: float
    perturbations: ComputePerturbations = field(default_factory=ComputePerturbations)
    seed: int = 0
    # Variable-length microbatches: lengths drawn per iteration (keyed by seed and iteration, as the simulator draws
    # them), every task of a microbatch scaled by the simulator's cost of its length. None: equal lengths.
    lengths: Optional[MicrobatchLengths] = None
    # Composed microbatches: task costs fitted on a real trace (sim/cost_curves.py) instead of the analytic model,
    # spread over this many layers (the --num-layers of the emulated model).
    cost_curves: Optional[CostCurves] = None
    num_layers: int = 8

    def __post_init__(self):
        for name in ("forward_ms", "backward_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ScheduleConfigError(f"{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def parse(cls, text: str, *, slow_rank: Optional[int] = None, slow_factor: float = DEFAULT_SLOW_FACTOR,
              straggler_prob: float = 0.0, straggler_factor: float = DEFAULT_STRAGGLER_FACTOR,
              seed: int = 0, lengths: Optional[MicrobatchLengths] = None) -> "EmulationSpec":
        """'FWD_MS,BWD_MS[,JITTER]' (e.g. '10,20' or '10,20,0.3'); perturbations as in megatron_app.sim."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) not in (2, 3):
            raise ScheduleConfigError(f"--emulate-compute {text!r} is not FWD_MS,BWD_MS[,JITTER] (e.g. 10,20,0.3)")
        try:
            numbers = [float(p) for p in parts]
        except ValueError:
            raise ScheduleConfigError(f"--emulate-compute {text!r} has a malformed number") from None
        jitter = numbers[2] if len(numbers) == 3 else 0.0
        perturbations = ComputePerturbations(slow_rank=slow_rank,
                                             slow_factor=slow_factor if slow_rank is not None else 1.0,
                                             jitter=jitter, straggler_prob=straggler_prob,
                                             straggler_factor=straggler_factor if straggler_prob else 1.0)
        return cls(numbers[0], numbers[1], perturbations, seed, lengths)

    def costs(self, shape: PipelineShape) -> ComputeCosts:
        return ComputeCosts.uniform(shape, self.forward_ms * US_PER_MS, self.backward_ms * US_PER_MS)

    def check_shape(self, shape: PipelineShape) -> None:
        self.perturbations.check_shape(shape)

    def microbatch_lengths(self, shape: PipelineShape, iteration: int) -> Optional[Tuple[int, ...]]:
        """Tokens of each microbatch of `iteration` in data order (None for equal lengths): the same on every rank
        and the same as megatron_app.sim draws for this seed."""
        if self.lengths is None:
            return None
        return self.lengths.draw(shape.num_microbatches, self.seed, iteration)

    def draw(self, shape: PipelineShape, iteration: int) -> DurationTable:
        """Every task's duration (microseconds) in `iteration`."""
        lengths = self.microbatch_lengths(shape, iteration)
        factors = None if lengths is None else [self.lengths.cost_factor(length) for length in lengths]
        weight_factors = None if lengths is None else [self.lengths.weight_share_factor(n) for n in lengths]
        return draw_durations(shape, self.costs(shape), self.perturbations, self.seed, iteration, factors,
                              weight_factors)

    def draw_composed(self, shape: PipelineShape, iteration: int, tokens: Sequence[float],
                      squared_tokens: Sequence[float]) -> DurationTable:
        """Every task's duration (microseconds) in `iteration` when its microbatches are composed documents: each
        costs the simulator's composed_cost_factor of its tokens and squared tokens (sim/composition.py's model;
        no host cost added, the runtime pays its own)."""
        if self.lengths is None:
            raise ScheduleConfigError("composed microbatches need document lengths (--emulate-lengths-file)")
        if self.cost_curves is not None:
            return self.cost_curves.durations(shape, self.num_layers, tokens, squared_tokens)
        factors = [self.lengths.composed_cost_factor(t, s) for t, s in zip(tokens, squared_tokens)]
        return draw_durations(shape, self.costs(shape), self.perturbations, self.seed, iteration, factors)


class TaskDurations:
    """Seconds of each (iteration, rank, kind, chunk, microbatch) task; one iteration's draws kept at a time."""

    def __init__(self, spec: EmulationSpec, shape: PipelineShape, factor: float = 1.0):
        """factor: every task of this rank that many times longer (a slower replica)."""
        spec.check_shape(shape)
        self.spec = spec
        self.factor = factor
        self.shape = shape
        self._iteration: Optional[int] = None
        self._table = None
        self._composed: Dict[int, DurationTable] = {}

    def compose(self, iteration: int, tokens: Sequence[float], squared_tokens: Sequence[float]) -> None:
        """`iteration` runs len(tokens) composed microbatches (this many tokens, squared tokens each)."""
        shape = PipelineShape(self.shape.num_stages, self.shape.num_chunks, len(tokens),
                              split_backward=self.shape.split_backward)
        self._composed = {iteration: self.spec.draw_composed(shape, iteration, tokens, squared_tokens)}

    def seconds(self, iteration: int, rank: int, kind: Kind, chunk: int, microbatch: int) -> float:
        if iteration in self._composed:
            return self.factor * self._composed[iteration][rank][kind.index][chunk][microbatch] / 1e6
        if iteration != self._iteration:
            self._table = self.spec.draw(self.shape, iteration)
            self._iteration = iteration
        return self.factor * self._table[rank][kind.index][chunk][microbatch] / 1e6


def spec_from_args(args) -> Optional[EmulationSpec]:
    """The trainer's emulation flags as a spec (None when --emulate-compute is absent); ScheduleConfigError if bad."""
    if getattr(args, "emulate_compute", None) is None:
        return None
    lengths_file = getattr(args, "emulate_lengths_file", None)
    spec = EmulationSpec.parse(args.emulate_compute, slow_rank=args.slow_rank, slow_factor=args.slow_factor,
                               straggler_prob=args.straggler_prob, straggler_factor=args.straggler_factor,
                               seed=args.seed,
                               lengths=None if lengths_file is None else MicrobatchLengths.from_file(lengths_file))
    curves_file = getattr(args, "emulate_cost_curves", None)
    if curves_file is None:
        return spec
    return replace(spec, cost_curves=CostCurves.load(curves_file), num_layers=args.num_layers)
