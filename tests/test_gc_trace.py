"""Python's garbage collections in the rank's trace (train/gc_trace.py, schema 1.7 `gc` events), the metrics that
read them (trace/metrics.py: gc_us, gc_longest_us), and Megatron-LM's --manual-gc (train/manual_gc.py)."""

import gc
import json
import os
import subprocess
import sys

import pytest

from megatron_app.train.args import UsageError, parse_args
from megatron_app.train.manual_gc import ManualCollector
from pipeline_runs import REPO

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


@pytest.mark.parametrize("argv,fragment", [
    (["--manual-gc-interval", "10"], "--manual-gc-interval takes effect with --manual-gc"),
    (["--manual-gc-interval", "0"], "--manual-gc-interval takes effect with --manual-gc"),
    (["--no-manual-gc-eval"], "--no-manual-gc-eval takes effect with --manual-gc"),
    (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be >= 0"),
])
def test_manual_gc_mistakes_are_refused_in_one_line(argv, fragment):
    with pytest.raises(UsageError) as error:
        parse_args(argv, {"WORLD_SIZE": "1"})
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_manual_gc_defaults_are_megatron_lms():
    args = parse_args(["--manual-gc"], {"WORLD_SIZE": "1"})
    assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval) == (True, 0, True)
    assert ManualCollector.from_args(parse_args([], {"WORLD_SIZE": "1"})) is None


def test_the_manual_collector_collects_at_its_points_only_and_restores_the_collector():
    collected = []

    def count(phase, info):
        if phase == "stop":
            collected.append(info["generation"])

    assert gc.isenabled()
    gc.callbacks.append(count)
    try:
        collector = ManualCollector(interval=2, around_evaluation=True).start()
        assert not gc.isenabled() and collected == [2]           # off, after one full collection
        collector.after_iteration(1)
        collector.after_iteration(2)
        assert collected == [2, 2]
        with collector.evaluation():
            pass
        assert collected == [2, 2, 2, 0]                         # fully before an evaluation, young after
        with ManualCollector(interval=0, around_evaluation=False).evaluation():
            pass
        assert collected == [2, 2, 2, 0]
        collector.stop()
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        gc.enable()


def test_a_manual_gc_run_traces_its_collections_between_iterations_only(tmp_path):
    """--manual-gc --manual-gc-interval 2 over 4 iterations: the trace holds full collections after iterations 2
    and 4, and none of the collector's own (it is off)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for launcher_variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(launcher_variable, None)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "256", "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu",
            "--iters", "4", "--trace-dir", tmp_path, "--manual-gc", "--manual-gc-interval", "2"]
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", *map(str, argv)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [trace] = list((tmp_path / "latest").glob("trace_rank0.jsonl"))
    events = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    pauses = [e for e in events if e["kind"] == "gc"]
    assert [(e["iteration"], e["extra"]["generation"]) for e in pauses] == [(2, 2), (4, 2)], pauses
    ends = {e["iteration"]: e["end"] for e in events if e["kind"] == "iteration"}
    assert all(pause["start"] >= ends[pause["iteration"]] for pause in pauses)   # after the iteration's call
