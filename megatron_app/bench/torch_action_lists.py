"""The per-rank action lists of one of torch.distributed.pipelining's multi-stage schedules, as megatron_app's
runtime runs them (--schedule-file; schedule/action_lists.py), so that torch's order and ours compare runtime against
runtime; main is tools/torch_schedule_csv.py, which writes them as a CSV.

torch computes every rank's list in each process (a schedule's pipeline_order); this builds the schedule for
rank 0 with stand-in stages that carry only what the order needs (no process group, no model). Only schedules with
torch's loop placement (stage s on rank s % P, as Megatron interleaves) are offered.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Dict, List

# tools/torch_schedule_csv.py's --help (its docstring's first line)
TOOL_DESCRIPTION = ("Write the per-rank action lists of one of torch.distributed.pipelining's multi-stage schedules "
                    "as a CSV that")
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torch_schedule_csv.py", description=TOOL_DESCRIPTION)
    parser.add_argument("--schedule", choices=SCHEDULES, default="InterleavedZeroBubble")
    parser.add_argument("--pipeline_parallel", "--pipeline-parallel", "-P", type=int, required=True)
    parser.add_argument("--model_chunks", "--model-chunks", "-V", type=int, default=2)
    parser.add_argument("--microbatches", "-m", type=int, required=True)
    parser.add_argument("--out", required=True, help="the CSV to write (one row per pipeline rank)")
    opts = parser.parse_args(argv)
    if opts.pipeline_parallel < 2 or opts.model_chunks < 1 or opts.microbatches < 1:
        parser.error("need -P >= 2, -V >= 1 and -m >= 1")
    try:
        rows = action_lists(opts.schedule, opts.pipeline_parallel, opts.model_chunks, opts.microbatches)
    except (ValueError, RuntimeError, AssertionError) as error:
        print(f"torch_schedule_csv.py: error: torch's Schedule{opts.schedule} refuses P={opts.pipeline_parallel} "
              f"V={opts.model_chunks} m={opts.microbatches}: {str(error).splitlines()[0] if str(error) else error!r}",
              file=sys.stderr)
        return 2
    out = Path(opts.out)
    partial = out.with_name(out.name + ".partial")
    with open(partial, "w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    partial.replace(out)
    print(f"wrote {out}: torch Schedule{opts.schedule}, P={opts.pipeline_parallel} V={opts.model_chunks} "
          f"m={opts.microbatches}, {sum(1 for row in rows for a in row if a)} actions")
    return 0

