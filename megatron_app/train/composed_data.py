"""Under --variable-seq-lengths, each global batch's microbatches as a composition makes them (--composition).

Per iteration: the lengths of this data-parallel replica's share of the global batch (loader order, from the index
alone) go to the runtime's plan_microbatches, which says which documents form each microbatch and whether a
microbatch is packed (one row, no padding) or padded (the loader's layout); the batches are then read and collated
from that. The global batch is the same set of documents whatever the composition, so the data position of a
resumed run is the global batch count, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence, Union

from megatron_app.runtime.keyed_randomness import DocumentSegment, set_microbatch_documents
from megatron_app.schedule.composition import LOADER, PACKED, Composition, loader_composition

from .args import MEGATRON_SCHEDULE
from .data import MicrobatchSampler
from megatron_app.data.document_data import pack_documents, pad_to_longest, sample_length
from .step import forward_step, packed_forward_step


@dataclass
class ComposedBatch:
    data_iterator: Union[Iterator[dict], List[Iterator[dict]]]   # one, or one per model chunk
    composition: Composition
    samples: List[int]    # global sample index (the document id) of each position of the replica's share

    @property
    def num_microbatches(self) -> int:
        return self.composition.num_microbatches

    @property
    def forward_step_func(self):
        """Packed microbatches need their documents' bounds on every chunk, not only the first and last."""
        return packed_forward_step if self.composition.packed else forward_step


def composition_name(args) -> str:
    """--composition (drivers that build args by hand may leave it out: the loader's own microbatches)."""
    return getattr(args, "composition", None) or LOADER


def replica_samples(args, dp_rank: int, first_sample: int) -> List[int]:
    """Global sample indices of this replica's share of the global batch that starts at ``first_sample``, in the
    loader's order (its microbatches one after the other)."""
    sampler = MicrobatchSampler(first_sample + args.global_batch_size, args.micro_batch_size, dp_rank,
                                args.data_parallel)
    return [index for microbatch in sampler.microbatches_from(first_sample, args.num_microbatches)
            for index in microbatch]


def plan_composition(args, document_lengths: Sequence[int]) -> Composition:
    """The composition of the next forward_backward call; our runtime plans it (and is told the microbatches'
    tokens), Megatron's own schedule takes the loader's groups. Tests replace this function to regroup."""
    if args.schedule == MEGATRON_SCHEDULE:
        return loader_composition(len(document_lengths), args.micro_batch_size, packed=composition_name(args) == PACKED)
    from megatron_app.runtime.composition import plan_microbatches

    return plan_microbatches(document_lengths, args.micro_batch_size, composition_name(args))


def _collate(dataset, samples, composition: Composition, group) -> dict:
    collate = pack_documents if composition.packed else pad_to_longest
    return collate([dataset[samples[position]] for position in group])


class _LazyBatches:
    """Each microbatch read and collated when a chunk first draws it, then shared by the chunks that draw it too
    (a rank whose chunks read no data reads nothing)."""

    def __init__(self, dataset, samples: Sequence[int], composition: Composition):
        self._dataset, self._samples, self._composition = dataset, samples, composition
        self._read: Dict[int, dict] = {}

    def iterator(self) -> Iterator[dict]:
        for index, group in enumerate(self._composition.groups):
            if index not in self._read:
                self._read[index] = _collate(self._dataset, self._samples, self._composition, group)
            yield self._read[index]


def document_layout(samples: Sequence[int], lengths: Sequence[int], composition: Composition):
    """Where each document lies in its microbatch (for dropout keyed by document): packed, one after the other in
    row 0; padded, one per row from position 0."""
    layout = []
    for group in composition.groups:
        segments, start = [], 0
        for row, position in enumerate(group):
            if composition.packed:
                segments.append(DocumentSegment(samples[position], 0, start, lengths[position]))
                start += lengths[position]
            else:
                segments.append(DocumentSegment(samples[position], row, 0, lengths[position]))
        layout.append(segments)
    return layout


def compose_global_batch(args, dataset, dp_rank: int, first_sample: int, num_chunks: int) -> ComposedBatch:
    """Plan (a collective of the pipeline under our runtime) and read this replica's microbatches of one global
    batch; every chunk gets its own iterator over the same batches."""
    samples = replica_samples(args, dp_rank, first_sample)
    lengths = [sample_length(dataset, index) for index in samples]
    composition = plan_composition(args, lengths)
    composition.check(len(samples))
    set_microbatch_documents(document_layout(samples, lengths, composition))
    batches = _LazyBatches(dataset, samples, composition)
    iterators = batches.iterator() if num_chunks == 1 else [batches.iterator() for _ in range(num_chunks)]
    return ComposedBatch(iterators, composition, samples)
