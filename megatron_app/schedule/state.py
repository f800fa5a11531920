"""RankState: what one pipeline rank has received, started and finished, and which of its tasks may run now.

The driver (runtime or simulator) reports events; policies only read. Readiness follows the shape's rules: a task is
ready when its remote input is here (shape.input_source; or it needs none) and its local source is done here
(shape.local_source: a backward needs this rank's own forward, a W its own B). A chunk's activation is held from its
forward's start until its backward ends, or its W ends when the backward is split (W needs the saved tensors).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Set

from .errors import ScheduleStateError
from .shape import PipelineShape
from .tasks import Kind, Task


def _task_order(task: Task):
    return task.microbatch, task.chunk, task.kind.value


class RankState:
    def __init__(self, shape: PipelineShape, rank: int, activation_sizes: Optional[Sequence[float]] = None):
        """activation_sizes: one chunk's activation size per microbatch (e.g. bytes, proportional to its tokens),
        tracked as held_size / peak_size; None counts every activation as 1."""
        shape.check_rank(rank)
        if activation_sizes is not None:
            activation_sizes = tuple(activation_sizes)
            if len(activation_sizes) != shape.num_microbatches or not all(s > 0 for s in activation_sizes):
                raise ScheduleStateError(f"activation_sizes must be {shape.num_microbatches} positive numbers, got "
                                         f"{list(activation_sizes)!r}")
        self.activation_sizes = activation_sizes
        self.shape = shape
        self.rank = rank
        self._total = len(shape.tasks(rank))
        self._arrived: Set[Task] = set()
        self._ready: Set[Task] = set()
        self._started: Set[Task] = set()
        self._done: Set[Task] = set()
        self._done_list: List[Task] = []
        m = shape.num_microbatches
        self._forwards_started = [0] * m        # per microbatch
        self._held_by_microbatch = [0] * m
        self._backwards_done = [0] * m
        self._in_flight: Set[int] = set()      # microbatches with activations held or forwards still to come here
        self._lowest_unstarted = 0
        self._held = 0
        self._peak = 0
        self._held_size = 0
        self._peak_size = 0
        # The shape's local rules, resolved once per kind: which kind a finished task may make ready on this rank,
        # which kind each kind waits for here, and which kind's end frees an activation.
        self._local_source_kind = {}
        for kind in shape.kinds:
            source = shape.local_source(Task(kind, 0, 0))
            if source is not None:
                self._local_source_kind[kind] = source.kind
        self._local_successor_kind = {source: kind for kind, source in self._local_source_kind.items()}
        self._releasing_kind = shape.releasing_kind
        for task in shape.tasks(rank):
            if task.kind not in self._local_source_kind and shape.input_source(rank, task) is None:
                self._ready.add(task)

    # ---- events from the driver ------------------------------------------------------------------------------
    def mark_arrived(self, task: Task) -> None:
        """The remote input of `task` (activation for F, output gradient for B) is here."""
        if self.shape.input_source(self.rank, task) is None:
            raise ScheduleStateError(f"rank {self.rank}: {task} takes no remote input, so nothing can arrive for it")
        if task in self._arrived:
            raise ScheduleStateError(f"rank {self.rank}: input of {task} arrived twice")
        self._arrived.add(task)
        if self._deps_met(task):
            self._ready.add(task)

    def mark_started(self, task: Task) -> None:
        if task not in self._ready:
            why = "already started" if task in self._started else "not ready"
            raise ScheduleStateError(f"rank {self.rank}: cannot start {task}: {why}")
        self._ready.discard(task)
        self._started.add(task)
        if task.kind is Kind.FORWARD:
            mb = task.microbatch
            self._forwards_started[mb] += 1
            self._held_by_microbatch[mb] += 1
            self._in_flight.add(mb)
            self._held += 1
            self._peak = max(self._peak, self._held)
            self._held_size += self.size_of(mb)
            self._peak_size = max(self._peak_size, self._held_size)
            while (self._lowest_unstarted < self.shape.num_microbatches
                   and self._forwards_started[self._lowest_unstarted] > 0):
                self._lowest_unstarted += 1

    def mark_done(self, task: Task) -> None:
        if task not in self._started:
            raise ScheduleStateError(f"rank {self.rank}: cannot finish {task}: it was never started")
        if task in self._done:
            raise ScheduleStateError(f"rank {self.rank}: {task} finished twice")
        self._done.add(task)
        self._done_list.append(task)
        mb = task.microbatch
        successor_kind = self._local_successor_kind.get(task.kind)
        if successor_kind is not None:
            successor = Task(successor_kind, task.chunk, mb)
            if self._deps_met(successor):
                self._ready.add(successor)
        if task.kind is self._releasing_kind:
            self._release(mb)
            if self.shape.forward_only:   # evaluation keeps no activation for a backward
                if self._held_by_microbatch[mb] == 0 and self._forwards_started[mb] == self.shape.num_chunks:
                    self._in_flight.discard(mb)
            else:
                self._backwards_done[mb] += 1
                if self._backwards_done[mb] == self.shape.num_chunks:
                    self._in_flight.discard(mb)

    def _release(self, mb: int) -> None:
        self._held_by_microbatch[mb] -= 1
        self._held -= 1
        self._held_size -= self.size_of(mb)

    def _deps_met(self, task: Task) -> bool:
        """Not started, its local source (shape.local_source) done here, its remote input arrived or none needed."""
        if task in self._started:
            return False
        source_kind = self._local_source_kind.get(task.kind)
        if source_kind is not None and Task(source_kind, task.chunk, task.microbatch) not in self._done:
            return False
        return task in self._arrived or self.shape.input_source(self.rank, task) is None

    # ---- queries ---------------------------------------------------------------------------------------------
    def ready(self) -> List[Task]:
        """Tasks not started whose inputs are here and whose local dependencies are met (sorted, deterministic)."""
        return sorted(self._ready, key=_task_order)

    def is_ready(self, task: Task) -> bool:
        return task in self._ready

    def has_arrived(self, task: Task) -> bool:
        return task in self._arrived

    def ready_fill(self) -> List[Task]:
        """Fill tasks (shape.fill_kinds: W) that may run now (their local source is done), oldest microbatch
        first."""
        fill = self.shape.fill_kinds
        return [task for task in self.ready() if task.kind in fill] if fill else []

    @property
    def activations_held(self) -> int:
        """Forwards started whose activations are still kept (until the backward ends, or its W when split;
        forward-only: until the forward ends)."""
        return self._held

    @property
    def peak_activations(self) -> int:
        return self._peak

    def size_of(self, microbatch: int) -> float:
        """One chunk's activation size of `microbatch` (1 without activation_sizes)."""
        return 1 if self.activation_sizes is None else self.activation_sizes[microbatch]

    @property
    def held_size(self) -> float:
        """Sum of the sizes of the activations held now."""
        return self._held_size

    @property
    def peak_size(self) -> float:
        """Largest held_size so far (equals peak_activations without activation_sizes)."""
        return self._peak_size

    @property
    def done_tasks(self) -> List[Task]:
        return list(self._done_list)

    @property
    def started_count(self) -> int:
        return len(self._started)

    @property
    def in_progress(self) -> List[Task]:
        return sorted(self._started - self._done, key=_task_order)

    @property
    def remaining(self) -> int:
        return self._total - len(self._done)

    @property
    def finished(self) -> bool:
        return len(self._done) == self._total

    # ---- per-microbatch bookkeeping for memory admission --------------------------------------------------
    def forwards_started(self, microbatch: int) -> int:
        return self._forwards_started[microbatch]

    def activations_of(self, microbatch: int) -> int:
        return self._held_by_microbatch[microbatch]

    def in_flight_microbatches(self) -> List[int]:
        """Microbatches with a forward started here and a backward (or W) still to do here, ascending."""
        return sorted(self._in_flight)

    @property
    def lowest_unstarted_microbatch(self) -> Optional[int]:
        """The lowest microbatch with no forward started on this rank; None once all have started."""
        if self._lowest_unstarted == self.shape.num_microbatches:
            return None
        return self._lowest_unstarted

    def next_microbatch_to_start(self, start_order: Optional[Sequence[int]] = None) -> Optional[int]:
        """The first microbatch of `start_order` (default ascending) with no forward started here; None when all
        have started."""
        if start_order is None:
            return self.lowest_unstarted_microbatch
        for mb in start_order:
            if self._forwards_started[mb] == 0:
                return mb
        return None

    def describe(self) -> str:
        """Multi-line dump for stall reports."""
        waiting = sorted((t for t in self.shape.tasks(self.rank)
                          if t not in self._started and t not in self._ready), key=_task_order)
        return (f"rank {self.rank}: done {len(self._done)}/{self._total}, held {self._held} "
                f"(peak {self._peak}), in flight mbs {self.in_flight_microbatches()}\n"
                f"  ready: {[str(t) for t in self.ready()]}\n"
                f"  in progress: {[str(t) for t in self.in_progress]}\n"
                f"  blocked (first 8): {[str(t) for t in waiting[:8]]}")
