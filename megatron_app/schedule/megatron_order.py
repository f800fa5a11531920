"""Megatron-Core's per-rank task order (interleaved 1F1B; plain 1F1B when V == 1) and the memory it needs.

Computed here in pure Python from the rules Megatron-Core's schedules follow, so the schedule package and the
simulator run without torch or megatron-core; tests/test_schedule_megatron.py checks the result against
megatron-core's own get_pp_rank_microbatches / get_schedule_table / convert_schedule_table_to_order on a grid.

  * Warm-up (forwards before the first backward): all of them when forward_only; none with one stage; P-r-1 for
    1F1B; 2(P-r-1) + (V-1)N interleaved, N = microbatch group size; never more than V*m.
  * Forward sequence: microbatches in groups of N (the last group is the remainder); each group runs chunk 0 for
    its microbatches, then chunk 1, ... (the "schedule table").
  * After the warm-up each forward is followed by one backward; the remaining backwards close the iteration. The
    k-th backward undoes the k-th forward in reverse chunk order: forward (mb, c) pairs with backward (mb, V-1-c).
  * Split backward: Megatron computes weight gradients inside the backward, so each B is followed at once by its W.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

from .shape import PipelineShape
from .tasks import Kind, Task


def megatron_warmup_microbatches(shape: PipelineShape, rank: int) -> int:
    """Forwards Megatron runs on `rank` before its first backward (all of them when forward_only)."""
    shape.check_rank(rank)
    P, V = shape.num_stages, shape.num_chunks
    total = V * shape.num_microbatches
    if shape.forward_only:
        return total
    if P == 1:
        return 0
    later_stages = P - rank - 1
    warmup = later_stages if V == 1 else 2 * later_stages + (V - 1) * shape.microbatch_group_size
    return min(warmup, total)


def megatron_forward_sequence(shape: PipelineShape) -> List[Tuple[int, int]]:
    """(microbatch, chunk) of every forward in Megatron's order; the same on every rank."""
    m, N = shape.num_microbatches, shape.microbatch_group_size
    sequence = []
    for group_start in range(0, m, N):
        group = range(group_start, min(group_start + N, m))
        sequence.extend((mb, chunk) for chunk in range(shape.num_chunks) for mb in group)
    return sequence


# A task named by its microbatch's entry slot: (kind, chunk, slot). A plan maps slots to microbatches.
SlotTask = Tuple[Kind, int, int]


@functools.lru_cache(maxsize=1024)
def megatron_slot_order(shape: PipelineShape, rank: int, extra_warmup: int = 0,
                        with_weights: Optional[bool] = None) -> Tuple[SlotTask, ...]:
    """The one order builder: Megatron's order on `rank` with microbatches named by their entry slot, `extra_warmup`
    more warm-up forwards than Megatron's, and (split shapes, unless with_weights is False) each W right after its
    B. Every static order in the package (Megatron's, a plan's) is this order over a start order of microbatches."""
    shape.check_rank(rank)
    V = shape.num_chunks
    sequence = megatron_forward_sequence(shape)
    forwards = [(Kind.FORWARD, chunk, slot) for slot, chunk in sequence]
    if shape.forward_only:
        return tuple(forwards)
    backwards = [(Kind.BACKWARD, V - 1 - chunk, slot) for slot, chunk in sequence]
    warmup = min(megatron_warmup_microbatches(shape, rank) + extra_warmup, len(forwards))
    order = forwards[:warmup]
    for k, forward in enumerate(forwards[warmup:]):
        order += (forward, backwards[k])
    order += backwards[len(forwards) - warmup:]
    if with_weights is not False and shape.fill_kinds:
        order = _with_fill(shape, order, lambda kind, chunk, slot: (kind, chunk, slot))
    return tuple(order)


def _fill_after(shape: PipelineShape):
    """{source kind: fill kinds that run right after it}, from the shape's local rules (W after its B)."""
    after = {}
    for kind in shape.fill_kinds:
        after.setdefault(shape.local_source(Task(kind, 0, 0)).kind, []).append(kind)
    return after


def _with_fill(shape: PipelineShape, order, make):
    """`order` with each fill task right after its local source (recursively); make(kind, chunk, mb) builds one."""
    after = _fill_after(shape)
    result = []

    def emit(kind, chunk, mb):
        result.append(make(kind, chunk, mb))
        for fill in after.get(kind, ()):
            emit(fill, chunk, mb)

    for step in order:
        kind, chunk, mb = (step.kind, step.chunk, step.microbatch) if isinstance(step, Task) else step
        emit(kind, chunk, mb)
    return result


def order_over(slot_order: Sequence[SlotTask], start_order: Optional[Sequence[int]] = None) -> Tuple[Task, ...]:
    """Tasks of a slot order, slot i being microbatch start_order[i] (None: slot i is microbatch i)."""
    if start_order is None:
        return tuple(Task(kind, chunk, slot) for kind, chunk, slot in slot_order)
    return tuple(Task(kind, chunk, start_order[slot]) for kind, chunk, slot in slot_order)


@functools.lru_cache(maxsize=512)
def megatron_order(shape: PipelineShape, rank: int) -> Tuple[Task, ...]:
    """Every task of `rank` in the order Megatron-Core runs them."""
    return order_over(megatron_slot_order(shape, rank))


def with_fill_after_sources(shape: PipelineShape, order) -> List[Task]:
    """`order` (forwards and backwards) with each fill task (W) right after its local source: whole-backward timing
    on a split shape."""
    return _with_fill(shape, order, Task)


def without_fill(order) -> Tuple[Task, ...]:
    """`order` without its fill tasks (W): the forward/backward skeleton that adaptive policies follow."""
    return tuple(task for task in order if task.kind is Kind.FORWARD or task.kind is Kind.BACKWARD)


def order_peak_size(order: Sequence[Task], sizes: Optional[Sequence[float]] = None,
                    releasing: Optional[Kind] = None) -> float:
    """The one peak function: the largest sum of held activation sizes while a rank runs `order` (sizes[mb] per
    microbatch; None counts activations). An activation is held from its forward's start until its releasing task
    ends: `releasing`, by default the W when the order has W's (a split backward), else the backward."""
    if releasing is None:
        releasing = Kind.WEIGHT if any(task.kind is Kind.WEIGHT for task in order) else Kind.BACKWARD
    held = peak = 0
    for task in order:
        size = 1 if sizes is None else sizes[task.microbatch]
        if task.kind is Kind.FORWARD:
            held += size
            peak = max(peak, held)
        if task.kind is releasing:
            held -= size
    return peak


def peak_activations_of_order(shape: PipelineShape, order) -> int:
    """Most activations held at once when a single rank runs `order`, released by the shape's releasing task (the
    backward, or its W when split; the forward itself when forward_only)."""
    return order_peak_size(order, None, shape.releasing_kind)


def megatron_interleaved_cap(shape: PipelineShape, rank: int) -> int:
    """Peak activations Megatron's interleaved order (1F1B when V == 1) holds on `rank`."""
    return peak_activations_of_order(shape, megatron_order(shape, rank))


def megatron_pipeline_cap(shape: PipelineShape) -> int:
    """The largest per-rank peak of Megatron's order: the pipeline's peak activation memory (rank 0's)."""
    return max(megatron_interleaved_cap(shape, rank) for rank in range(shape.num_stages))


def megatron_peak_sizes(shape: PipelineShape, sizes: Sequence[float]) -> Tuple[float, ...]:
    """Per rank, the peak of held activation sizes under Megatron's interleaved order in data order."""
    return tuple(order_peak_size(megatron_order(shape, rank), sizes) for rank in range(shape.num_stages))
