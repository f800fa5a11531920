"""The unit of pipeline work: one forward or backward of one local model chunk for one microbatch."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Task:
    """`chunk` is the local model chunk (0..V-1) on the rank that runs the task, not the virtual stage."""

    kind: Kind
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}(chunk={self.chunk}, mb={self.microbatch})"
