"""Megatron-Core's own per-rank task order (interleaved 1F1B; plain 1F1B when V == 1) and the memory it needs.

The order comes from megatron-core's functions, not a re-derivation: get_pp_rank_microbatches (warm-up length),
get_schedule_table (forward (microbatch, chunk) sequence) and convert_schedule_table_to_order (how warm-up, steady
1F1B and cool-down interleave). They are imported lazily because megatron-core pulls in torch.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

from .shape import PipelineShape
from .tasks import Kind, Task


class _PipelineGroupView:
    """The two process-group queries get_pp_rank_microbatches makes, answered without torch.distributed."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _CommunicatorView:
    """Stands in for megatron's P2PCommunicator: only its pp_group and virtual pipeline size are read."""

    def __init__(self, shape: PipelineShape, rank: int):
        self.pp_group = _PipelineGroupView(shape.num_stages, rank)
        # None selects Megatron's non-interleaved 1F1B warm-up, as get_forward_backward_func does for V == 1.
        self.virtual_pipeline_model_parallel_size: Optional[int] = (
            shape.num_chunks if shape.num_chunks > 1 else None)


def megatron_warmup_microbatches(shape: PipelineShape, rank: int) -> int:
    """Forwards Megatron runs on `rank` before its first backward (all of them when forward_only)."""
    shape.check_rank(rank)
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    _, _, warmup, _ = get_pp_rank_microbatches(
        shape.num_microbatches, shape.num_chunks, shape.microbatch_group_size,
        forward_only=shape.forward_only, p2p_communicator=_CommunicatorView(shape, rank))
    return warmup


@functools.lru_cache(maxsize=512)
def megatron_order(shape: PipelineShape, rank: int) -> Tuple[Task, ...]:
    """Every task of `rank` in the order Megatron-Core runs them."""
    shape.check_rank(rank)
    from megatron.core.pipeline_parallel.schedules import get_schedule_table
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    V = shape.num_chunks
    table = get_schedule_table(shape.num_microbatches, V, shape.microbatch_group_size)
    if shape.forward_only:
        return tuple(Task(Kind.FORWARD, chunk, mb) for mb, chunk in table)
    # Encoded as +c+1 for a forward of table chunk c and c-V for the backward paired with table chunk c; Megatron's
    # backward of that entry runs chunk V-1-c (get_model_chunk_id(forward=False)), i.e. chunk -code-1.
    codes = convert_schedule_table_to_order(megatron_warmup_microbatches(shape, rank), V, table)
    forward_microbatches = iter(mb for mb, _ in table)
    # Megatron pops a chunk's oldest stored forward for each backward (input_tensors[chunk].pop(0)).
    next_backward = [0] * V
    order = []
    for code in codes:
        if code > 0:
            order.append(Task(Kind.FORWARD, code - 1, next(forward_microbatches)))
        else:
            chunk = -code - 1
            order.append(Task(Kind.BACKWARD, chunk, next_backward[chunk]))
            next_backward[chunk] += 1
    return tuple(order)


def peak_activations_of_order(shape: PipelineShape, order) -> int:
    """Most activations held at once when a single rank runs `order` (counted when each forward starts)."""
    held = peak = 0
    for task in order:
        if task.kind is Kind.FORWARD:
            held += 1
            peak = max(peak, held)
            if shape.forward_only:
                held -= 1
        else:
            held -= 1
    return peak


def megatron_interleaved_cap(shape: PipelineShape, rank: int) -> int:
    """Peak activations Megatron's interleaved order (1F1B when V == 1) holds on `rank`."""
    return peak_activations_of_order(shape, megatron_order(shape, rank))
