"""Which message carries which task's input: (peer, tag) keys for one rank and one forward_backward call."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron_app.schedule import Kind, PipelineShape, Task

Key = Tuple[int, int]  # (peer global rank, tag)


def direction_of(task: Task):
    from megatron_app.transport import Direction

    return Direction.FORWARD if task.kind == Kind.FORWARD else Direction.BACKWARD


class PipelineLinks:
    """Maps the schedule's tasks to transport keys for one pipeline rank.

    A message is tagged with the task that *consumes* it, so the receiver can name what it waits for and the sender
    derives the same tag from `output_target`. The call counter goes into the tag so that two forward_backward
    calls (a training step and an evaluation, say) never mix their messages.
    """

    def __init__(self, shape: PipelineShape, pp_rank: int, pp_global_ranks: List[int], call_index: int):
        from megatron_app.transport import make_tag

        self.shape = shape
        self.pp_rank = pp_rank
        self._global = pp_global_ranks
        self._call = call_index % (1 << 28)  # the tag field width; neighbouring calls still differ
        self._make_tag = make_tag
        self.expected: Dict[Key, Task] = {}
        for task in shape.tasks(pp_rank):
            source = shape.input_source(pp_rank, task)
            if source is not None:
                self.expected[self.key_for(task, source[0])] = task

    def tag_for(self, consumer: Task) -> int:
        vmb = consumer.chunk * self.shape.num_microbatches + consumer.microbatch
        return self._make_tag(direction_of(consumer), vmb, iteration=self._call)

    def key_for(self, consumer: Task, peer_pp_rank: int) -> Key:
        return (self._global[peer_pp_rank], self.tag_for(consumer))

    def input_key(self, task: Task) -> Optional[Key]:
        """The key of `task`'s remote input, or None when the input is local (data or loss)."""
        source = self.shape.input_source(self.pp_rank, task)
        if source is None:
            return None
        return self.key_for(task, source[0])

    def output_route(self, task: Task) -> Optional[Tuple[int, Task]]:
        """(peer pp rank, consumer task) for `task`'s output, or None when nothing is sent."""
        return self.shape.output_target(self.pp_rank, task)

    def global_rank(self, pp_rank: int) -> int:
        return self._global[pp_rank]
