"""plan_microbatches: which documents of the global batch form each microbatch of the next forward_backward call.

Minimal version until the planner arrives (the lead replaces this file at merge): 'loader' and 'packed' keep the
loader's own groups, padded or packed; 'balanced' is refused. Every rank of a pipeline calls it at the same point,
with the same lengths (its replica's share of the global batch, loader order), before the forward_backward call that
runs those microbatches; that call then takes num_microbatches = composition.num_microbatches. The schedule is told
each microbatch's tokens here, so the loop does not call set_microbatch_lengths.
"""

from __future__ import annotations

from typing import Sequence

from megatron_app.schedule.composition import BALANCED, PACKED, Composition, check_composition_name, \
    loader_composition

from .microbatch_lengths import set_microbatch_lengths


def plan_microbatches(document_lengths: Sequence[int], micro_batch_size: int, composition: str) -> Composition:
    check_composition_name(composition)
    if composition == BALANCED:
        raise NotImplementedError("balanced arrives with the planner")
    lengths = [int(length) for length in document_lengths]
    planned = loader_composition(len(lengths), micro_batch_size, packed=composition == PACKED)
    set_microbatch_lengths(planned.microbatch_tokens(lengths))
    return planned
