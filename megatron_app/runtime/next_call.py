"""What the training loop tells the runtime about its next forward_backward call, kept on the job until that call.

Megatron's forward_backward contract passes data iterators, which cannot be peeked without consuming them, so a
loop that trains on variable-length microbatches says their (padded) lengths before the call (set_microbatch_lengths),
or plans their composition (plan_microbatches). The call takes both, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple


@dataclass(frozen=True)
class PendingComposition:
    """What plan_microbatches decided for the next call beyond its tokens (told as its lengths): per microbatch the
    squared document tokens, and the plan chosen with the composition (None: the policy plans the call itself)."""
    num_microbatches: int
    squared_tokens: Tuple[int, ...]
    plan: object = None


class NextCall:
    def __init__(self):
        self.lengths: Optional[Tuple[int, ...]] = None
        self.composition: Optional[PendingComposition] = None

    def set_lengths(self, seq_lengths: Sequence[int]) -> None:
        lengths = tuple(int(length) for length in seq_lengths)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"microbatch lengths must be positive integers, got {list(seq_lengths)!r}")
        self.lengths = lengths

    def take_lengths(self, num_microbatches: int) -> Optional[Tuple[int, ...]]:
        """The lengths told for this call (consumed), or None when the loop told none."""
        lengths, self.lengths = self.lengths, None
        if lengths is not None and len(lengths) != num_microbatches:
            raise ValueError(f"{len(lengths)} microbatch lengths were set for a call with {num_microbatches} "
                             "microbatches")
        return lengths

    def take_composition(self, num_microbatches: int) -> Optional[PendingComposition]:
        """The composition planned for this call (consumed), or None when the loop planned none."""
        pending, self.composition = self.composition, None
        if pending is not None and pending.num_microbatches != num_microbatches:
            raise ValueError(f"plan_microbatches planned {pending.num_microbatches} microbatches, the "
                             f"forward_backward call runs {num_microbatches}")
        return pending
