"""Scheduling policies: given a RankState, which task should this rank run next?

Adaptive policies (`dfc`, `bfc`) pick greedily among ready tasks, backward first, under a deadlock-free memory cap
(admission.py). Static policies (`1f1b`, `interleaved`) follow Megatron-Core's exact per-rank order and wait for
their next task. Policies never change the state: the driver calls mark_started / mark_done.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

from .admission import check_memory_cap, forward_fits
from .errors import ScheduleConfigError
from .megatron_order import megatron_interleaved_cap, megatron_order, peak_activations_of_order
from .shape import PipelineShape
from .state import RankState
from .tasks import Kind, Task

POLICY_NAMES = ("dfc", "bfc", "1f1b", "interleaved", "adaptive", "planned")


class Policy:
    """Base: `next` decides; `expected_next` names the task a static order waits for; `observe` may learn."""

    name = "policy"

    def __init__(self, shape: PipelineShape, rank: int, memory_cap: int):
        shape.check_rank(rank)
        self.shape = shape
        self.rank = rank
        self.memory_cap = memory_cap

    def next(self, state: RankState) -> Optional[Task]:
        raise NotImplementedError

    def expected_next(self, state: RankState) -> Optional[Task]:
        return None

    def observe(self, task: Task, duration_s: float) -> None:
        """Called after each task with its measured duration; adaptive cost models override it."""

    # Planning policies choose each iteration's plan on one rank and every rank adopts it (the simulator hands it
    # over, the runtime broadcasts it); for the others both calls do nothing.
    plans_iterations = False

    def plan_iteration(self, lengths, stop=None):
        """The plan for the next iteration, given its microbatch lengths (None: not told)."""
        return None

    def use_plan(self, lengths, plan) -> None:
        """Adopt `plan` (from some rank's plan_iteration) for the next iteration."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, memory_cap={self.memory_cap})"


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
        for task in sorted(ready, key=self.priority):
            if forward_fits(state, task, self.memory_cap):
                return task
        return None


def _depth_first(num_chunks: int) -> Callable[[Task], Tuple]:
    # Oldest microbatch first, and within it the task furthest along its chain (higher chunk for forwards).
    return lambda t: (t.microbatch, -_chain_position(t, num_chunks))


def _breadth_first(num_chunks: int, group_size: int) -> Callable[[Task], Tuple]:
    # Earliest chain position first (lower chunk for forwards) across the microbatches of one group, groups in
    # order. The group is Megatron's microbatch_group_size (default P): unbounded breadth starves the deeper chunks
    # and ran ~4x slower than Megatron at P=8, V=4, m=32; a shape with microbatch_group_size=m gives pure breadth.
    return lambda t: (t.microbatch // group_size, _chain_position(t, num_chunks), t.microbatch)


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


def _make_static(name: str, shape: PipelineShape, rank: int, memory_cap: Optional[int]) -> StaticOrderPolicy:
    if name == "1f1b" and shape.num_chunks != 1:
        raise ScheduleConfigError(
            f"policy '1f1b' needs num_chunks == 1, got {shape.num_chunks}; use 'interleaved' for model chunks")
    order = megatron_order(shape, rank)
    needed = peak_activations_of_order(shape, order)
    if memory_cap is not None:
        check_memory_cap(shape, memory_cap)
        if memory_cap < needed:
            raise ScheduleConfigError(
                f"policy {name!r} holds up to {needed} activations on rank {rank}; memory_cap={memory_cap} "
                f"is below that (a static order cannot adapt to a smaller cap)")
    return StaticOrderPolicy(shape, rank, needed if memory_cap is None else memory_cap, name, order)


def _make_greedy(name: str, shape: PipelineShape, rank: int, memory_cap: Optional[int]) -> GreedyPolicy:
    if memory_cap is None:
        memory_cap = megatron_interleaved_cap(shape, rank)
    check_memory_cap(shape, memory_cap)
    if name == "dfc":
        priority = _depth_first(shape.num_chunks)
    else:
        priority = _breadth_first(shape.num_chunks, shape.microbatch_group_size)
    return GreedyPolicy(shape, rank, memory_cap, name, priority)


def _make_adaptive(name: str, shape: PipelineShape, rank: int, memory_cap: Optional[int]) -> Policy:
    from .adaptive import make_adaptive   # adaptive.py builds on this module's Policy

    return make_adaptive(shape, rank, memory_cap)


def _make_planned(name: str, shape: PipelineShape, rank: int, memory_cap: Optional[int],
                  memory_factor: Optional[float] = None) -> Policy:
    from .planned import DEFAULT_MEMORY_FACTOR, make_planned   # planned.py builds on adaptive.py

    return make_planned(shape, rank, memory_cap,
                        memory_factor=DEFAULT_MEMORY_FACTOR if memory_factor is None else memory_factor)


_FACTORIES: Dict[str, Callable[..., Policy]] = {
    "dfc": _make_greedy,
    "bfc": _make_greedy,
    "1f1b": _make_static,
    "interleaved": _make_static,
    "adaptive": _make_adaptive,
    "planned": _make_planned,
}


def make_policy(name: str, shape: PipelineShape, rank: int, memory_cap: Optional[int] = None,
                memory_factor: Optional[float] = None) -> Policy:
    """A policy for one rank. memory_cap: most activations held at once; None = what Megatron's order holds.
    memory_factor (planned only): activation bytes a rank may hold, x Megatron's peak for the same microbatches."""
    if name not in _FACTORIES:
        raise ScheduleConfigError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    shape.check_rank(rank)
    if name == "planned":
        return _make_planned(name, shape, rank, memory_cap, memory_factor)
    if memory_factor is not None:
        raise ScheduleConfigError(f"memory_factor applies to policy 'planned' only, not {name!r}")
    return _FACTORIES[name](name, shape, rank, memory_cap)
