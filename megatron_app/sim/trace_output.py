"""Writes a simulated run in the trace format (docs/trace_schema.md) through megatron_app.trace.Tracer: one file per
rank, source 'sim', times in simulated microseconds (clock offset 0), so tools/process_trace.py and
tools/visualize_trace.py read it like a real run.

Event mapping: forward/backward = the task's span; recv = an instant when a task takes its remote input; send =
posted (the producer's finish) to arrival at the consumer; wait = a rank idle while its policy has nothing ready;
iteration = from the iteration's start to this rank's last task. The engine counts iterations from 0; the trace from
FIRST_ITERATION (1), as the trainer's log and its traces do.
"""

from __future__ import annotations

import os
from typing import List

from megatron_app.schedule import Kind, PipelineShape, Task
from megatron_app.trace import TraceMeta, Tracer
from megatron_app.trace.schema import FIRST_ITERATION

_DIRECTION = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward"}   # what a task's output carries downstream


class SimTrace:
    def __init__(self, trace_dir: str | os.PathLike, shape: PipelineShape, policy: str, tensor_bytes: int,
                 run_id: str, extra: dict):
        self.shape = shape
        self.tensor_bytes = tensor_bytes
        self.tracers: List[Tracer] = []
        try:
            for rank in range(shape.num_stages):
                meta = TraceMeta(global_rank=rank, pp_rank=rank, pipeline_parallel=shape.num_stages,
                                 model_chunks=shape.num_chunks, microbatches=shape.num_microbatches, policy=policy,
                                 host="sim", source="sim", clock_offset_us=0.0, tensor_parallel=1,
                                 data_parallel=1, run_id=run_id, extra=dict(extra))
                self.tracers.append(Tracer(trace_dir, meta))
        except BaseException:
            self.close()
            raise

    def compute(self, rank: int, iteration: int, task: Task, start_us: float, end_us: float) -> None:
        iteration += FIRST_ITERATION
        tracer = self.tracers[rank]
        source = self.shape.input_source(rank, task)
        if source is not None:
            tracer.record("recv", start_us, start_us, iteration=iteration, chunk=task.chunk,
                          microbatch=task.microbatch, peer=source[0], nbytes=self.tensor_bytes)
        tracer.record(task.kind.trace_name, start_us, end_us, iteration=iteration, chunk=task.chunk,
                      microbatch=task.microbatch)

    def send(self, rank: int, iteration: int, task: Task, peer: int, posted_us: float, arrival_us: float) -> None:
        self.tracers[rank].record("send", posted_us, arrival_us, iteration=iteration + FIRST_ITERATION,
                                  chunk=task.chunk, microbatch=task.microbatch, peer=peer, nbytes=self.tensor_bytes,
                                  direction=_DIRECTION[task.kind])

    def wait(self, rank: int, iteration: int, start_us: float, end_us: float) -> None:
        self.tracers[rank].record("wait", start_us, end_us, iteration=iteration + FIRST_ITERATION)

    def iteration(self, rank: int, iteration: int, start_us: float, end_us: float) -> None:
        self.tracers[rank].record("iteration", start_us, end_us, iteration=iteration + FIRST_ITERATION)
        self.tracers[rank].flush()

    def close(self) -> None:
        for tracer in self.tracers:
            tracer.close()

    def __enter__(self) -> "SimTrace":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
