"""PipelineShape: P stages x V model chunks x m microbatches, its validation and the dependency graph between ranks.

Virtual stage vs = chunk * P + rank. The forward of a microbatch walks vs = 0 .. V*P-1 (wrapping from rank P-1 back
to rank 0 at each chunk boundary); its backward walks the same stages in reverse. With split_backward, each backward is the input-gradient task B (on
that path) and a weight-gradient task W of the same chunk and microbatch, which depends only on its own rank's B.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .errors import LastMicrobatchGroupError, MicrobatchGroupError, ScheduleConfigError
from .tasks import Kind, Task


def _require_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleConfigError(f"{name} must be an int, got {value!r}")


def check_microbatch_groups(num_stages: int, num_microbatches: int, group_size: int) -> None:
    """Megatron-Core's two rules for interleaved microbatch groups, in its order: the group size lies in
    [num_stages, num_microbatches] (MicrobatchGroupError), and the last group is empty or >= num_stages
    (LastMicrobatchGroupError)."""
    P, m, N = num_stages, num_microbatches, group_size
    if not P <= N <= m:
        raise MicrobatchGroupError(
            f"microbatch_group_size={N} must lie in [num_stages={P}, num_microbatches={m}] "
            f"when num_chunks > 1 (Megatron-Core's interleaved schedule rule)")
    last_group = m % N
    if 0 < last_group < P:
        raise LastMicrobatchGroupError(
            f"num_microbatches={m} leaves a last group of {last_group} microbatches "
            f"(num_microbatches % microbatch_group_size={N}); Megatron-Core's interleaved schedule needs it "
            f"to be 0 or >= num_stages={P}")


@dataclass(frozen=True)
class PipelineShape:
    num_stages: int
    num_chunks: int
    num_microbatches: int
    forward_only: bool = False
    # Megatron's config.microbatch_group_size_per_vp_stage; None means Megatron's default, num_stages.
    microbatch_group_size: Optional[int] = None
    # Each backward runs as B (input gradient, sent upstream at once) and a later W (weight gradient, local).
    split_backward: bool = False

    def __post_init__(self):
        for name in ("num_stages", "num_chunks", "num_microbatches"):
            _require_int(name, getattr(self, name))
            if getattr(self, name) < 1:
                raise ScheduleConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.forward_only, bool):
            raise ScheduleConfigError(f"forward_only must be a bool, got {self.forward_only!r}")
        if not isinstance(self.split_backward, bool):
            raise ScheduleConfigError(f"split_backward must be a bool, got {self.split_backward!r}")
        if self.split_backward and self.forward_only:
            raise ScheduleConfigError("split_backward needs backwards: a forward-only shape has none")
        defaulted = self.microbatch_group_size is None
        if defaulted:
            object.__setattr__(self, "microbatch_group_size", self.num_stages)
        else:
            _require_int("microbatch_group_size", self.microbatch_group_size)
            if self.microbatch_group_size < 1:
                raise ScheduleConfigError(
                    f"microbatch_group_size must be >= 1, got {self.microbatch_group_size}")
        if self.num_chunks > 1:
            self._check_interleaving(defaulted)

    def _check_interleaving(self, group_size_defaulted: bool) -> None:
        """The rules megatron-core 0.16 enforces for interleaved pipelining (parallel_state and schedules.py)."""
        P, m, N = self.num_stages, self.num_microbatches, self.microbatch_group_size
        if P == 1:
            raise ScheduleConfigError(
                f"num_chunks={self.num_chunks} needs num_stages > 1: Megatron-Core's interleaved schedule "
                f"requires a pipeline-model-parallel size greater than 1")
        if group_size_defaulted and m < P:
            raise MicrobatchGroupError(
                f"num_microbatches={m} must be >= num_stages={P} when num_chunks > 1 "
                f"(Megatron-Core's interleaved schedule rule)")
        check_microbatch_groups(P, m, N)

    # ---- geometry --------------------------------------------------------------------------------------------
    @property
    def num_virtual_stages(self) -> int:
        return self.num_chunks * self.num_stages

    def check_rank(self, rank: int) -> None:
        _require_int("rank", rank)
        if not 0 <= rank < self.num_stages:
            raise ScheduleConfigError(f"rank {rank} is outside 0..{self.num_stages - 1}")

    def check_task(self, task: Task) -> None:
        if not isinstance(task, Task) or not isinstance(task.kind, Kind):
            raise ScheduleConfigError(f"expected a Task, got {task!r}")
        if not 0 <= task.chunk < self.num_chunks:
            raise ScheduleConfigError(f"{task}: chunk outside 0..{self.num_chunks - 1}")
        if not 0 <= task.microbatch < self.num_microbatches:
            raise ScheduleConfigError(f"{task}: microbatch outside 0..{self.num_microbatches - 1}")
        if self.forward_only and task.kind is not Kind.FORWARD:
            raise ScheduleConfigError(f"{task}: a forward-only shape has no backward tasks")
        if task.kind is Kind.WEIGHT and not self.split_backward:
            raise ScheduleConfigError(f"{task}: weight-gradient tasks need split_backward")

    def virtual_stage(self, rank: int, chunk: int) -> int:
        self.check_rank(rank)
        if not 0 <= chunk < self.num_chunks:
            raise ScheduleConfigError(f"chunk {chunk} is outside 0..{self.num_chunks - 1}")
        return chunk * self.num_stages + rank

    def _locate(self, virtual_stage: int) -> Tuple[int, int]:
        """(rank, chunk) that holds a virtual stage."""
        return virtual_stage % self.num_stages, virtual_stage // self.num_stages

    @property
    def kinds(self) -> Tuple[Kind, ...]:
        """The task kinds this shape runs."""
        if self.forward_only:
            return (Kind.FORWARD,)
        return (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT) if self.split_backward else (Kind.FORWARD, Kind.BACKWARD)

    @functools.cached_property
    def fill_kinds(self) -> Tuple[Kind, ...]:
        """Kinds whose tasks neither receive from nor send to another rank (W): work a policy places in idle time,
        after their local source, never planned in Megatron's forward/backward skeleton."""
        return tuple(kind for kind in self.kinds if kind not in (Kind.FORWARD, Kind.BACKWARD))

    @property
    def releasing_kind(self) -> Kind:
        """The task whose end frees a chunk's activation: its forward (forward_only), backward, or W when split."""
        if self.forward_only:
            return Kind.FORWARD
        return Kind.WEIGHT if self.split_backward else Kind.BACKWARD

    def tasks(self, rank: int) -> List[Task]:
        """Every task of `rank`: all forwards, then (unless forward_only) all backwards, then (split) all W's."""
        self.check_rank(rank)
        kinds = self.kinds
        return [Task(kind, chunk, mb)
                for kind in kinds
                for chunk in range(self.num_chunks)
                for mb in range(self.num_microbatches)]

    # ---- dependencies between ranks ------------------------------------------------------------------------
    def input_source(self, rank: int, task: Task) -> Optional[Tuple[int, Task]]:
        """(peer rank, peer task) whose output `task` consumes; None when its input is data (first virtual stage's
        forward), the locally computed loss (last virtual stage's backward) or local (a W needs only its own B)."""
        self.check_task(task)
        if task.kind is Kind.WEIGHT:
            return None
        vs = self.virtual_stage(rank, task.chunk)
        if task.kind is Kind.FORWARD:
            if vs == 0:
                return None
            peer_rank, peer_chunk = self._locate(vs - 1)
        else:
            if vs == self.num_virtual_stages - 1:
                return None
            peer_rank, peer_chunk = self._locate(vs + 1)
        return peer_rank, Task(task.kind, peer_chunk, task.microbatch)

    def local_source(self, task: Task) -> Optional[Task]:
        """The task on the same rank whose output `task` also needs: a backward its own forward (the activations),
        a W its own B; None for a forward."""
        self.check_task(task)
        if task.kind is Kind.BACKWARD:
            return Task(Kind.FORWARD, task.chunk, task.microbatch)
        if task.kind is Kind.WEIGHT:
            return Task(Kind.BACKWARD, task.chunk, task.microbatch)
        return None

    def output_target(self, rank: int, task: Task) -> Optional[Tuple[int, Task]]:
        """(peer rank, peer task) that consumes `task`'s output; None for the last forward, the first backward and
        every W (weight gradients stay on their rank)."""
        self.check_task(task)
        if task.kind is Kind.WEIGHT:
            return None
        vs = self.virtual_stage(rank, task.chunk)
        if task.kind is Kind.FORWARD:
            if vs == self.num_virtual_stages - 1:
                return None
            peer_rank, peer_chunk = self._locate(vs + 1)
        else:
            if vs == 0:
                return None
            peer_rank, peer_chunk = self._locate(vs - 1)
        return peer_rank, Task(task.kind, peer_chunk, task.microbatch)
