"""Memory admission for adaptive policies: may this rank start that forward without risking a deadlock?

A naive "held < cap" test can hang the pipeline: a rank fills its cap with early-chunk forwards and can never run
the later chunk whose backward would free memory, or it spends the cap on microbatches the rest of the pipeline is
not ready to finish. The rule here keeps every rank able to finish its microbatches in ascending order:

  (1) a rank starts microbatches (their first forward here) in ascending order only;
  (2) after the forward, for every microbatch i in flight on the rank (forward started, backward not finished):
          held(microbatches >= i) + remaining_forwards(i) <= cap
      i.e. if the rank finished its in-flight microbatches one by one from the lowest, each would still find room
      for all of its remaining forwards (all forwards of a microbatch precede any of its backwards on every rank).

Why no deadlock (cap >= V on every rank): (2) holds initially, backwards only lower its left sides, and every
forward a policy starts is checked. Let g be the lowest microbatch not finished everywhere; its tasks form one
chain (F through the virtual stages, then B back). A rank that has not started g has, by (1), started no higher
microbatch, and every lower one is finished there: it holds nothing, so it can admit g. On a rank that has
started g no lower microbatch is in flight, so a forward of g only moves one activation from "remaining" to "held"
within g's own check and leaves the checks of higher microbatches unchanged: (2) still holds, it is admitted.
Backwards are always allowed. So g's next task can run as soon as its input arrives: the pipeline never stalls.

Variable sizes (microbatches of different lengths hold activations of different sizes s_i): (2) becomes
          sum over in-flight j started at or after i of held_j * s_j  +  remaining_forwards(i) * s_i  <= cap
and "ascending" in (1) and (2) means the start order, one permutation shared by every rank (the counts are the
special case s_i = 1 and the identity order). The argument is unchanged with cap >= V * max_i s_i on every rank:
the rank that has not started g holds nothing and admits g's V activations; on a rank that has started g, a forward
of g moves s_g from "remaining" to "held" inside g's own term and leaves the terms of later microbatches as they
were. Property-tested with random sizes and start orders in tests/test_schedule_planned.py.

Split backward (W tasks): a chunk's activation stays held from its forward until its W ends, so held_j above counts
W-pending activations and a microbatch stays in flight until its last W. Add one rule for every policy:
  (3) a rank whose policy has nothing else to run runs a ready W (W-liveness).
A W needs only its own rank's B, so a ready W never waits for another rank. The argument above then holds as it is:
if the pipeline stalled, no rank has a ready W (3), so every B done has had its W done and each rank's held
activations are those of its forwards whose backwards are not done, exactly the whole-backward state in which the
argument shows g's next task can run. W's only lower the left sides of (2), so admitted forwards stay admissible.
Property-tested with split shapes for every policy in tests/test_schedule_properties.py.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

from .errors import ScheduleConfigError
from .shape import PipelineShape
from .state import RankState
from .tasks import Kind, Task


def minimum_memory_cap(shape: PipelineShape) -> int:
    """Fewest activations a rank must be allowed to hold: one microbatch keeps all V chunks until its backward."""
    return 1 if shape.forward_only else shape.num_chunks


def minimum_size_cap(shape: PipelineShape, sizes) -> float:
    """Smallest cap in size units that can finish: the largest microbatch holding all V chunks."""
    return max(sizes) * minimum_memory_cap(shape)


def check_memory_cap(shape: PipelineShape, memory_cap: int) -> None:
    if isinstance(memory_cap, bool) or not isinstance(memory_cap, int):
        raise ScheduleConfigError(f"memory_cap must be an int, got {memory_cap!r}")
    needed = minimum_memory_cap(shape)
    if memory_cap < needed:
        raise ScheduleConfigError(
            f"memory_cap={memory_cap} cannot finish: a rank must hold at least {needed} activations "
            f"(all {shape.num_chunks} chunks of one microbatch until its backward)")


def forward_fits(state: RankState, task: Task, memory_cap, sizes: Optional[Sequence[float]] = None,
                 start_order: Optional[Sequence[int]] = None) -> bool:
    """Whether starting forward `task` now keeps the rank deadlock-free under `memory_cap` (see module doc).

    sizes: one chunk's activation size per microbatch (bytes, tokens, ...), memory_cap in the same unit; None counts
    activations (every size 1). start_order: the order in which microbatches are started (a permutation of
    0..m-1, the same on every rank); None is ascending.
    """
    return admission_need(state, task, sizes, start_order) <= memory_cap


def admission_need(state: RankState, task: Task, sizes: Optional[Sequence[float]] = None,
                   start_order: Optional[Sequence[int]] = None) -> float:
    """The smallest cap under which forward_fits admits `task` now (inf when rule (1) forbids it at any cap)."""
    if task.kind is not Kind.FORWARD:
        raise ScheduleConfigError(f"forward_fits is for forwards, got {task}")
    if state.shape.forward_only:   # evaluation frees each activation right after its forward
        return 0
    mb = task.microbatch
    if state.forwards_started(mb) == 0 and mb != state.next_microbatch_to_start(start_order):
        return math.inf
    V = state.shape.num_chunks
    position = None if start_order is None else _positions(start_order)
    in_flight = set(state.in_flight_microbatches()) | {mb}
    held_above = 0   # activations of in-flight microbatches started at or after the one checked, after the forward
    need = 0
    for i in sorted(in_flight, key=None if position is None else position.__getitem__, reverse=True):
        size = 1 if sizes is None else sizes[i]
        held = state.activations_of(i) + (1 if i == mb else 0)
        remaining = V - state.forwards_started(i) - (1 if i == mb else 0)
        held_above += held * size
        need = max(need, held_above + remaining * size)
    return need


@functools.lru_cache(maxsize=64)
def _positions_cached(start_order: Tuple[int, ...]) -> Tuple[int, ...]:
    position = [0] * len(start_order)
    for index, mb in enumerate(start_order):
        position[mb] = index
    return tuple(position)


def _positions(start_order: Sequence[int]) -> Tuple[int, ...]:
    return _positions_cached(tuple(start_order))
