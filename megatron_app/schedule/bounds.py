"""Lower bounds on one iteration's makespan that hold for every schedule, given the task durations (drawn by the
simulator, or measured in a trace: the simulator's table and process_trace.py report the same bound).

work:  no schedule beats the busiest rank's own work (a rank runs one task at a time).
path:  tighter. On rank r the first task is some chunk-0 forward F(0, i) and the last some chunk-0 backward
       B(0, j) (every other task has a successor on the same rank). F(0, i) waits for microbatch i's forwards on
       ranks 0..r-1 and B(0, j) is followed by microbatch j's backwards on ranks r-1..0, each hop at least the
       fastest transfer. So makespan >= min_i head_r(i) + work_r + min_j tail_r(j) for every r. Also no schedule
       beats one microbatch's whole dependency chain (matters when m is small).
For uniform costs and free communication the path bound equals 1F1B's (m+P-1)(f+b) and interleaved's
V*m*(f+b)+(P-1)(f+b) (per-chunk f, b): both static schedules are optimal there.
Split backward: a rank's last task may be a W, which nothing follows, so the tail term is dropped, and a
microbatch's chain is its forwards and B's (W's hang off it). ZB-H1's 3mV + P - 1 (F = B = W = 1) meets this bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .shape import PipelineShape
from .tasks import Kind

FORWARD_INDEX, BACKWARD_INDEX = Kind.FORWARD.index, Kind.BACKWARD.index


@dataclass(frozen=True)
class LowerBounds:
    work_us: float
    path_us: float

    @property
    def best_us(self) -> float:
        return max(self.work_us, self.path_us)


def lower_bounds(shape: PipelineShape, durations, min_transfer_us: float) -> LowerBounds:
    """durations: (P, kinds, V, m) task times in us (a DurationTable or any array of that shape), kinds indexed by
    Kind.index; min_transfer_us: the fastest one stage-to-stage transfer can be."""
    times = np.asarray(durations, dtype=float)              # W times 0 unless split
    P = shape.num_stages
    work = times.sum(axis=(1, 2, 3))                         # per rank
    # Prefix sums over ranks 0..r-1 of chunk-0 forward / backward times, per microbatch: row r = ranks before r.
    zeros = np.zeros((1, shape.num_microbatches))
    before_f = np.concatenate([zeros, np.cumsum(times[:, FORWARD_INDEX, 0, :], axis=0)[:-1]])
    before_b = np.concatenate([zeros, np.cumsum(times[:, BACKWARD_INDEX, 0, :], axis=0)[:-1]])
    hops = np.arange(P) * min_transfer_us
    tail = 0.0 if shape.split_backward else before_b.min(axis=1) + hops
    per_rank = before_f.min(axis=1) + hops + work + tail
    path_kinds = [FORWARD_INDEX, BACKWARD_INDEX]
    chain = times[:, path_kinds].sum(axis=(0, 1, 2)) + 2 * (shape.num_virtual_stages - 1) * min_transfer_us
    return LowerBounds(work_us=float(work.max()), path_us=float(max(per_rank.max(), chain.max())))
