"""Under --variable-seq-lengths, each global batch's microbatches as its iteration plan makes them (--composition).

Per iteration: the lengths of every document of the global batch (loader order, from the index alone) go to the one
planning function (schedule/iteration_plan.py; under our runtime through decide_iteration_plan, decided on one rank
and the same on every rank of the job), which says which documents each data-parallel replica computes, which of
them form each microbatch and whether a microbatch is packed (one row, no padding) or padded (the loader's layout);
this replica's batches are then read and collated from that. The global batch is the same set of documents whatever
the composition, so the data position of a resumed run is the global batch count, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Sequence, Union

from megatron_app.runtime.keyed_randomness import set_microbatch_documents
from megatron_app.runtime.next_call import CallPlan
from megatron_app.schedule.composition import LOADER, PACKED, Composition
from megatron_app.schedule.iteration_plan import IterationPlan, PlanRequest, plan_iteration

from .flags import MEGATRON_SCHEDULE, completed
from .forward_backward import with_call
from megatron_app.data.document_data import sample_length
from megatron_app.data.replica_batches import collate_replica
from megatron_app.data.synthetic_documents import SyntheticDocuments
from .step import forward_step, packed_forward_step


@dataclass
class ComposedBatch:
    data_iterator: Union[Iterator[dict], List[Iterator[dict]]]   # one, or one per model chunk
    plan: IterationPlan
    dp_rank: int
    samples: List[int]    # global sample index (the document id) of each document this replica computes

    @property
    def composition(self) -> Composition:
        return self.plan.replica(self.dp_rank).composition

    @property
    def num_microbatches(self) -> int:
        return self.composition.num_microbatches

    @property
    def forward_step_func(self):
        """Packed microbatches need their documents' bounds on every chunk, not only the first and last."""
        return packed_forward_step if self.composition.packed else forward_step


def composition_name(args) -> str:
    """--composition (drivers that build args by hand may leave it out: args.completed says what it then is)."""
    return completed(args).composition


def global_batch_samples(args, first_sample: int) -> List[int]:
    """Global sample indices of the global batch that starts at ``first_sample``, in the loader's order."""
    return list(range(first_sample, first_sample + args.global_batch_size))


def plan_global_batch(args, lengths: Sequence[int], samples: Sequence[int], upcoming=None, groups=None
                      ) -> IterationPlan:
    """The plan of the next forward_backward call; our runtime agrees it over the job (and is handed this rank's
    share), Megatron's own schedule takes the loader's groups. upcoming: (lengths, samples) of the batch after, to
    plan ahead. groups: the microbatches themselves, packed (--synthetic-microbatches). Tests replace this function
    to regroup."""
    if args.schedule == MEGATRON_SCHEDULE:
        return plan_iteration(PlanRequest(tuple(lengths), PACKED if composition_name(args) == PACKED else LOADER,
                                          args.micro_batch_size, num_replicas=args.data_parallel,
                                          document_ids=tuple(samples), groups=groups))
    from megatron_app.runtime.composition import decide_iteration_plan

    return decide_iteration_plan(lengths, args.micro_batch_size, composition_name(args), document_ids=samples,
                                next_lengths=None if upcoming is None else upcoming[0],
                                next_document_ids=None if upcoming is None else upcoming[1], groups=groups)


def compose_global_batch(args, dataset, dp_rank: int, first_sample: int, num_chunks: int,
                         plan_ahead: bool = False) -> ComposedBatch:
    """Plan the global batch (a collective of the job under our runtime) and read this replica's microbatches of
    it; every chunk gets its own iterator over the same batches. plan_ahead (--plan-ahead, and a global batch
    follows): the next global batch is planned while this one trains."""
    samples = global_batch_samples(args, first_sample)
    upcoming = None
    if plan_ahead:
        following = global_batch_samples(args, first_sample + args.global_batch_size)
        upcoming = ([sample_length(dataset, index) for index in following], following)
    groups = dataset.groups_at(first_sample) if isinstance(dataset, SyntheticDocuments) else None
    plan = plan_global_batch(args, [sample_length(dataset, index) for index in samples], samples, upcoming, groups)
    replica = plan.replica(dp_rank)
    mine = [samples[position] for position in replica.documents]
    set_microbatch_documents(plan.document_segments(dp_rank))    # keyed dropout: each document's masks by document
    batches = collate_replica(plan, dp_rank, lambda position: dataset[samples[position]])
    iterators = batches.iterator() if num_chunks == 1 else [batches.iterator() for _ in range(num_chunks)]
    iterators = with_call(args.schedule, iterators, CallPlan.of_replica(plan, dp_rank))   # this replica's share
    return ComposedBatch(iterators, plan, dp_rank, mine)
