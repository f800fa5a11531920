"""Greedy policies `dfc` and `bfc`: run any ready task at once, backward first, forwards under a deadlock-free
memory cap (admission.py), and W's (split backward) when nothing else can run: idle time is what they fill."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from .admission import check_memory_cap, forward_fits
from .megatron_order import megatron_interleaved_cap
from .policy import Policy
from .shape import PipelineShape
from .state import RankState
from .tasks import Kind, Task


def _chain_position(task: Task, num_chunks: int) -> int:
    """How far along its microbatch's chain a task is on this rank: F chunk 0..V-1, then B chunk V-1..0."""
    return task.chunk if task.kind is Kind.FORWARD else 2 * num_chunks - 1 - task.chunk


class GreedyPolicy(Policy):
    """Any ready backward beats any forward; among each kind `priority` orders; forwards must pass admission."""

    def __init__(self, shape: PipelineShape, rank: int, memory_cap: int, name: str,
                 priority: Callable[[Task], Tuple]):
        super().__init__(shape, rank, memory_cap)
        self.name = name
        self.priority = priority

    def next(self, state: RankState) -> Optional[Task]:
        ready = state.ready()
        backwards = [t for t in ready if t.kind is Kind.BACKWARD]
        if backwards:
            return min(backwards, key=self.priority)
        for task in sorted((t for t in ready if t.kind is Kind.FORWARD), key=self.priority):
            if forward_fits(state, task, self.memory_cap):
                return task
        fill = state.ready_fill()    # admission.py rule (3): a rank with a ready W never idles
        return fill[0] if fill else None


def depth_first(shape: PipelineShape) -> Callable[[Task], Tuple]:
    # Oldest microbatch first, and within it the task furthest along its chain (higher chunk for forwards).
    num_chunks = shape.num_chunks
    return lambda t: (t.microbatch, -_chain_position(t, num_chunks))


def breadth_first(shape: PipelineShape) -> Callable[[Task], Tuple]:
    # Earliest chain position first (lower chunk for forwards) across the microbatches of one group, groups in
    # order. The group is Megatron's microbatch_group_size (default P): unbounded breadth starves the deeper chunks
    # and ran ~4x slower than Megatron at P=8, V=4, m=32; a shape with microbatch_group_size=m gives pure breadth.
    num_chunks, group_size = shape.num_chunks, shape.microbatch_group_size
    return lambda t: (t.microbatch // group_size, _chain_position(t, num_chunks), t.microbatch)


def make_greedy(name: str, priority: Callable[[PipelineShape], Callable[[Task], Tuple]], shape: PipelineShape,
                rank: int, memory_cap: Optional[int]) -> GreedyPolicy:
    """A greedy policy for one rank; memory_cap None = the peak Megatron's interleaved order holds there."""
    if memory_cap is None:
        memory_cap = megatron_interleaved_cap(shape, rank)
    check_memory_cap(shape, memory_cap)
    return GreedyPolicy(shape, rank, memory_cap, name, priority(shape))


def make_dfc(shape: PipelineShape, rank: int, memory_cap: Optional[int] = None) -> GreedyPolicy:
    return make_greedy("dfc", depth_first, shape, rank, memory_cap)


def make_bfc(shape: PipelineShape, rank: int, memory_cap: Optional[int] = None) -> GreedyPolicy:
    return make_greedy("bfc", breadth_first, shape, rank, memory_cap)
