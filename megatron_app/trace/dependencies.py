"""Which task produced a traced task's input, by the schedule package's dependency rule (one source of truth)."""

from __future__ import annotations

from megatron_app.schedule import KIND_OF_TRACE_NAME, PipelineShape, ScheduleConfigError, Task

from .schema import BACKWARD, FORWARD, WEIGHT, TraceError, TraceEvent

TaskKey = tuple[int, str, int, int]  # (pp_rank, kind, chunk, microbatch)


class InputSources:
    """Maps a forward/backward event on a pipeline rank to the key of the task whose output it consumes."""

    def __init__(self, pipeline_parallel: int, model_chunks: int, microbatches: int) -> None:
        try:
            self._shape = PipelineShape(num_stages=pipeline_parallel, num_chunks=model_chunks,
                                        num_microbatches=microbatches)
        except ScheduleConfigError as exc:
            raise TraceError(f"trace shape P={pipeline_parallel} V={model_chunks} m={microbatches} is not a valid "
                             f"pipeline: {exc}") from None

    def producer(self, pp_rank: int, kind: str, chunk: int, microbatch: int) -> TaskKey | None:
        if kind == WEIGHT:     # a W's input is local: its own B (local_forward_of)
            return None
        source = self._shape.input_source(pp_rank, Task(KIND_OF_TRACE_NAME[kind], chunk, microbatch))
        if source is None:
            return None
        peer_rank, peer_task = source
        return (peer_rank, peer_task.kind.trace_name, peer_task.chunk, peer_task.microbatch)

    def producer_of(self, event: TraceEvent) -> TaskKey | None:
        return self.producer(event.pp_rank, event.kind, event.chunk, event.microbatch)

    @staticmethod
    def local_forward_of(event: TraceEvent) -> TaskKey | None:
        """A backward also needs the activations of its own forward on the same rank; a W needs its own B."""
        if event.kind == WEIGHT:
            return (event.pp_rank, BACKWARD, event.chunk, event.microbatch)
        if event.kind != BACKWARD:
            return None
        return (event.pp_rank, FORWARD, event.chunk, event.microbatch)


def task_key(event: TraceEvent) -> TaskKey:
    return (event.pp_rank, event.kind, event.chunk, event.microbatch)
