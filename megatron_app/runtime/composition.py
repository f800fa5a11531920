"""plan_microbatches: which documents of this replica's global batch form each microbatch of the next call.

A collective of the pipeline group: every rank of a pipeline calls it at the same point, before the forward_backward
call that runs those microbatches, with the same document lengths (loader order 0..n-1). Names
(schedule/composition.py): 'loader' = the loader's groups padded, 'packed' = the loader's groups packed,
'dp-balanced' = the documents in loader order packed up to a token budget, as Megatron-LM's DpBalancedScheduler does
(not cost-aware; the benchmark's reference packer), 'balanced' = schedule/composition_plan.py's choice (microbatch
count, groups, order, per-rank warm-ups), planned on pipeline rank 0 with the costs its `planned` policy has learnt
(the prior before any call) within the planning budget, and broadcast over the pipeline group. The next
forward_backward must be called with num_microbatches = composition.num_microbatches; the runtime is told each
microbatch's tokens (activation sizes) and squared tokens (cost learning) itself, and the `planned` policy ADOPTS the
plan chosen with the composition (no second search). With data parallelism each replica plans its own share.

The interleaved schedule's rule on the microbatch count (megatron-core 0.16.1, and our PipelineShape): with
N = microbatch_group_size_per_vp_stage (default P), P <= N <= m and m % N in {0} or >= P; the balanced planner
only picks such counts, assuming Megatron's default N = P.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_app.schedule.composition import (BALANCED, DP_BALANCED, PACKED, Composition, check_composition_name,
                                               loader_composition, loader_order_packing)
from megatron_app.schedule.composition_plan import CompositionPlanner, valid_microbatch_counts

from .job import current_job
from .microbatch_lengths import set_microbatch_lengths
from .next_call import PendingComposition


def _pipeline():
    """(pipeline group or None, its global ranks, pipeline rank, P, V) from Megatron's parallel state."""
    from megatron.core import parallel_state

    if not (dist.is_available() and dist.is_initialized()) or not parallel_state.model_parallel_is_initialized():
        return None, [0], 0, 1, 1
    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    V = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    return group, ranks, dist.get_rank(group), len(ranks), V


def plan_microbatches(document_lengths: Sequence[int], micro_batch_size: int, composition: str,
                      token_budget: Optional[int] = None) -> Composition:
    """token_budget: dp-balanced's tokens per microbatch (default micro_batch_size x the longest document)."""
    check_composition_name(composition)
    lengths = tuple(int(v) for v in document_lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"document lengths must be positive integers, got {list(document_lengths)!r}")
    job = current_job()
    session = job.session
    plan = None
    if composition == DP_BALANCED:
        _, _, _, P, V = _pipeline()
        chosen = loader_order_packing(lengths, token_budget or micro_batch_size * max(lengths),
                                      valid_microbatch_counts(P, V, len(lengths),
                                                              split_backward=session.settings.split_backward))
    elif composition != BALANCED:
        chosen = loader_composition(len(lengths), micro_batch_size, packed=composition == PACKED)
    else:
        group, ranks, pp_rank, P, V = _pipeline()
        chosen = None
        if pp_rank == 0:
            planner = CompositionPlanner(P, V, split_backward=session.settings.split_backward,
                                         memory_factor=session.settings.memory_factor or 1.0)
            start = time.perf_counter()
            composed = planner.plan(lengths, micro_batch_size, session.shared_costs(),
                                    stop=session.planning_stop(start))
            session.last_planning_s = time.perf_counter() - start
            chosen, plan = composed.composition, composed.plan
        if len(ranks) > 1:
            shared = [(chosen, plan)]
            dist.broadcast_object_list(shared, src=ranks[0], group=group)
            chosen, plan = shared[0]
    tokens = chosen.microbatch_tokens(lengths)
    # Handed to the job's next forward_backward call (next_call.py), which takes both.
    job.next_call.composition = PendingComposition(chosen.num_microbatches,
                                                   chosen.microbatch_squared_tokens(lengths), plan)
    set_microbatch_lengths(tokens)
    return chosen


def take_pending_composition(num_microbatches: int) -> Optional[PendingComposition]:
    """The composition planned for the current job's next call (consumed), or None when the loop planned none."""
    return current_job().next_call.take_composition(num_microbatches)
