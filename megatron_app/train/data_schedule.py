"""wrap_data_iterator for a Megatron training loop of your own: read one global batch, yield the planned microbatches.

The shape of Megatron-Core's ``megatron.core.datasets.data_schedule.wrap_data_iterator`` (Megatron-LM main), so a
loop swaps one import:

    data_iterator, num_microbatches, seqlen_sum, seqlen_squared_sum = wrap_data_iterator(
        data_iterator, config, num_microbatches)

It reads ``num_microbatches`` samples (one whole document each, micro batch size 1, as Megatron's packer expects),
asks the runtime's ``plan_microbatches`` which documents form each microbatch (a collective of the pipeline: the
documents' lengths go from the first pipeline stage to the others, whose iterator may be None), and returns an
iterator over those microbatches and their count, to hand to the forward_backward call. Packed microbatches are one
row ``[1, tokens]`` (keys tokens, labels, loss_mask, position_ids) with ``cu_seqlens`` (int32 document bounds) and ``max_seqlen``; ranks without data get batches
holding only those two, which every chunk's attention needs (``packed_seq_params_of`` builds Megatron's
PackedSeqParams from a batch). The two sums are this call's tokens computed and the sum of squared document lengths
(attention work), over the data-parallel group like Megatron's.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from megatron_app.schedule.composition import BALANCED, Composition

from megatron_app.data.document_data import CU_SEQLENS, pack_documents, pad_to_longest
from .step import packed_seq_params_of  # noqa: F401 (re-exported for users' forward steps)

MAX_SEQLEN = "max_seqlen"


def _sample(item: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One document as 1-D tensors (a loader of micro batch size 1 yields [1, length])."""
    return {key: value.reshape(-1) if torch.is_tensor(value) and value.dim() == 2 and value.size(0) == 1 else value
            for key, value in item.items()}


def _pipeline_group(pg_collection):
    from megatron.core import parallel_state

    if pg_collection is not None:
        return pg_collection.pp
    return parallel_state.get_pipeline_model_parallel_group() if parallel_state.model_parallel_is_initialized() \
        else None


def _share_lengths(lengths: Optional[List[int]], group) -> List[int]:
    """The first pipeline stage's document lengths, on every rank of the pipeline."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        if lengths is None:
            raise ValueError("wrap_data_iterator: no data iterator and no pipeline to take the lengths from")
        return lengths
    box = [lengths]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if box[0] is None:
        raise ValueError("wrap_data_iterator: the first pipeline stage has no data iterator")
    return box[0]


def _bounds_only(lengths: Sequence[int], composition: Composition) -> List[Dict[str, Any]]:
    batches = []
    for group in composition.groups:
        sizes = torch.tensor([lengths[p] for p in group], dtype=torch.int32)
        batches.append({CU_SEQLENS: torch.cat([sizes.new_zeros(1), sizes.cumsum(0, dtype=torch.int32)]),
                        MAX_SEQLEN: int(sizes.max())})
    return batches


def _reduce_over_data_parallel(values: List[float], pg_collection) -> List[float]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = pg_collection.dp if pg_collection is not None else (
        parallel_state.get_data_parallel_group() if parallel_state.model_parallel_is_initialized() else None)
    if group is None or dist.get_world_size(group) == 1:
        return values
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return total.tolist()


def wrap_data_iterator(data_iterator, config, num_microbatches: int, pg_collection=None, *,
                       composition: str = BALANCED, micro_batch_size: int = 1):
    """(iterator of the planned microbatches, their count, tokens computed, sum of squared document lengths).

    ``data_iterator``: one iterator, a list with one per model chunk (Megatron's convention with virtual
    pipelining; they yield the same samples, the first one that is not None is read), or None on a rank that reads
    no data; the result has the same structure. ``config`` (the model's TransformerConfig) is Megatron's argument,
    unused here. ``composition``: 'balanced' (the planner's choice), 'packed' or 'loader' (groups of
    ``micro_batch_size`` documents in reading order, packed or padded).
    """
    from megatron_app.runtime.composition import plan_microbatches

    iterators = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    source = next((it for it in iterators if it is not None), None)
    samples = None if source is None else [_sample(next(source)) for _ in range(num_microbatches)]
    lengths = _share_lengths(None if samples is None else [int(s["tokens"].numel()) for s in samples],
                             _pipeline_group(pg_collection))
    planned = plan_microbatches(lengths, micro_batch_size, composition)
    planned.check(len(lengths))
    if samples is None:
        batches = _bounds_only(lengths, planned) if planned.packed else [{} for _ in planned.groups]
    else:
        collate = pack_documents if planned.packed else pad_to_longest
        batches = [collate([samples[p] for p in group]) for group in planned.groups]
        if planned.packed:
            for batch in batches:
                bounds = batch[CU_SEQLENS]
                batch[MAX_SEQLEN] = int((bounds[1:] - bounds[:-1]).max())
    tokens, squares = _reduce_over_data_parallel(
        [float(sum(planned.microbatch_tokens(lengths))), float(sum(n * n for n in lengths))], pg_collection)
    # A chunk that reads no data keeps None, unless packed: every chunk's attention needs the documents' bounds.
    wrapped: List[Optional[Iterator]] = [iter(batches) if it is not None or planned.packed else None
                                         for it in iterators]
    result = wrapped if isinstance(data_iterator, (list, tuple)) else wrapped[0]
    return result, planned.num_microbatches, tokens, squares
