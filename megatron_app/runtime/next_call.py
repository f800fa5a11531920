"""What the training loop tells the runtime about its next forward_backward call, kept on the job until that call.

Megatron's forward_backward contract passes data iterators, which cannot be peeked without consuming them, so a
loop that trains on variable-length microbatches says their (padded) lengths before the call (set_microbatch_lengths),
or agrees an iteration plan (composition.agree_iteration_plan), whose replica share becomes the call's CallPlan. The
call takes it, once: one slot, one lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from megatron_app.schedule.iteration_plan import DocumentSegment, IterationPlan
from megatron_app.schedule.plan_search import Plan


@dataclass(frozen=True)
class CallPlan:
    """The next call as planned: per microbatch its tokens (activation sizes, planning) and, from an iteration plan,
    its squared document tokens (cost learning), the order and warm-ups to adopt (None: the policy plans the call
    itself), where each document lies (keyed dropout) and what the plan predicted for this replica."""
    tokens: Tuple[int, ...]
    squared_tokens: Optional[Tuple[int, ...]] = None
    plan: Optional[Plan] = None     # the replica's order and warm-ups (IterationPlan's ReplicaPlan.plan)
    document_segments: Optional[Tuple[Tuple[DocumentSegment, ...], ...]] = None
    composition: Optional[str] = None
    predicted_s: Optional[float] = None             # this replica's pipeline, its assumed speed applied
    nominal_predicted_s: Optional[float] = None     # the same at nominal speed (replica speeds learn from it)
    predicted_iteration_s: Optional[float] = None   # the slowest replica's

    @property
    def num_microbatches(self) -> int:
        return len(self.tokens)

    @classmethod
    def of_lengths(cls, seq_lengths: Sequence[int]) -> "CallPlan":
        lengths = tuple(int(length) for length in seq_lengths)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"microbatch lengths must be positive integers, got {list(seq_lengths)!r}")
        return cls(lengths)

    @classmethod
    def of_replica(cls, plan: IterationPlan, dp_rank: int) -> "CallPlan":
        replica = plan.replica(dp_rank)
        calibrated = plan.calibrated     # the prior's predictions are a relative scale, not seconds
        return cls(plan.microbatch_tokens(dp_rank), plan.microbatch_squared_tokens(dp_rank), replica.plan,
                   plan.document_segments(dp_rank), plan.composition_name,
                   replica.predicted_s if calibrated else None, replica.nominal_predicted_s if calibrated else None,
                   plan.predicted_s if calibrated else None)


class NextCall:
    def __init__(self):
        self.pending: Optional[CallPlan] = None

    def expect(self, call: CallPlan) -> None:
        self.pending = call

    def set_lengths(self, seq_lengths: Sequence[int]) -> None:
        self.expect(CallPlan.of_lengths(seq_lengths))

    @property
    def lengths(self) -> Optional[Tuple[int, ...]]:
        return None if self.pending is None else self.pending.tokens

    def take(self, num_microbatches: int) -> Optional[CallPlan]:
        """What was told or planned for this call (consumed), or None when the loop said nothing."""
        pending, self.pending = self.pending, None
        if pending is not None and pending.num_microbatches != num_microbatches:
            if pending.composition is None:
                raise ValueError(f"{pending.num_microbatches} microbatch lengths were set for a call with "
                                 f"{num_microbatches} microbatches")
            raise ValueError(f"the loop planned {pending.num_microbatches} microbatches, the forward_backward call "
                             f"runs {num_microbatches}")
        return pending

    def take_lengths(self, num_microbatches: int) -> Optional[Tuple[int, ...]]:
        """The lengths told for this call (consumed), or None when the loop told none."""
        pending = self.take(num_microbatches)
        return None if pending is None else pending.tokens
