"""What a forward_backward call is planned to run (CallPlan), and how the plan reaches that call.

Megatron's forward_backward contract passes data iterators, which cannot be peeked without consuming them. The
trainer and wrap_data_iterator hand each call its plan with the data: the data iterator they pass is a
PlannedIterator (one per chunk) carrying this replica's CallPlan, and the executor reads it from the call's
``data_iterator`` argument (call_plan_of). A loop of one's own that passes its own iterators may instead say the
lengths before the call (set_microbatch_lengths) or agree a plan (composition.agree_iteration_plan): that plan waits
on the job (NextCall) and the call takes it, once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional, Sequence, Tuple

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

    def planned_by(self, plan: IterationPlan) -> "CallPlan":
        """These told lengths with the order, warm-ups and prediction of `plan`, a plan of them alone
        (iteration_plan.plan_told_microbatches: one replica, one document per microbatch)."""
        if plan.num_replicas != 1 or plan.replica(0).num_microbatches != self.num_microbatches:
            raise ValueError(f"a plan of {plan.num_replicas} replica(s) does not plan {self.num_microbatches} told "
                             "microbatches")
        replica, calibrated = plan.replica(0), plan.calibrated
        return replace(self, plan=replica.plan, predicted_s=replica.predicted_s if calibrated else None,
                       nominal_predicted_s=replica.nominal_predicted_s if calibrated else None,
                       predicted_iteration_s=plan.predicted_s if calibrated else None)

    def check_count(self, num_microbatches: int) -> "CallPlan":
        """This plan, for a call that runs num_microbatches (refused when they differ)."""
        if self.num_microbatches != num_microbatches:
            if self.composition is None:
                raise ValueError(f"{self.num_microbatches} microbatch lengths were set for a call with "
                                 f"{num_microbatches} microbatches")
            raise ValueError(f"the loop planned {self.num_microbatches} microbatches, the forward_backward call "
                             f"runs {num_microbatches}")
        return self


class PlannedIterator:
    """One chunk's data iterator for one forward_backward call, carrying that call's plan (``call_plan``).

    Iterates as its ``source`` does. Our runtime reads the plan from it and hands the forward step the source itself
    (None for a chunk that reads no data: ``source`` None, only to carry the plan to a rank without data)."""

    def __init__(self, source: Optional[Iterator[Any]], call_plan: CallPlan):
        self.source = source
        self.call_plan = call_plan

    def __iter__(self) -> "PlannedIterator":
        return self

    def __next__(self) -> Any:
        if self.source is None:
            raise TypeError("this chunk reads no data (a PlannedIterator that only carries its call's plan)")
        return next(self.source)


def with_call_plan(data_iterator, call_plan: CallPlan):
    """``data_iterator`` (one iterator, None, or a list or tuple with one per chunk), each iterator wrapped to carry
    ``call_plan``; a chunk without data stays None unless no chunk has data, then the first carries the plan alone."""
    if isinstance(data_iterator, (list, tuple)):
        wrapped = [None if it is None else PlannedIterator(it, call_plan) for it in data_iterator]
        if wrapped and all(it is None for it in wrapped):
            wrapped[0] = PlannedIterator(None, call_plan)
        return type(data_iterator)(wrapped)
    return PlannedIterator(data_iterator, call_plan)


def call_plan_of(data_iterator) -> Optional[CallPlan]:
    """The CallPlan a call's data iterator carries (the first chunk's that has one), or None."""
    iterators = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    return next((it.call_plan for it in iterators if isinstance(it, PlannedIterator)), None)


def data_source(iterator):
    """What the forward step reads: a PlannedIterator's source, any other iterator (or None) itself."""
    return iterator.source if isinstance(iterator, PlannedIterator) else iterator


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
        return None if pending is None else pending.check_count(num_microbatches)

    def take_lengths(self, num_microbatches: int) -> Optional[Tuple[int, ...]]:
        """The lengths told for this call (consumed), or None when the loop told none."""
        pending = self.take(num_microbatches)
        return None if pending is None else pending.tokens
