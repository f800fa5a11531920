"""Per-rank and per-iteration pipeline metrics of one traced iteration.

Window: from the first forward/backward start to the last forward/backward end over all ranks (the makespan).
Per rank, idle (bubble) time is the part of that window not covered by its own forward/backward work.
Two references for the makespan: `ideal_us`, the busiest rank's compute (no schedule beats it, but it ignores the
pipeline's fill and drain), and `lower_bound_us`, the tighter bound the simulator prints (trace/bounds.py: the
busiest rank's work plus the fill and drain no schedule avoids, on the measured task durations).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .bounds import iteration_lower_bound
from .intervals import interval_deltas, max_concurrency, union_length
from .reader import RankTrace, TraceRun
from .schema import BACKWARD, COMPUTE_KINDS, FORWARD, GC, ITERATION, MEMORY, OPTIMIZER, SEND, WAIT, WEIGHT


@dataclass(frozen=True)
class RankMetrics:
    global_rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    host: str
    tasks: int
    compute_us: float
    forward_us: float
    backward_us: float
    idle_us: float
    bubble_ratio: float
    comm_wait_us: float
    task_gap_us: float | None        # the runtime's mean time between tasks run back to back (its iteration event)
    host_bound_us: float | None      # device-timed tasks whose time was the host's (host_bound_us()); None: host-timed
    gc_us: float | None              # Python's garbage collections in the iteration on this rank (schema 1.7);
    gc_longest_us: float | None      # the longest; None where the rank's file holds no gc event (not recorded)
    peak_memory_mib: float | None    # the rank's peak memory in the iteration (schema 1.8 `memory`); None: not recorded
    optimizer_us: float
    max_sends_in_flight: int
    sent_bytes: int
    peak_activations: int


@dataclass(frozen=True)
class IterationMetrics:
    iteration: int
    microbatches: int                # the microbatches this iteration ran (a composed batch may differ per call)
    start_us: float
    end_us: float
    makespan_us: float
    ideal_us: float                  # the busiest rank's compute
    makespan_over_ideal: float | None  # None when no rank did measurable work
    lower_bound_us: float | None     # the simulator's lower bound on these durations; None when it cannot be told
    makespan_over_lower_bound: float | None
    mean_bubble_ratio: float
    iteration_time_us: float | None  # span of the ranks' 'iteration' events, when they were recorded
    ranks: list[RankMetrics] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def iteration_metrics(run: TraceRun, iteration: int) -> IterationMetrics:
    per_rank = {rank.meta.global_rank: rank.events_of(iteration) for rank in run.ranks}
    compute = [e for events in per_rank.values() for e in events if e.kind in COMPUTE_KINDS]
    if not compute:
        raise ValueError(f"iteration {iteration} has no forward/backward events")
    start = min(e.start for e in compute)
    end = max(e.end for e in compute)
    makespan = end - start
    ranks = [_rank_metrics(rank, per_rank[rank.meta.global_rank], makespan) for rank in run.ranks]
    ideal = max(r.compute_us for r in ranks)
    spans = [e for events in per_rank.values() for e in events if e.kind == ITERATION]
    iteration_time = (max(e.end for e in spans) - min(e.start for e in spans)) if spans else None
    bound = iteration_lower_bound(run, iteration)
    return IterationMetrics(
        iteration=iteration,
        microbatches=run.microbatches_of(iteration),
        start_us=start,
        end_us=end,
        makespan_us=makespan,
        ideal_us=ideal,
        makespan_over_ideal=makespan / ideal if ideal > 0 else None,
        lower_bound_us=bound,
        makespan_over_lower_bound=makespan / bound if bound else None,
        mean_bubble_ratio=sum(r.bubble_ratio for r in ranks) / len(ranks),
        iteration_time_us=iteration_time,
        ranks=ranks,
    )


def _rank_metrics(rank: RankTrace, events: list, makespan: float) -> RankMetrics:
    def spans(kind):
        return [(e.start, e.end) for e in events if e.kind == kind]

    compute = union_length([(e.start, e.end) for e in events if e.kind in COMPUTE_KINDS])
    idle = max(0.0, makespan - compute)
    sends = [e for e in events if e.kind == SEND]
    # Activations held: +1 when a forward starts, -1 when the backward of the same task is done (its W with a split
    # backward: W needs the saved tensors).
    releasing = WEIGHT if any(e.kind == WEIGHT for e in events) else BACKWARD
    activation_deltas = [(e.start, 1) for e in events if e.kind == FORWARD]
    activation_deltas += [(e.end, -1) for e in events if e.kind == releasing]
    meta = rank.meta
    # our training loop records every collection (a few each iteration); a file without any did not record them
    records_gc = GC in rank.kinds()
    return RankMetrics(
        global_rank=meta.global_rank,
        pp_rank=meta.pp_rank,
        tp_rank=meta.tp_rank,
        dp_rank=meta.dp_rank,
        host=meta.host,
        tasks=sum(1 for e in events if e.kind in COMPUTE_KINDS),
        compute_us=compute,
        forward_us=union_length(spans(FORWARD)),
        backward_us=union_length(spans(BACKWARD)),
        idle_us=idle,
        bubble_ratio=idle / makespan if makespan > 0 else 0.0,
        comm_wait_us=union_length(spans(WAIT)),
        task_gap_us=next((e.extra["task_gap_us"] for e in events if e.kind == ITERATION and "task_gap_us" in e.extra),
                         None),
        host_bound_us=host_bound_us(events),
        gc_us=sum(e.duration for e in events if e.kind == GC) if records_gc else None,
        gc_longest_us=max((e.duration for e in events if e.kind == GC), default=0.0) if records_gc else None,
        peak_memory_mib=max((e.extra.get("peak_mib", 0.0) for e in events if e.kind == MEMORY), default=None),
        optimizer_us=union_length(spans(OPTIMIZER)),
        max_sends_in_flight=max_concurrency(interval_deltas((e.start, e.end) for e in sends)),
        sent_bytes=sum(e.nbytes or 0 for e in sends),
        peak_activations=max_concurrency(activation_deltas),
    )


HOST_BOUND_LAG = 0.1   # a device span that ended within this share of itself after the host's was the host's time


def host_span(event) -> tuple[float, float] | None:
    """A device-timed compute event's span as the host ran it (schema 1.7: it began queued_us before the device
    did and took host_us), on the same clock; None for a host-timed one (its span is the host's)."""
    if "host_us" not in event.extra or "queued_us" not in event.extra:
        return None
    start = event.start - event.extra["queued_us"]
    return start, start + event.extra["host_us"]


def host_bound_us(events) -> float | None:
    """The summed spans of the device-timed compute tasks whose device end came within HOST_BOUND_LAG of their span
    after the host's end (host_span): the device had caught up with the host, so it waited for it (launches slower
    than the kernels, or the host busy elsewhere inside the task). A device still working through earlier work then
    is not counted, however long the host took. None when no task was device-timed (a CPU run: host and span
    agree)."""
    timed = [(e, host_span(e)) for e in events if e.kind in COMPUTE_KINDS]
    timed = [(e, span) for e, span in timed if span is not None]
    if not timed:
        return None
    return sum(e.duration for e, (_, host_end) in timed if e.end - host_end <= HOST_BOUND_LAG * e.duration)


_ITERATION_COLUMNS = ["iteration", "microbatches", "makespan_us", "ideal_us", "makespan_over_ideal", "lower_bound_us",
                      "makespan_over_lower_bound", "iteration_time_us"]
CSV_COLUMNS = (
    _ITERATION_COLUMNS
    + [f for f in RankMetrics.__dataclass_fields__]
)


def csv_rows(all_metrics: list[IterationMetrics]) -> list[dict]:
    """One row per (iteration, rank), run-level columns repeated, in CSV_COLUMNS order."""
    rows = []
    for it in all_metrics:
        for rank in it.ranks:
            row = {name: getattr(it, name) for name in _ITERATION_COLUMNS}
            row.update(asdict(rank))
            rows.append({k: row[k] for k in CSV_COLUMNS})
    return rows
