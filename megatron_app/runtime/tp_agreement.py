"""All tensor-parallel ranks of a pipeline stage must run the same task sequence.

The first TP rank of the stage decides and broadcasts its pick (one 3-int broadcast per task); the others follow
and block on that task's input. Arrivals differ by microseconds between TP ranks (their peers send in lock-step),
so following costs little, and there is no back-and-forth that could livelock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_app.schedule import KINDS_BY_INDEX, Task

from megatron_app.devices import collective_device

_KINDS = KINDS_BY_INDEX


class TaskAgreement:
    def __init__(self, tp_group):
        self.group = tp_group
        self.size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.leader = None if self.size == 1 else dist.get_global_rank(tp_group, 0)
        self.is_leader = self.size == 1 or dist.get_rank() == self.leader
        device = collective_device(tp_group) if self.size > 1 else torch.device("cpu")
        self._buffer = torch.zeros(3, dtype=torch.int64, device=device)

    @property
    def active(self) -> bool:
        return self.size > 1

    def share(self, task: Task) -> None:
        """Leader: tell the followers which task runs next."""
        self._buffer[0] = _KINDS.index(task.kind)
        self._buffer[1] = task.chunk
        self._buffer[2] = task.microbatch
        dist.broadcast(self._buffer, src=self.leader, group=self.group)

    def follow(self) -> Task:
        """Follower: block until the leader's next task is known."""
        dist.broadcast(self._buffer, src=self.leader, group=self.group)
        kind, chunk, microbatch = (int(x) for x in self._buffer.tolist())
        return Task(_KINDS[kind], chunk, microbatch)

