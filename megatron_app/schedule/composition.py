"""Which documents of a global batch form each microbatch (the composition), and the compositions by name.

A global batch (this data-parallel replica's share of it) is a list of whole documents, positions 0..n-1 in the
loader's order. A composition groups them into microbatches: microbatch k of the call holds the documents
``groups[k]``. ``packed`` says how the data side lays a group out: packed = one row of the documents concatenated
(no padding; position ids restart and attention stays inside each document), not packed = the loader's layout,
``len(group)`` rows padded to the group's longest document. With a per-token loss the gradient of the global batch
is the same sum over its tokens whatever the grouping, so a schedule is free to choose it.

Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from .errors import ScheduleConfigError

LOADER = "loader"          # the loader's own microbatches, each padded to its longest document (Megatron's way)
PACKED = "packed"          # the loader's own microbatches, each packed into one row without padding
DP_BALANCED = "dp-balanced"  # loader order packed up to a token budget (Megatron-LM's DpBalancedScheduler's way)
BALANCED = "balanced"      # cost-balanced packing planned together with the order (see composition_plan.py), with
                           # documents moved between data-parallel replicas by cost (iteration_plan.py)
LOCAL_BALANCED = "balanced-local"   # balanced within each replica's own loader share (no document moves)
COMPOSITION_NAMES = (LOADER, PACKED, DP_BALANCED, BALANCED, LOCAL_BALANCED)
PLANNED_COMPOSITIONS = (BALANCED, LOCAL_BALANCED)   # planned with their order: they need our schedule
# Under our runtime: at or above packed in every real-compute row and well above it emulated (BENCHMARKS.md,
# "Microbatch composition"; docs/variable-lengths.md says why).
DEFAULT_COMPOSITION = BALANCED


def default_composition(planned_by_our_runtime: bool) -> str:
    """The composition when none is given: DEFAULT_COMPOSITION where our runtime plans the iteration; the loader's
    own microbatches where Megatron's schedule runs them or nothing composes documents."""
    return DEFAULT_COMPOSITION if planned_by_our_runtime else LOADER


@dataclass(frozen=True)
class Composition:
    groups: Tuple[Tuple[int, ...], ...]     # microbatch k -> positions of its documents in the global batch
    packed: bool

    @property
    def num_microbatches(self) -> int:
        return len(self.groups)

    def check(self, num_documents: int) -> None:
        """Raise ScheduleConfigError unless every document 0..num_documents-1 is in exactly one non-empty group."""
        seen = sorted(position for group in self.groups for position in group)
        if seen != list(range(num_documents)) or any(not group for group in self.groups):
            raise ScheduleConfigError(f"a composition must place documents 0..{num_documents - 1} once each in "
                                      f"non-empty microbatches, got {[list(g) for g in self.groups]}")

    def microbatch_tokens(self, document_lengths: Sequence[int]) -> Tuple[int, ...]:
        """Tokens each microbatch computes on: the sum of its documents packed, rows x longest padded."""
        if self.packed:
            return tuple(sum(document_lengths[p] for p in group) for group in self.groups)
        return tuple(len(group) * max(document_lengths[p] for p in group) for group in self.groups)

    def microbatch_squared_tokens(self, document_lengths: Sequence[int]) -> Tuple[int, ...]:
        """Attention's quadratic term per microbatch: the sum of its documents' squared lengths packed (attention
        stays inside each document), rows x longest^2 padded."""
        if self.packed:
            return tuple(sum(document_lengths[p] ** 2 for p in group) for group in self.groups)
        return tuple(len(group) * max(document_lengths[p] for p in group) ** 2 for group in self.groups)

    def padding_tokens(self, document_lengths: Sequence[int]) -> int:
        return sum(self.microbatch_tokens(document_lengths)) - sum(document_lengths)


def loader_groups(num_documents: int, micro_batch_size: int) -> Tuple[Tuple[int, ...], ...]:
    """The loader's own microbatches: consecutive runs of micro_batch_size documents."""
    if micro_batch_size < 1 or num_documents % micro_batch_size:
        raise ScheduleConfigError(f"{num_documents} documents do not split into microbatches of {micro_batch_size}")
    return tuple(tuple(range(start, start + micro_batch_size)) for start in range(0, num_documents, micro_batch_size))


def loader_composition(num_documents: int, micro_batch_size: int, packed: bool) -> Composition:
    return Composition(loader_groups(num_documents, micro_batch_size), packed)


def check_composition_name(name: str) -> str:
    if name not in COMPOSITION_NAMES:
        raise ScheduleConfigError(f"unknown composition {name!r}; choose from {', '.join(COMPOSITION_NAMES)}")
    return name
