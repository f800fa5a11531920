"""Python's garbage collections in the rank's trace (train/gc_trace.py, schema 1.7 `gc` events) and the metrics that
read them (trace/metrics.py: gc_us, gc_longest_us)."""

import gc
import json

from megatron_app.trace import Tracer, TraceMeta
from megatron_app.trace.metrics import iteration_metrics
from megatron_app.trace.reader import read_trace_dir
from megatron_app.train import gc_trace


def _traced_collections(tmp_path, monkeypatch, iteration):
    tracer = Tracer(tmp_path, TraceMeta(global_rank=0, pp_rank=0))
    monkeypatch.setattr(gc_trace, "current_tracer", lambda: tracer)
    collections = gc_trace.CollectionTracer().start()
    try:
        collections.iteration = iteration
        gc.collect()              # a full collection, generation 2
    finally:
        collections.stop()
    gc.collect()                  # after stop(): not recorded
    tracer.close()
    return [json.loads(line) for line in (tmp_path / "trace_rank0.jsonl").read_text().splitlines()[1:]]


def test_each_collection_while_training_is_a_gc_event_under_its_iteration(tmp_path, monkeypatch):
    events = [e for e in _traced_collections(tmp_path, monkeypatch, iteration=3) if e["kind"] == "gc"]
    assert len(events) == 1 and events[0]["iteration"] == 3 and events[0]["extra"]["generation"] == 2
    assert events[0]["end"] > events[0]["start"]     # a full collection takes time
    assert all(callback.__self__.__class__.__name__ != "CollectionTracer" for callback in gc.callbacks
               if hasattr(callback, "__self__"))


def test_nothing_is_recorded_before_the_first_iteration_or_without_a_tracer(tmp_path, monkeypatch):
    assert not [e for e in _traced_collections(tmp_path, monkeypatch, iteration=None) if e["kind"] == "gc"]
    monkeypatch.setattr(gc_trace, "current_tracer", lambda: None)
    collections = gc_trace.CollectionTracer().start()
    collections.iteration = 1
    try:
        gc.collect()              # no tracer (a rank that writes no trace): nothing, and nothing raised
    finally:
        collections.stop()


def test_a_failing_tracer_does_not_reach_the_collector(tmp_path, monkeypatch, capsys):
    def broken():
        raise RuntimeError("tracer gone")

    monkeypatch.setattr(gc_trace, "current_tracer", broken)
    collections = gc_trace.CollectionTracer().start()
    collections.iteration = 1
    try:
        gc.collect()
    finally:
        collections.stop()
    assert "tracer gone" not in capsys.readouterr().err     # the interpreter prints a callback's exception


def test_the_metrics_sum_a_ranks_collections_in_the_iteration(tmp_path):
    with Tracer(tmp_path, TraceMeta(global_rank=0, pp_rank=0)) as tracer:
        tracer.record("forward", 0.0, 100.0, iteration=1, chunk=0, microbatch=0)
        tracer.record("gc", 10.0, 40.0, iteration=1, generation=2, collected=5)
        tracer.record("backward", 100.0, 300.0, iteration=1, chunk=0, microbatch=0)
        tracer.record("gc", 150.0, 155.0, iteration=1, generation=0, collected=0)
    [rank] = iteration_metrics(read_trace_dir(tmp_path), 1).ranks
    assert (rank.gc_us, rank.gc_longest_us) == (35.0, 30.0)
