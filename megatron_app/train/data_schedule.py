"""wrap_data_iterator for a Megatron training loop of your own: one global batch, planned across every replica.

The shape of Megatron-Core's ``megatron.core.datasets.data_schedule.wrap_data_iterator`` (Megatron-LM main), so a
loop swaps one import:

    data_iterator, num_microbatches, seqlen_sum, seqlen_squared_sum = wrap_data_iterator(
        data_iterator, config, num_microbatches)

As Megatron's DpBalancedScheduler.run does, in numbered steps: (1) each replica reads its ``num_microbatches``
samples (one whole document each, micro batch size 1, as Megatron's packer expects) on the ranks that have a data
iterator; (2) the global batch's samples are gathered across the job, in the loader's order; (3) the runtime's
decide_iteration_plan plans it (one rank decides, every rank receives the same plan: which replica computes which
document, the microbatches, order and warm-ups); (4) each replica takes the documents the plan routes to it and
collates its microbatches, and the iterators returned carry its share of the plan to the forward_backward call.
Packed microbatches are one row ``[1, tokens]`` (keys tokens, labels, loss_mask, position_ids) with ``cu_seqlens``
(int32 document bounds) and ``max_seqlen``; ranks without data get batches holding only those two, which every
chunk's attention needs (``packed_seq_params_of`` builds Megatron's PackedSeqParams from a batch). The two sums are
the global batch's tokens computed and its sum of squared document lengths (attention work), the same on every rank,
like Megatron's. Step (2) moves the documents as Python objects over the default group: every rank holds the global
batch's tokens for the moment of the call.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from megatron_app.schedule.composition import Composition
from megatron_app.schedule.iteration_plan import loader_shares

from megatron_app.data.document_data import CU_SEQLENS
from megatron_app.data.replica_batches import collate_replica
from .step import packed_seq_params_of  # noqa: F401 (re-exported for users' forward steps)

MAX_SEQLEN = "max_seqlen"


def _sample(item: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One document as 1-D tensors (a loader of micro batch size 1 yields [1, length])."""
    return {key: value.reshape(-1) if torch.is_tensor(value) and value.dim() == 2 and value.size(0) == 1 else value
            for key, value in item.items()}


def _gather_global_batch(samples: Optional[List[Dict[str, torch.Tensor]]], dp_rank: int, num_replicas: int,
                         micro_batch_size: int) -> List[Dict[str, torch.Tensor]]:
    """Every replica's samples, gathered from the ranks that read them, in the loader's order of the global batch."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if samples is None:
            raise ValueError("wrap_data_iterator: no data iterator on this rank and no other rank to read one")
        return samples
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, samples))
    by_replica: Dict[int, List] = {}
    for replica, read in gathered:
        if read is not None:
            by_replica.setdefault(replica, read)
    missing = [r for r in range(num_replicas) if r not in by_replica]
    if missing:
        raise ValueError(f"wrap_data_iterator: no rank of data-parallel replica(s) {missing} has a data iterator")
    shares = loader_shares(num_replicas * len(by_replica[0]), micro_batch_size, num_replicas)
    batch: List = [None] * sum(len(share) for share in shares)
    for replica, share in enumerate(shares):
        for position, sample in zip(share, by_replica[replica]):
            batch[position] = sample
    return batch


def _bounds_only(lengths: Sequence[int], composition: Composition) -> List[Dict[str, Any]]:
    batches = []
    for group in composition.groups:
        sizes = torch.tensor([lengths[p] for p in group], dtype=torch.int32)
        batches.append({CU_SEQLENS: torch.cat([sizes.new_zeros(1), sizes.cumsum(0, dtype=torch.int32)]),
                        MAX_SEQLEN: int(sizes.max())})
    return batches


def _document_ids(count: int) -> range:
    """What keyed dropout keys this call's documents on: their place in the run's stream of global batches (the
    keyed iteration, which set_iteration sets and a resumed run continues, times the batch, plus the position), so a
    position draws other masks each iteration; the same on every rank and layout."""
    from megatron_app.runtime.job import current_job

    keyed = current_job().keyed_randomness
    first = 0 if keyed is None else keyed.iteration * count
    return range(first, first + count)


def wrap_data_iterator(data_iterator, config, num_microbatches: int, pg_collection=None, *,
                       composition: Optional[str] = None, micro_batch_size: int = 1):
    """(iterator of the planned microbatches, their count, tokens computed, sum of squared document lengths).

    ``data_iterator``: one iterator, a list with one per model chunk (Megatron's convention with virtual
    pipelining; they yield the same samples, the first one that is not None is read), or None on a rank that reads
    no data; the result has the same structure. ``config`` (the model's TransformerConfig) is Megatron's argument:
    its microbatch_group_size_per_vp_stage bounds the microbatch counts a plan may choose. ``composition``:
    'balanced' (the planner's choice), 'packed' or 'loader' (groups of ``micro_batch_size`` documents in reading
    order, packed or padded); None: the installed settings' (install's ``composition``, 'balanced' unless it says
    otherwise). The iterators returned carry this replica's share of the plan to the forward_backward call they are
    passed to (runtime/next_call.py's PlannedIterator; with our runtime installed, a rank whose every chunk reads no
    data gets one that only carries the plan, which our runtime hands the forward step as None): pass them to that
    call.
    """
    from megatron_app.runtime.composition import decide_iteration_plan
    from megatron_app.runtime.install import is_installed
    from megatron_app.runtime.job import current_job
    from megatron_app.runtime.keyed_randomness import set_microbatch_documents
    from megatron_app.runtime.layout import job_layout
    from megatron_app.runtime.next_call import CallPlan, with_call_plan

    composition = current_job().settings.composition if composition is None else composition
    layout = job_layout(pg_collection)
    iterators = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    source = next((it for it in iterators if it is not None), None)
    mine = None if source is None else [_sample(next(source)) for _ in range(num_microbatches)]
    batch = _gather_global_batch(mine, layout.dp_rank, layout.num_replicas, micro_batch_size)
    lengths = [int(sample["tokens"].numel()) for sample in batch]
    plan = decide_iteration_plan(lengths, micro_batch_size, composition, pg_collection=pg_collection,
                                 document_ids=_document_ids(len(batch)),
                                 microbatch_group_size=getattr(config, "microbatch_group_size_per_vp_stage", None))
    replica = plan.replica(layout.dp_rank)
    # Keyed dropout draws each document's masks by document, under our schedule and Megatron's own: the same masks
    # whatever the composition, P, V or schedule.
    set_microbatch_documents(plan.document_segments(layout.dp_rank))
    planned = replica.composition
    if source is None:
        batches = _bounds_only([lengths[p] for p in replica.documents], planned) if planned.packed \
            else [{} for _ in planned.groups]
    else:
        batches = list(collate_replica(plan, layout.dp_rank, batch.__getitem__).iterator())
        if planned.packed:
            for collated in batches:
                bounds = collated[CU_SEQLENS]
                collated[MAX_SEQLEN] = int((bounds[1:] - bounds[:-1]).max())
    tokens = float(sum(sum(plan.microbatch_tokens(r)) for r in range(plan.num_replicas)))
    squares = float(sum(n * n for n in lengths))
    # A chunk that reads no data keeps None, unless packed: every chunk's attention needs the documents' bounds.
    wrapped: List[Optional[Iterator]] = [iter(batches) if it is not None or planned.packed else None
                                         for it in iterators]
    result = wrapped if isinstance(data_iterator, (list, tuple)) else wrapped[0]
    # The iterators carry this replica's share of the plan to the call; a rank whose every chunk reads no data gets
    # an iterator that carries only the plan where our runtime serves the call (which hands the forward step None).
    if any(it is not None for it in wrapped) or is_installed():
        result = with_call_plan(result, CallPlan.of_replica(plan, layout.dp_rank))
    return result, planned.num_microbatches, tokens, squares
