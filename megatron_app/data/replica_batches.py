"""The data side of an iteration plan: one replica's microbatches, read and collated as the plan says.

The trainer (train/composed_data.py) and wrap_data_iterator (train/data_schedule.py) both go through
collate_replica, so a plan's documents become the same batches whoever drives the iteration.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator

from megatron_app.schedule.composition import Composition
from megatron_app.schedule.iteration_plan import IterationPlan

from .document_data import pack_documents, pad_to_longest


class ReplicaBatches:
    """A replica's microbatches in entry order, each read and collated when first drawn and then shared by every
    chunk that draws it (a rank whose chunks read no data reads nothing)."""

    def __init__(self, plan: IterationPlan, dp_rank: int, read: Callable[[int], dict]):
        replica = plan.replica(dp_rank)
        self.composition: Composition = replica.composition
        self._documents = replica.documents        # the global batch's positions this replica computes
        self._read = read
        self._collated: Dict[int, dict] = {}

    def __len__(self) -> int:
        return self.composition.num_microbatches

    def __getitem__(self, index: int) -> dict:
        if index not in self._collated:
            collate = pack_documents if self.composition.packed else pad_to_longest
            group = self.composition.groups[index]
            self._collated[index] = collate([self._read(self._documents[p]) for p in group])
        return self._collated[index]

    def iterator(self) -> Iterator[dict]:
        return (self[index] for index in range(len(self)))


def collate_replica(plan: IterationPlan, dp_rank: int, read: Callable[[int], dict]) -> ReplicaBatches:
    """Replica ``dp_rank``'s microbatches of ``plan``; ``read(position)`` returns the document at that position of the
    global batch (the loader's order), as a sample dict."""
    return ReplicaBatches(plan, dp_rank, read)
