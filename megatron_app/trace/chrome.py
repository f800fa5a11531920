"""Export to the Chrome trace event format (opens in ui.perfetto.dev and chrome://tracing).

One process per rank file (named by pipeline rank, host and global rank), one thread per event kind.
Sends overlap each other, so they are async begin/end pairs; everything else is a complete ("X") event.
Timestamps are microseconds from the first exported event.
"""

from __future__ import annotations

from .reader import TraceRun
from .schema import BACKWARD, CLOSED, FORWARD, MEMORY, RECV, SEND, WEIGHT

_THREADS = ["compute", "recv", "wait", "optimizer", "iteration", "eval"]
_THREAD_OF_KIND = {FORWARD: "compute", BACKWARD: "compute", WEIGHT: "compute"}
_SHORT = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}


def chrome_trace(run: TraceRun, iterations: list[int]) -> dict:
    selected = set(iterations)
    events_by_rank = [(rank, [e for e in rank.events if e.iteration in selected and e.kind != CLOSED])
                      for rank in run.ranks]
    all_starts = [e.start for _, events in events_by_rank for e in events]
    origin = min(all_starts) if all_starts else 0.0
    out: list[dict] = []
    async_id = 0
    for pid, (rank, events) in enumerate(events_by_rank):
        meta = rank.meta
        host = f" {meta.host}" if meta.host else ""
        replica = f" tp{meta.tp_rank} dp{meta.dp_rank}" if (meta.tp_rank or meta.dp_rank) else ""
        out.append({"ph": "M", "pid": pid, "name": "process_name",
                    "args": {"name": f"pp {meta.pp_rank}{replica} (rank {meta.global_rank}{host})"}})
        out.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
        thread_ids: dict[str, int] = {}
        for event in events:
            args = {"iteration": event.iteration}
            for name in ("chunk", "microbatch", "peer", "nbytes"):
                value = getattr(event, name)
                if value is not None:
                    args[name] = value
            args.update(event.extra)
            name = _event_name(event)
            ts = event.start - origin
            if event.kind == MEMORY:   # a counter per rank from the iteration's start (Perfetto holds each value)
                out.append({"ph": "C", "name": f"peak memory MiB ({event.extra.get('measure', '?')})", "pid": pid,
                            "ts": ts, "args": {"MiB": event.extra.get("peak_mib", 0.0)}})
                continue
            if event.kind == SEND:
                async_id += 1
                common = {"cat": SEND, "name": name, "pid": pid, "tid": 0, "id": async_id}
                out.append(common | {"ph": "b", "ts": ts, "args": args})
                out.append(common | {"ph": "e", "ts": event.end - origin})
                continue
            thread = _THREAD_OF_KIND.get(event.kind, event.kind)
            if thread not in thread_ids:
                thread_ids[thread] = len(thread_ids) + 1
                out.append({"ph": "M", "pid": pid, "tid": thread_ids[thread], "name": "thread_name",
                            "args": {"name": thread}})
                order = _THREADS.index(thread) if thread in _THREADS else len(_THREADS)
                out.append({"ph": "M", "pid": pid, "tid": thread_ids[thread], "name": "thread_sort_index",
                            "args": {"sort_index": order}})
            out.append({"ph": "X", "cat": event.kind, "name": name, "pid": pid, "tid": thread_ids[thread],
                        "ts": ts, "dur": event.duration, "args": args})
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"pipeline_parallel": run.pipeline_parallel, "model_chunks": run.model_chunks,
                      "microbatches": {str(k): run.microbatches_of(k) for k in sorted(selected)},
                      "policy": run.policy, "source": run.source,
                      "iterations": sorted(selected), "time_origin_us": origin},
    }


def _event_name(event) -> str:
    if event.kind in _SHORT:
        return f"{_SHORT[event.kind]} {event.label}"
    if event.kind in (SEND, RECV) and event.chunk is not None:
        arrow = "->" if event.kind == SEND else "<-"
        return f"{event.kind} {event.label} {arrow} {event.peer}"
    return event.kind
