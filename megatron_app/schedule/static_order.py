"""Static policies: a fixed per-rank order (Megatron-Core's `1f1b` and `interleaved`) that waits for its next task."""

from __future__ import annotations

from typing import Optional, Tuple

from .admission import check_memory_cap
from .errors import ScheduleConfigError
from .megatron_order import megatron_order, peak_activations_of_order
from .policy import Policy
from .shape import PipelineShape
from .state import RankState
from .tasks import Task


class StaticOrderPolicy(Policy):
    """Runs a fixed per-rank order; returns its next task only once that task is ready."""

    def __init__(self, shape: PipelineShape, rank: int, memory_cap: int, name: str, order: Tuple[Task, ...]):
        super().__init__(shape, rank, memory_cap)
        self.name = name
        self.order = order

    def expected_next(self, state: RankState) -> Optional[Task]:
        position = state.started_count
        return self.order[position] if position < len(self.order) else None

    def next(self, state: RankState) -> Optional[Task]:
        task = self.expected_next(state)
        return task if task is not None and state.is_ready(task) else None


def make_static(name: str, order: Tuple[Task, ...], shape: PipelineShape, rank: int,
                memory_cap: Optional[int]) -> StaticOrderPolicy:
    """`order` as a policy; memory_cap None = the order's own peak; a smaller cap is an error (it cannot adapt)."""
    needed = peak_activations_of_order(shape, order)
    if memory_cap is not None:
        check_memory_cap(shape, memory_cap)
        if memory_cap < needed:
            raise ScheduleConfigError(
                f"policy {name!r} holds up to {needed} activations on rank {rank}; memory_cap={memory_cap} "
                f"is below that (a static order cannot adapt to a smaller cap)")
    return StaticOrderPolicy(shape, rank, needed if memory_cap is None else memory_cap, name, order)


def make_megatron_1f1b(shape: PipelineShape, rank: int, memory_cap: Optional[int] = None) -> StaticOrderPolicy:
    if shape.num_chunks != 1:
        raise ScheduleConfigError(
            f"policy '1f1b' needs num_chunks == 1, got {shape.num_chunks}; use 'interleaved' for model chunks")
    return make_static("1f1b", megatron_order(shape, rank), shape, rank, memory_cap)


def make_megatron_interleaved(shape: PipelineShape, rank: int,
                              memory_cap: Optional[int] = None) -> StaticOrderPolicy:
    return make_static("interleaved", megatron_order(shape, rank), shape, rank, memory_cap)
