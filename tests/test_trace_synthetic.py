"""Synthetic pipeline traces for the trace tests, written through the Tracer API, plus checks of the generator.

plan_greedy() lays out a valid schedule in time with a non-delay greedy list scheduler (backward first, then the
lowest microbatch): given P, V, m and per-task durations it places every forward/backward, the sends between ranks,
the waits for input, an optimizer step and the iteration span. The dependency rule is written here on its own
(virtual stage = chunk * P + rank) so it also cross-checks megatron_app.schedule's rule.
write_plan() writes the plan as per-rank trace files. Tests may edit a plan before writing it (doctored traces).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import pytest

from megatron_app.trace import TraceMeta, Tracer

F, B = "forward", "backward"


@dataclass
class PlannedEvent:
    rank: int
    kind: str
    start: float
    end: float
    iteration: int
    chunk: int | None = None
    microbatch: int | None = None
    peer: int | None = None
    nbytes: int | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class Plan:
    P: int
    V: int
    m: int
    policy: str
    events: list[PlannedEvent]

    def task(self, iteration: int, rank: int, kind: str, chunk: int, microbatch: int) -> PlannedEvent:
        (found,) = [e for e in self.events if (e.iteration, e.rank, e.kind, e.chunk, e.microbatch)
                    == (iteration, rank, kind, chunk, microbatch)]
        return found

    def of(self, iteration: int, rank: int, kinds=(F, B)) -> list[PlannedEvent]:
        return sorted((e for e in self.events if e.iteration == iteration and e.rank == rank and e.kind in kinds),
                      key=lambda e: e.start)


def producer(P: int, V: int, rank: int, kind: str, chunk: int, mb: int):
    """(rank, kind, chunk, mb) whose output this task needs; the last stage's backward needs its own forward."""
    stage = chunk * P + rank
    if kind == F:
        return None if stage == 0 else ((stage - 1) % P, F, (stage - 1) // P, mb)
    if stage == V * P - 1:
        return (rank, F, chunk, mb)
    return ((stage + 1) % P, B, (stage + 1) // P, mb)


def plan_greedy(P: int, V: int, m: int, *, forward_us: float = 10.0, backward_us: float = 20.0,
                duration: Callable[[int, str, int, int], float] | None = None, latency_us: float = 0.0,
                iterations: int = 1, optimizer_us: float = 0.0, nbytes: int = 4096, start_us: float = 1000.0,
                iteration_offset: int = 0) -> Plan:
    def task_duration(rank, kind, chunk, mb):
        if duration is not None:
            return duration(rank, kind, chunk, mb)
        return forward_us if kind == F else backward_us

    events: list[PlannedEvent] = []
    base = start_us
    for it in range(iteration_offset, iteration_offset + iterations):
        done: dict[tuple, float] = {}  # task -> end time
        todo = {r: [(k, c, i) for k in (F, B) for c in range(V) for i in range(m)] for r in range(P)}
        free_at = {r: base for r in range(P)}
        while any(todo.values()):
            best = None
            for rank, tasks in todo.items():
                for kind, chunk, mb in tasks:
                    source = producer(P, V, rank, kind, chunk, mb)
                    if source is not None and source not in done:
                        continue
                    ready = base if source is None else done[source] + (latency_us if source[0] != rank else 0.0)
                    start = max(ready, free_at[rank])
                    key = (start, kind != B, mb, chunk if kind == F else -chunk, rank)
                    if best is None or key < best[0]:
                        best = (key, rank, kind, chunk, mb, source)
            (start, *_), rank, kind, chunk, mb, source = best
            end = start + task_duration(rank, kind, chunk, mb)
            if start > free_at[rank]:
                events.append(PlannedEvent(rank, "wait", free_at[rank], start, it))
            if source is not None and source[0] != rank:
                events.append(PlannedEvent(rank, "recv", start, start, it, chunk, mb, peer=source[0]))
            events.append(PlannedEvent(rank, kind, start, end, it, chunk, mb))
            consumer_rank = _consumer_rank(P, V, rank, kind, chunk)
            if consumer_rank is not None and consumer_rank != rank:
                events.append(PlannedEvent(rank, "send", end, end + latency_us, it, chunk, mb, peer=consumer_rank,
                                           nbytes=nbytes, extra={"direction": kind}))
            done[(rank, kind, chunk, mb)] = end
            free_at[rank] = end
            todo[rank].remove((kind, chunk, mb))
        step_start = max(done.values())
        for rank in range(P):
            events.append(PlannedEvent(rank, "optimizer", step_start, step_start + optimizer_us, it))
            events.append(PlannedEvent(rank, "iteration", base, step_start + optimizer_us, it))
        base = step_start + optimizer_us + 5.0
    return Plan(P, V, m, "greedy-backward-first", events)


def _consumer_rank(P: int, V: int, rank: int, kind: str, chunk: int) -> int | None:
    stage = chunk * P + rank
    if kind == F:
        return None if stage == V * P - 1 else (stage + 1) % P
    return None if stage == 0 else (stage - 1) % P


def write_plan(trace_dir: Path, plan: Plan, *, ranks=None, **meta_overrides) -> Path:
    """Write one trace_rank<r>.jsonl per pipeline rank (global rank = pipeline rank) through the Tracer."""
    for rank in range(plan.P) if ranks is None else ranks:
        meta = TraceMeta(global_rank=rank, pp_rank=rank, pipeline_parallel=plan.P, model_chunks=plan.V,
                         microbatches=plan.m, policy=plan.policy, host="synthetic", source="sim")
        meta = replace(meta, **meta_overrides)
        with Tracer(trace_dir, meta) as tracer:
            for e in sorted((e for e in plan.events if e.rank == rank), key=lambda e: (e.iteration, e.start)):
                tracer.record(e.kind, e.start, e.end, iteration=e.iteration, chunk=e.chunk, microbatch=e.microbatch,
                              peer=e.peer, nbytes=e.nbytes, **e.extra)
    return Path(trace_dir)


# ---- checks of the generator itself --------------------------------------------------------------------------

@pytest.mark.parametrize("P,V,m", [(1, 1, 3), (2, 1, 4), (4, 2, 8), (3, 3, 3)])
def test_plan_runs_every_task_once_without_overlap_and_respects_dependencies(P, V, m):
    plan = plan_greedy(P, V, m, duration=lambda r, k, c, i: 5.0 + r + 2 * c + (i % 3), latency_us=1.5)
    for rank in range(P):
        tasks = plan.of(0, rank)
        assert sorted((e.kind, e.chunk, e.microbatch) for e in tasks) == sorted(
            (k, c, i) for k in (F, B) for c in range(V) for i in range(m))
        assert all(a.end <= b.start for a, b in zip(tasks, tasks[1:]))
        for e in tasks:
            source = producer(P, V, rank, e.kind, e.chunk, e.microbatch)
            if source is not None:
                latency = 1.5 if source[0] != rank else 0.0
                assert e.start >= plan.task(0, *source).end + latency


def test_plan_two_stage_one_f_one_b_times_by_hand():
    plan = plan_greedy(2, 1, 2, forward_us=10, backward_us=20, start_us=0.0)
    got = {(e.rank, e.kind, e.microbatch): (e.start, e.end) for e in plan.events if e.kind in (F, B)}
    assert got == {
        (0, F, 0): (0, 10), (0, F, 1): (10, 20), (1, F, 0): (10, 20), (1, B, 0): (20, 40),
        (0, B, 0): (40, 60), (1, F, 1): (40, 50), (1, B, 1): (50, 70), (0, B, 1): (70, 90),
    }


def test_plan_matches_schedule_package_dependency_rule():
    from megatron_app.schedule import Kind, PipelineShape, Task

    P, V, m = 4, 2, 4
    shape = PipelineShape(num_stages=P, num_chunks=V, num_microbatches=m)
    kinds = {F: Kind.FORWARD, B: Kind.BACKWARD}
    for rank in range(P):
        for kind in (F, B):
            for chunk in range(V):
                source = shape.input_source(rank, Task(kinds[kind], chunk, 1))
                mine = producer(P, V, rank, kind, chunk, 1)
                if source is None:  # the schedule rule leaves out the local forward -> backward edge
                    assert mine is None or mine == (rank, F, chunk, 1)
                else:
                    peer_rank, peer = source
                    assert (peer_rank, peer.kind, peer.chunk, peer.microbatch) == (mine[0], kinds[mine[1]],
                                                                                  mine[2], mine[3])
