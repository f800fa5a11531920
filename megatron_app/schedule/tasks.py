"""The unit of pipeline work: one forward or backward of one local model chunk for one microbatch; with a split
backward, the backward is the input-gradient task B and a later weight-gradient task W.

TASK_KINDS is the task-kind vocabulary: each Kind's name in trace files and its index in duration tables.
Adding a kind: one Kind member, one TASK_KINDS entry, and its dependency rule in shape.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Dict


class Kind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"    # weight gradients of one chunk for one microbatch (split backward only), after its B

    def __str__(self) -> str:
        return self.value

    @property
    def trace_name(self) -> str:
        """The event kind of this task in trace files ('forward', 'backward', 'weight')."""
        return TASK_KINDS[self].trace_name

    @property
    def index(self) -> int:
        """Position of this kind in per-kind tables (sim.costs.DurationTable)."""
        return TASK_KINDS[self].index


@dataclass(frozen=True)
class TaskKindInfo:
    trace_name: str
    index: int


TASK_KINDS: Dict[Kind, TaskKindInfo] = {
    Kind.FORWARD: TaskKindInfo("forward", 0),
    Kind.BACKWARD: TaskKindInfo("backward", 1),
    Kind.WEIGHT: TaskKindInfo("weight", 2),
}
KIND_OF_TRACE_NAME: Dict[str, Kind] = {info.trace_name: kind for kind, info in TASK_KINDS.items()}
KINDS_BY_INDEX = tuple(sorted(TASK_KINDS, key=lambda kind: TASK_KINDS[kind].index))


@dataclass(frozen=True)
class Task:
    """`chunk` is the local model chunk (0..V-1) on the rank that runs the task, not the virtual stage."""

    kind: Kind
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}(chunk={self.chunk}, mb={self.microbatch})"
