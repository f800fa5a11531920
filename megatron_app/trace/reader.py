"""The one reader every tool uses: loads a trace directory and validates it, naming the file and what is wrong."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .runs import LATEST
from .schema import (BACKWARD, COMPUTE_KINDS, FORWARD, WEIGHT, TraceError, TraceEvent, TraceMeta,
                     check_schema_version, trace_file_name)

_FILE_RE = re.compile(r"^trace_rank(\d+)\.jsonl$")


@dataclass
class RankTrace:
    """One rank's file: its header and events, in file order."""

    path: Path
    schema_version: str
    meta: TraceMeta
    events: list[TraceEvent]
    _by_iteration: dict[int, list[TraceEvent]] | None = field(default=None, init=False, repr=False)
    _kinds: frozenset[str] | None = field(default=None, init=False, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    def by_iteration(self) -> dict[int, list[TraceEvent]]:
        if self._by_iteration is None:
            index: dict[int, list[TraceEvent]] = {}
            for event in self.events:
                index.setdefault(event.iteration, []).append(event)
            self._by_iteration = index
        return self._by_iteration

    def kinds(self) -> frozenset[str]:
        """The event kinds anywhere in this rank's file (what it recorded at all)."""
        if self._kinds is None:
            self._kinds = frozenset(event.kind for event in self.events)
        return self._kinds

    def events_of(self, iteration: int, kinds: Iterable[str] | None = None) -> list[TraceEvent]:
        events = self.by_iteration().get(iteration, [])
        if kinds is None:
            return list(events)
        wanted = frozenset(kinds)
        return [e for e in events if e.kind in wanted]


class TraceRun:
    """All rank files of one run. Ranks are sorted by (dp_rank, pp_rank, tp_rank)."""

    def __init__(self, trace_dir: Path, ranks: list[RankTrace]) -> None:
        self.trace_dir = trace_dir
        self.ranks = sorted(ranks, key=lambda r: (r.meta.dp_rank, r.meta.pp_rank, r.meta.tp_rank))
        first = self.ranks[0].meta
        self.pipeline_parallel = first.pipeline_parallel
        self.model_chunks = first.model_chunks
        self.microbatches = first.microbatches
        self.policy = first.policy
        self.source = first.source
        self.run_id = first.run_id

    def pipeline_view(self) -> list[RankTrace]:
        """One file per pipeline rank (the first data/tensor-parallel replica), pipeline rank 0 first."""
        view: dict[int, RankTrace] = {}
        for rank in self.ranks:
            view.setdefault(rank.meta.pp_rank, rank)
        return [view[p] for p in sorted(view)]

    def pipelines(self) -> list[list[RankTrace]]:
        """Every (dp_rank, tp_rank) replica's stages, each list indexed by pipeline rank."""
        groups: dict[tuple[int, int], dict[int, RankTrace]] = {}
        for rank in self.ranks:
            groups.setdefault((rank.meta.dp_rank, rank.meta.tp_rank), {})[rank.meta.pp_rank] = rank
        return [[stages[p] for p in sorted(stages)] for _, stages in sorted(groups.items())]

    def iterations(self) -> list[int]:
        """Iterations with any forward/backward on any rank."""
        return sorted({k for rank in self.ranks for k, events in rank.by_iteration().items()
                       if any(e.kind in COMPUTE_KINDS for e in events)})

    def microbatches_of(self, iteration: int) -> int:
        """Microbatches `iteration` ran: the meta's count, or more or fewer when the loop composed the global batch
        into another count for that call (runtime/composition.py)."""
        seen = [e.microbatch for rank in self.ranks for e in rank.events_of(iteration, COMPUTE_KINDS)]
        return max(seen) + 1 if seen else self.microbatches

    def incomplete_reason(self, iteration: int) -> str | None:
        """None when every rank ran every forward and backward of `iteration`, else what is missing."""
        expected = self.model_chunks * self.microbatches_of(iteration)
        for rank in self.ranks:
            counts = {FORWARD: 0, BACKWARD: 0, WEIGHT: 0}
            for event in rank.events_of(iteration, COMPUTE_KINDS):
                counts[event.kind] += 1
            for kind, count in counts.items():
                if count != expected and not (kind == WEIGHT and count == 0):   # W's: split backward only
                    return f"{rank.name} has {count} of {expected} {kind} tasks in iteration {iteration}"
        return None

    def complete_iterations(self) -> list[int]:
        return [k for k in self.iterations() if self.incomplete_reason(k) is None]

    def select_iterations(self, which: int | str | None = None) -> list[int]:
        """None: the last complete iteration; 'all': every complete one; an int: that one, if complete."""
        if which in (None, "last", "all"):
            complete = self.complete_iterations()
            if not complete:
                raise TraceError(f"{self.trace_dir}: no complete iteration ({self._why_none_complete()})")
            return complete if which == "all" else [complete[-1]]
        iteration = int(which)
        if iteration not in self.iterations():
            present = self.iterations()
            span = f"{present[0]}..{present[-1]}" if present else "none"
            raise TraceError(f"{self.trace_dir}: iteration {iteration} is not in the trace (iterations: {span})")
        reason = self.incomplete_reason(iteration)
        if reason is not None:
            raise TraceError(f"{self.trace_dir}: iteration {iteration} is incomplete: {reason}")
        return [iteration]

    def _why_none_complete(self) -> str:
        present = self.iterations()
        if not present:
            return "no forward/backward events at all"
        return self.incomplete_reason(present[-1]) or "unknown"


def read_trace_dir(trace_dir: str | os.PathLike, pipeline_parallel: int | None = None,
                   model_chunks: int | None = None) -> TraceRun:
    """Load and validate every `trace_rank<N>.jsonl` in `trace_dir` (or in its `latest` run, when it is a root of
    run directories); raise TraceError on the first problem."""
    directory = Path(trace_dir)
    if not directory.is_dir():
        raise TraceError(f"{directory}: trace directory does not exist")
    files = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _FILE_RE.match(p.name)))
    if not files and (directory / LATEST).is_dir():  # a root of run directories: its latest run
        return read_trace_dir(directory / LATEST, pipeline_parallel, model_chunks)
    if not files:
        raise TraceError(f"{directory}: no trace files (trace_rank<N>.jsonl)")
    ranks = [_read_rank_file(path, rank, pipeline_parallel, model_chunks) for rank, path in files]
    _check_same_run(ranks)
    _check_rank_coverage(directory, ranks)
    return TraceRun(directory, ranks)


def _read_rank_file(path: Path, file_rank: int, pipeline_parallel: int | None,
                    model_chunks: int | None) -> RankTrace:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from None
    lines = text.split("\n")
    ends_with_newline = lines[-1] == ""
    if ends_with_newline:
        lines.pop()
    if not lines or not lines[0].strip():
        raise TraceError(f"{path}: empty file (no header line)")

    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or "schema_version" not in header:
        raise TraceError(f"{path}: line 1 is not a trace header (a JSON object with schema_version)")
    try:
        check_schema_version(header["schema_version"])
        meta = TraceMeta.from_header(header)
    except ValueError as exc:
        raise TraceError(f"{path}: {exc}") from None
    if meta.global_rank != file_rank:
        raise TraceError(f"{path}: header says global_rank {meta.global_rank} but the file name says {file_rank}")
    _check_shape(path, meta, pipeline_parallel, model_chunks)

    events = []
    seen_tasks: set[tuple] = set()
    last = len(lines)
    for lineno, line in enumerate(lines[1:], start=2):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if lineno == last and not ends_with_newline:
                raise TraceError(f"{path}: line {lineno}: truncated (file ends mid-line; was the run killed?)") \
                    from None
            raise TraceError(f"{path}: line {lineno}: corrupt line (not JSON)") from None
        try:
            event = _parse_event(obj, meta)
        except ValueError as exc:
            raise TraceError(f"{path}: line {lineno}: {exc}") from None
        if event.kind in COMPUTE_KINDS:
            task = (event.iteration, event.kind, event.chunk, event.microbatch)
            if task in seen_tasks:
                raise TraceError(f"{path}: line {lineno}: duplicate {event.kind} chunk {event.chunk} microbatch "
                                 f"{event.microbatch} in iteration {event.iteration}")
            seen_tasks.add(task)
        events.append(event)
    return RankTrace(path, str(header["schema_version"]), meta, events)


def _check_shape(path: Path, meta: TraceMeta, pipeline_parallel: int | None, model_chunks: int | None) -> None:
    wrong = []
    if pipeline_parallel is not None and meta.pipeline_parallel != pipeline_parallel:
        wrong.append(f"pipeline_parallel={meta.pipeline_parallel} (asked {pipeline_parallel})")
    if model_chunks is not None and meta.model_chunks != model_chunks:
        wrong.append(f"model_chunks={meta.model_chunks} (asked {model_chunks})")
    if wrong:
        raise TraceError(f"{path}: trace is from a run with {' and '.join(wrong)}")


def _int_field(obj: dict, name: str, minimum: int = 0, upper: int | None = None) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or value < minimum or (upper is not None and value >= upper):
        bound = f" and < {upper}" if upper is not None else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{bound}, got {value!r}")
    return value


def _time_field(obj: dict, name: str) -> float:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of microseconds, got {value!r}")
    return float(value)


def _parse_event(obj, meta: TraceMeta) -> TraceEvent:
    if not isinstance(obj, dict):
        raise ValueError("event is not a JSON object")
    kind = obj.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"event has no kind (got {kind!r})")
    rank = _int_field(obj, "rank")
    pp_rank = _int_field(obj, "pp_rank")
    if rank != meta.global_rank or pp_rank != meta.pp_rank:
        raise ValueError(f"event of rank {rank} / pp_rank {pp_rank} in the file of rank {meta.global_rank} "
                         f"/ pp_rank {meta.pp_rank}")
    iteration = _int_field(obj, "iteration")
    if iteration is None:
        raise ValueError(f"{kind} event has no iteration")
    start = _time_field(obj, "start")
    end = _time_field(obj, "end")
    if end < start:
        raise ValueError(f"{kind} event ends before it starts ({end} < {start})")
    chunk = _int_field(obj, "chunk", upper=meta.model_chunks)
    # No upper bound from the meta: it holds the first call's count, and a loop that composes its global batch
    # (runtime/composition.py) may run more microbatches in a later call; TraceRun.microbatches_of counts them.
    microbatch = _int_field(obj, "microbatch")
    if kind in COMPUTE_KINDS and (chunk is None or microbatch is None):
        raise ValueError(f"{kind} event needs chunk and microbatch")
    extra = obj.get("extra", {})
    if not isinstance(extra, dict):
        raise ValueError("extra must be a JSON object")
    return TraceEvent(rank=rank, pp_rank=pp_rank, iteration=iteration, kind=kind, start=start, end=end, chunk=chunk,
                      microbatch=microbatch, peer=_int_field(obj, "peer"), nbytes=_int_field(obj, "nbytes"),
                      extra=extra)


def _check_same_run(ranks: list[RankTrace]) -> None:
    reference = ranks[0]
    expected = reference.meta.same_run_fields()
    for rank in ranks[1:]:
        got = rank.meta.same_run_fields()
        diffs = [f"{k} {got[k]!r} vs {expected[k]!r}" for k in expected if got[k] != expected[k]]
        if diffs:
            raise TraceError(f"{rank.path}: from a different run than {reference.name} ({', '.join(diffs)}); "
                             f"remove stale trace files")


def _check_rank_coverage(directory: Path, ranks: list[RankTrace]) -> None:
    meta = ranks[0].meta
    seen: dict[tuple[int, int, int], RankTrace] = {}
    for rank in ranks:
        key = (rank.meta.pp_rank, rank.meta.tp_rank, rank.meta.dp_rank)
        if key in seen:
            raise TraceError(f"{rank.path}: same pp/tp/dp rank {key} as {seen[key].name}")
        seen[key] = rank
    sizes_known = meta.tensor_parallel is not None and meta.data_parallel is not None
    if sizes_known:
        missing = [(p, t, d) for d in range(meta.data_parallel) for p in range(meta.pipeline_parallel)
                   for t in range(meta.tensor_parallel) if (p, t, d) not in seen]
        world = meta.pipeline_parallel * meta.tensor_parallel * meta.data_parallel
    else:
        present_pp = {key[0] for key in seen}
        missing = [(p, 0, 0) for p in range(meta.pipeline_parallel) if p not in present_pp]
        only_pipeline = all(key[1] == 0 and key[2] == 0 for key in seen)
        world = meta.pipeline_parallel if only_pipeline else max(r.meta.global_rank for r in ranks) + 1
    if not missing:
        return
    present = {r.meta.global_rank for r in ranks}
    absent_files = [trace_file_name(g) for g in range(world) if g not in present]
    what = ", ".join(f"pp{p}/tp{t}/dp{d}" if sizes_known else f"pipeline rank {p}" for p, t, d in missing[:4])
    files = f"missing {', '.join(absent_files[:4])}{' ...' if len(absent_files) > 4 else ''}: " if absent_files else ""
    raise TraceError(f"{directory}: {files}no trace for {what}{' ...' if len(missing) > 4 else ''} "
                     f"({len(ranks)} rank file(s) present)")
