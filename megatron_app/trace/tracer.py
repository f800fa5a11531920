"""Per-rank event log. record() only appends a tuple; encoding and writing happen in batches at flush()."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from .schema import CLOSED, KNOWN_KINDS, TraceMeta, trace_file_name

# Bounds memory when the caller never flushes (e.g. a long evaluation loop); about 100 bytes per event.
DEFAULT_MAX_BUFFERED_EVENTS = 100_000
_EXTRA_CACHE_SIZE = 1024
_dumps = json.JSONEncoder(separators=(",", ":")).encode


class _Span:
    """Context manager that records one event from enter to exit (exit also on exception: the time was spent)."""

    __slots__ = ("_tracer", "_kind", "_iteration", "_fields", "_start")

    def __init__(self, tracer: "Tracer", kind: str, iteration: int, fields: dict) -> None:
        self._tracer = tracer
        self._kind = kind
        self._iteration = iteration
        self._fields = fields
        self._start = 0.0

    def __enter__(self) -> "_Span":
        self._start = self._tracer.now_us()
        return self

    def __exit__(self, *exc_info) -> None:
        self._tracer.record(self._kind, self._start, self._tracer.now_us(), iteration=self._iteration, **self._fields)


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> "_NullSpan":
        return self

    def __exit__(self, *exc_info) -> None:
        return None


_NULL_SPAN = _NullSpan()


class Tracer:
    """Writes one rank's events to `trace_dir/trace_rank<global_rank>.jsonl`.

    Times are microseconds on the rank-0-aligned clock: now_us() adds meta.clock_offset_us to this host's
    monotonic clock, and the simulator passes its own times to record(). With enabled=False nothing is created
    and every method returns at once.
    """

    def __init__(self, trace_dir: str | os.PathLike, meta: TraceMeta, enabled: bool = True,
                 max_buffered_events: int = DEFAULT_MAX_BUFFERED_EVENTS) -> None:
        if not isinstance(meta, TraceMeta):
            raise TypeError(f"meta must be a TraceMeta, got {type(meta).__name__}")
        if max_buffered_events < 1:
            raise ValueError(f"max_buffered_events must be >= 1, got {max_buffered_events}")
        self.meta = meta
        self.enabled = bool(enabled)
        self.path = Path(trace_dir) / trace_file_name(meta.global_rank)
        self._offset_us = float(meta.clock_offset_us)
        self._max_buffered = max_buffered_events
        self._buffer: list[tuple] = []
        self._extra_cache: dict[tuple, str] = {}
        self._lock = threading.Lock()  # serialises flush() and close(); record() belongs to the rank's main thread
        self._file = None
        self._last_event = (0, None)  # iteration and end of the last flushed event: the closing line's
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
            self._file.write(json.dumps(_with_default_run_id(meta).to_header(), separators=(",", ":")) + "\n")
            self._file.flush()

    def now_us(self) -> float:
        return time.monotonic_ns() / 1e3 + self._offset_us

    def us_of(self, monotonic_ns: int) -> float:
        """A time.monotonic_ns() reading taken earlier on this host, on this tracer's clock."""
        return monotonic_ns / 1e3 + self._offset_us

    def record(self, kind: str, start_us: float, end_us: float, *, iteration: int, chunk: int | None = None,
               microbatch: int | None = None, peer: int | None = None, nbytes: int | None = None, **extra) -> None:
        if not self.enabled:
            return
        if kind not in KNOWN_KINDS:
            raise ValueError(f"unknown trace event kind {kind!r}; known kinds: {', '.join(sorted(KNOWN_KINDS))}")
        if end_us < start_us:
            raise ValueError(f"{kind} event ends before it starts ({end_us} < {start_us})")
        self._buffer.append((kind, start_us, end_us, iteration, chunk, microbatch, peer, nbytes, extra))
        if len(self._buffer) >= self._max_buffered:
            self.flush()

    def span(self, kind: str, *, iteration: int, **fields):
        """`with tracer.span('forward', iteration=k, chunk=c, microbatch=i): ...` records the block's duration."""
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, kind, iteration, fields)

    def flush(self) -> None:
        """Encode and write the buffered events. Call at iteration end; cost is a few microseconds per event."""
        if not self.enabled:
            return
        with self._lock:
            events, self._buffer = self._buffer, []
            if events and self._file is not None:
                self._last_event = (int(events[-1][3]), float(events[-1][2]))
                encode = self._encoder()
                self._file.write("".join([encode(event) for event in events]))
                self._file.flush()

    def close(self) -> None:
        """Flush and end the file with a `closed` line, which tells readers this rank finished normally."""
        if not self.enabled:
            return
        self.flush()
        with self._lock:
            if self._file is not None:
                # At the last event's end, not the clock's now: the simulator's times are virtual.
                iteration, end = self._last_event
                end = self.now_us() if end is None else end
                self._file.write(self._encoder()((CLOSED, end, end, iteration, None, None, None, None, {})))
                self._file.close()
                self._file = None
        self.record = self._record_after_close  # instance attribute: no per-call cost before close

    def _record_after_close(self, kind: str, *args, **kwargs) -> None:
        raise RuntimeError(f"trace for rank {self.meta.global_rank} is closed; cannot record {kind!r}")

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _encoder(self):
        # Hand-built lines: about 3x faster than json.dumps of a dict. Only `extra` needs real JSON escaping;
        # kind is one of KNOWN_KINDS and every other field is a number.
        prefix = f'{{"rank":{self.meta.global_rank},"pp_rank":{self.meta.pp_rank},"iteration":'
        encode_extra = self._encode_extra

        def encode(event: tuple) -> str:
            kind, start, end, iteration, chunk, microbatch, peer, nbytes, extra = event
            line = f'{prefix}{int(iteration)},"kind":"{kind}","start":{float(start):.3f},"end":{float(end):.3f}'
            if chunk is not None:
                line += f',"chunk":{int(chunk)}'
            if microbatch is not None:
                line += f',"microbatch":{int(microbatch)}'
            if peer is not None:
                line += f',"peer":{int(peer)}'
            if nbytes is not None:
                line += f',"nbytes":{int(nbytes)}'
            if extra:
                line += f',"extra":{encode_extra(extra)}'
            return line + "}\n"

        return encode

    def _encode_extra(self, extra: dict) -> str:
        """JSON of an `extra` dict; the same few dicts (e.g. direction='forward') repeat, so encodings are cached."""
        try:
            key = tuple(extra.items())
            return self._extra_cache[key]
        except TypeError:  # an unhashable value
            return _dumps(extra)
        except KeyError:
            if len(self._extra_cache) >= _EXTRA_CACHE_SIZE:
                self._extra_cache.clear()
            text = self._extra_cache[key] = _dumps(extra)
            return text


def _with_default_run_id(meta: TraceMeta) -> TraceMeta:
    """Fill run_id from torchrun's rendezvous id when the caller gave none, so stale files of other runs show."""
    if meta.run_id:
        return meta
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id in ("", "none"):
        return meta
    return replace(meta, run_id=run_id)
