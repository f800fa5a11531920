"""The per-rank action lists of one of torch.distributed.pipelining's multi-stage schedules, as megatron_app's
runtime runs them (--schedule-file; schedule/action_lists.py), so that torch's order and ours compare runtime against
runtime (tools/torch_schedule_csv.py writes them as a CSV).

torch computes every rank's list in each process (a schedule's pipeline_order); this builds the schedule for
rank 0 with stand-in stages that carry only what the order needs (no process group, no model). Only schedules with
torch's loop placement (stage s on rank s % P, as Megatron interleaves) are offered.
"""

from __future__ import annotations

from typing import Dict, List

SCHEDULES = ("InterleavedZeroBubble", "Interleaved1F1B", "LoopedBFS")


class _StandInStage:
    """What a multi-stage schedule reads from its stages to compute the order."""

    def __init__(self, pipeline_parallel: int, model_chunks: int, rank: int, chunk: int):
        import torch

        self.group_size, self.group_rank = pipeline_parallel, rank
        self.stage_index = chunk * pipeline_parallel + rank
        self.num_stages = pipeline_parallel * model_chunks
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.num_stages - 1
        self.submod = torch.nn.Identity()
        self.has_backward = True
        self.stage_index_to_group_rank: Dict[int, int] = {}


def action_lists(schedule: str, pipeline_parallel: int, model_chunks: int, microbatches: int) -> List[List[str]]:
    """One list of compute actions per rank ("" for a bubble)."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, f"Schedule{schedule}")
    stages = [_StandInStage(pipeline_parallel, model_chunks, 0, chunk) for chunk in range(model_chunks)]
    built = cls(stages, microbatches, loss_fn=lambda output, target: output)
    order = built.pipeline_order
    return [["" if action is None else str(action) for action in order[rank]] for rank in range(pipeline_parallel)]
