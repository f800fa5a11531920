"""A traced iteration's task durations and its lower bound: the schedule package's bound (schedule/bounds.py, the
one the simulator prints) on the durations the trace measured, so process_trace.py and the simulator agree on the
bound of the same run.

The fastest stage-to-stage transfer counts once per hop when the trace's header says it (`extra.min_transfer_us`,
written by the simulator); otherwise transfers count as free, which keeps the bound a bound.
"""

from __future__ import annotations

from megatron_app.schedule import KIND_OF_TRACE_NAME, KINDS_BY_INDEX, Kind, PipelineShape, ScheduleConfigError
from megatron_app.schedule.bounds import lower_bounds

from .reader import RankTrace, TraceRun
from .schema import COMPUTE_KINDS, WEIGHT

MIN_TRANSFER_KEY = "min_transfer_us"


def pipeline_microbatches(pipeline: list[RankTrace], iteration: int) -> int:
    """Microbatches one pipeline replica ran in `iteration` (0 when it ran none)."""
    seen = [e.microbatch for stage in pipeline for e in stage.events_of(iteration, COMPUTE_KINDS)]
    return max(seen) + 1 if seen else 0


def pipeline_shape(pipeline: list[RankTrace], iteration: int, model_chunks: int) -> PipelineShape:
    """The pipeline one replica ran in `iteration`: its microbatch count, split backward when it has W events."""
    split = any(True for stage in pipeline for _ in stage.events_of(iteration, [WEIGHT]))
    return PipelineShape(len(pipeline), model_chunks, pipeline_microbatches(pipeline, iteration),
                         split_backward=split)


def pipeline_durations(pipeline: list[RankTrace], iteration: int, model_chunks: int) -> list:
    """(stages, kinds, chunks, microbatches) task durations in us of one replica's `iteration`, kinds indexed by
    Kind.index (W all 0 without a split backward); ValueError when a task has no event or more than one."""
    m = pipeline_microbatches(pipeline, iteration)
    table = [[[[None] * m for _ in range(model_chunks)] for _ in KINDS_BY_INDEX] for _ in pipeline]
    for r, stage in enumerate(pipeline):
        for event in stage.events_of(iteration, COMPUTE_KINDS):
            cell = table[r][KIND_OF_TRACE_NAME[event.kind].index][event.chunk]
            if cell[event.microbatch] is not None:
                raise ValueError(f"iteration {iteration}: two {event.kind} events for chunk {event.chunk} microbatch "
                                 f"{event.microbatch} on pipeline rank {r}")
            cell[event.microbatch] = event.duration
    for r, per_kind in enumerate(table):
        for kind, per_chunk in zip(KINDS_BY_INDEX, per_kind):
            if kind is Kind.WEIGHT and all(cell is None for row in per_chunk for cell in row):
                per_kind[kind.index] = [[0.0] * m for _ in range(model_chunks)]   # a whole backward: no W events
                continue
            for c, row in enumerate(per_chunk):
                if None in row:
                    raise ValueError(f"iteration {iteration}: pipeline rank {r} has no {kind.trace_name} event for "
                                     f"chunk {c} microbatch {row.index(None)}")
    return table


def min_transfer_us(run: TraceRun) -> float:
    value = run.ranks[0].meta.extra.get(MIN_TRANSFER_KEY, 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0.0


def iteration_lower_bound(run: TraceRun, iteration: int) -> float | None:
    """The tightest lower bound on `iteration`'s makespan over every (data, tensor)-parallel replica, in us; None
    when a replica's tasks are not one event each (the bound needs every task's duration)."""
    transfer = min_transfer_us(run)
    best = None
    for pipeline in run.pipelines():
        if pipeline_microbatches(pipeline, iteration) == 0:
            continue
        try:
            shape = pipeline_shape(pipeline, iteration, run.model_chunks)
            bound = lower_bounds(shape, pipeline_durations(pipeline, iteration, run.model_chunks), transfer).best_us
        except (ValueError, ScheduleConfigError):
            return None
        best = bound if best is None else max(best, bound)
    return best
