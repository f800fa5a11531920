"""Causality check: no forward/backward starts before the task producing its input has ended (the previous
stage's forward, the next stage's backward, and for a backward also its own forward on the same rank)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .dependencies import InputSources, task_key
from .reader import TraceRun
from .schema import COMPUTE_KINDS, TraceEvent


@dataclass(frozen=True)
class Violation:
    iteration: int
    global_rank: int
    pp_rank: int
    task: str            # e.g. "forward 1-3" (chunk-microbatch)
    start_us: float
    producer_pp_rank: int
    producer_task: str
    producer_end_us: float | None  # None: the producer is not in the trace at all

    def describe(self) -> str:
        if self.producer_end_us is None:
            return (f"iteration {self.iteration} rank {self.global_rank} (pp {self.pp_rank}): {self.task} ran but "
                    f"its producer {self.producer_task} on pp {self.producer_pp_rank} is missing")
        early = self.producer_end_us - self.start_us
        return (f"iteration {self.iteration} rank {self.global_rank} (pp {self.pp_rank}): {self.task} started "
                f"{early:.1f} us before its input was ready ({self.producer_task} on pp {self.producer_pp_rank} "
                f"ended at {self.producer_end_us:.1f})")

    def to_dict(self) -> dict:
        return asdict(self) | {"message": self.describe()}


def check_causality(run: TraceRun, iterations: list[int], tolerance_us: float = 0.0) -> list[Violation]:
    """Every violation in the given iterations, per (dp, tp) pipeline replica. `tolerance_us` absorbs clock
    alignment error between hosts."""
    sources = InputSources(run.pipeline_parallel, run.model_chunks, run.microbatches)
    violations = []
    for pipeline in run.pipelines():
        for iteration in iterations:
            compute = [e for stage in pipeline for e in stage.events_of(iteration, COMPUTE_KINDS)]
            by_key = {task_key(e): e for e in compute}
            for event in sorted(compute, key=lambda e: (e.start, e.pp_rank)):
                for producer_key, slack in ((sources.producer_of(event), tolerance_us),
                                            (sources.local_forward_of(event), 0.0)):  # same clock: no slack
                    if producer_key is None:
                        continue
                    producer = by_key.get(producer_key)
                    if producer is not None and event.start + slack >= producer.end:
                        continue
                    violations.append(_violation(iteration, event, producer_key, producer))
    return violations


def _violation(iteration: int, event: TraceEvent, producer_key: tuple, producer: TraceEvent | None) -> Violation:
    peer_pp, peer_kind, peer_chunk, peer_mb = producer_key
    return Violation(iteration=iteration, global_rank=event.rank, pp_rank=event.pp_rank,
                     task=f"{event.kind} {event.label}", start_us=event.start, producer_pp_rank=peer_pp,
                     producer_task=f"{peer_kind} {peer_chunk}-{peer_mb}",
                     producer_end_us=None if producer is None else producer.end)
