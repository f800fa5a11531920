"""Trace file schema: version, event kinds, the per-rank header (TraceMeta) and the error type.

A trace file is JSON lines: line 1 is the header (schema_version + meta), every later line one event.
docs/trace_schema.md describes the format for people; this module is its single definition in code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_app.schedule.tasks import Kind, TASK_KINDS

SCHEMA_VERSION = "1.8"   # 1.4: iterations count from 1 (FIRST_ITERATION); 1.5: a device send spans its transfer;
                         # 1.6: an iteration event may carry extra.task_gap_us; 1.7: a device-timed compute event
                         # extra.host_us and extra.queued_us, and `gc` events; 1.8: `memory` events
FORMAT_NAME = "megatron_app.trace"
FILE_PATTERN = "trace_rank{rank}.jsonl"
# Iterations count from 1 in every trace, real or simulated, as in the trainer's log ("iter 1/N"), its --log-json and
# Megatron-LM; a run resumed from iteration K's checkpoint traces K+1, K+2, ... (the trainer tells the runtime its
# number with set_iteration). Files of schema 1.3 and older counted from 0.
FIRST_ITERATION = 1

FORWARD = Kind.FORWARD.trace_name
BACKWARD = Kind.BACKWARD.trace_name
WEIGHT = Kind.WEIGHT.trace_name  # a split backward's weight-gradient task (schema 1.3); its B is a "backward"
SEND = "send"
RECV = "recv"
WAIT = "wait"
OPTIMIZER = "optimizer"
ITERATION = "iteration"
EVAL = "eval"
LOSS = "loss"  # packet-loss statistics of one link and direction for one iteration (schema 1.1)
CLOSED = "closed"  # the file's last line once its tracer closed it normally (schema 1.2): the rank finished
GC = "gc"  # a collection of Python's cyclic garbage collector in the rank's process (schema 1.7)
# A rank's peak memory over an iteration, spanning what was measured (its start to after the optimizer step; schema
# 1.8): extra.peak_mib and extra.measure, "allocated" (CUDA's caching allocator, within the span) or "resident" (the
# process's peak so far)
MEMORY = "memory"

COMPUTE_KINDS = frozenset(info.trace_name for info in TASK_KINDS.values())   # the schedule's task kinds
KNOWN_KINDS = COMPUTE_KINDS | {SEND, RECV, WAIT, OPTIMIZER, ITERATION, EVAL, LOSS, CLOSED, GC, MEMORY}
SOURCES = frozenset({"runtime", "sim"})


class TraceError(Exception):
    """A trace file or directory is missing, corrupt, or does not match what was asked for."""


def trace_file_name(global_rank: int) -> str:
    return FILE_PATTERN.format(rank=global_rank)


def schema_major(version: str) -> int:
    """Major number of a "MAJOR.MINOR" version string; ValueError when it is not one."""
    major, _, minor = str(version).partition(".")
    if not major.isdigit() or (minor and not minor.isdigit()):
        raise ValueError(f"malformed schema_version {version!r} (expected 'MAJOR.MINOR')")
    return int(major)


def check_schema_version(version: Any) -> None:
    """Raise ValueError unless `version` has the same major number as SCHEMA_VERSION."""
    if version is None:
        raise ValueError("header has no schema_version")
    major = schema_major(version)
    supported = schema_major(SCHEMA_VERSION)
    if major != supported:
        raise ValueError(
            f"schema_version {version} is not supported by this reader (it reads {supported}.x); "
            f"use a megatron_app release that matches the one that wrote the trace"
        )


def _require_int(name: str, value: Any, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class TraceMeta:
    """What one rank's trace is about. Written as the header line of its file.

    tensor_parallel / data_parallel are optional: when every rank gives them, the reader also checks that no
    (pp, tp, dp) rank file is missing. run_id tells runs apart when old files linger in a trace directory.
    """

    global_rank: int
    pp_rank: int
    tp_rank: int = 0
    dp_rank: int = 0
    pipeline_parallel: int = 1
    model_chunks: int = 1
    microbatches: int = 1
    policy: str = ""
    host: str = ""
    source: str = "runtime"
    clock_offset_us: float = 0.0
    tensor_parallel: int | None = None
    data_parallel: int | None = None
    run_id: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require_int("global_rank", self.global_rank)
        _require_int("pp_rank", self.pp_rank)
        _require_int("tp_rank", self.tp_rank)
        _require_int("dp_rank", self.dp_rank)
        _require_int("pipeline_parallel", self.pipeline_parallel, 1)
        _require_int("model_chunks", self.model_chunks, 1)
        _require_int("microbatches", self.microbatches, 1)
        if self.pp_rank >= self.pipeline_parallel:
            raise ValueError(f"pp_rank {self.pp_rank} out of range for pipeline_parallel={self.pipeline_parallel}")
        for rank_name, size_name in (("tp_rank", "tensor_parallel"), ("dp_rank", "data_parallel")):
            size = getattr(self, size_name)
            if size is not None:
                _require_int(size_name, size, 1)
                if getattr(self, rank_name) >= size:
                    raise ValueError(f"{rank_name} {getattr(self, rank_name)} out of range for {size_name}={size}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {sorted(SOURCES)}, got {self.source!r}")
        if not isinstance(self.clock_offset_us, (int, float)) or isinstance(self.clock_offset_us, bool):
            raise ValueError(f"clock_offset_us must be a number, got {self.clock_offset_us!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {type(self.extra).__name__}")

    def to_header(self) -> dict:
        header = {"schema_version": SCHEMA_VERSION, "format": FORMAT_NAME}
        header.update(dataclasses.asdict(self))
        return header

    @classmethod
    def from_header(cls, header: dict) -> "TraceMeta":
        """Build from a header object; unknown keys (from a newer minor version) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [n for n in ("global_rank", "pp_rank", "pipeline_parallel", "model_chunks") if n not in header]
        if missing:
            raise ValueError(f"header lacks {', '.join(missing)}")
        try:
            return cls(**{k: v for k, v in header.items() if k in names})
        except TypeError as exc:  # e.g. extra is not a dict
            raise ValueError(str(exc)) from None

    def same_run_fields(self) -> dict:
        """The fields every rank of one run must agree on."""
        return {
            "pipeline_parallel": self.pipeline_parallel,
            "model_chunks": self.model_chunks,
            "microbatches": self.microbatches,
            "policy": self.policy,
            "source": self.source,
            "tensor_parallel": self.tensor_parallel,
            "data_parallel": self.data_parallel,
            "run_id": self.run_id,
        }


@dataclass(frozen=True)
class TraceEvent:
    """One event as read back from a file. Times are microseconds on the rank-0-aligned clock."""

    rank: int
    pp_rank: int
    iteration: int
    kind: str
    start: float
    end: float
    chunk: int | None = None
    microbatch: int | None = None
    peer: int | None = None
    nbytes: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def label(self) -> str:
        """The seed's cell label: "chunk-microbatch"."""
        return f"{self.chunk}-{self.microbatch}"
