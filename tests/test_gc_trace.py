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
        before = tracer.now_us()
        gc.collect()              # a full collection, generation 2: noted, not yet in the trace
        assert not tracer._buffer
        collections.record()      # between iterations: into the trace
    finally:
        collections.stop()
    gc.collect()                  # after stop(): not noted
    tracer.close()
    events = [json.loads(line) for line in (tmp_path / "trace_rank0.jsonl").read_text().splitlines()[1:]]
    return before, [e for e in events if e["kind"] == "gc"]


def test_each_collection_while_training_is_a_gc_event_under_its_iteration_on_the_tracers_clock(tmp_path,
                                                                                             monkeypatch):
    before, events = _traced_collections(tmp_path, monkeypatch, iteration=3)
    assert len(events) == 1 and events[0]["iteration"] == 3 and events[0]["extra"]["generation"] == 2
    assert before <= events[0]["start"] < events[0]["end"]     # a full collection takes time, after `before`
    assert all(getattr(callback, "__self__", None).__class__ is not gc_trace.CollectionTracer
               for callback in gc.callbacks)


def test_nothing_is_recorded_before_the_first_iteration_or_without_a_tracer(tmp_path, monkeypatch):
    assert _traced_collections(tmp_path, monkeypatch, iteration=None)[1] == []
    monkeypatch.setattr(gc_trace, "current_tracer", lambda: None)
    collections = gc_trace.CollectionTracer().start()
    collections.iteration = 1
    try:
        gc.collect()              # no tracer (a rank that writes no trace)
        assert len(collections._noted) == 1
        collections.record()      # dropped, nothing raised
        assert collections._noted == []
    finally:
        collections.stop()


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_collection_inside_the_tracers_own_flush_does_not_enter_it(tmp_path, monkeypatch):
    """The collector's callback runs inside whatever allocated, the tracer's flush too (which holds its lock): it
    only notes the collection, so a full buffer and a collection in the middle of a flush cannot deadlock."""
    tracer = Tracer(tmp_path, TraceMeta(global_rank=0, pp_rank=0), max_buffered_events=2)
    monkeypatch.setattr(gc_trace, "current_tracer", lambda: tracer)
    thresholds = gc.get_threshold()
    collections = gc_trace.CollectionTracer().start()
    collections.iteration = 1
    try:
        gc.set_threshold(1)       # a collection at nearly every allocation, flushes included
        for microbatch in range(50):
            tracer.record("forward", microbatch, microbatch + 1.0, iteration=1, chunk=0, microbatch=microbatch)
        gc.set_threshold(*thresholds)
        collections.record()
    finally:
        gc.set_threshold(*thresholds)
        collections.stop()
    tracer.close()
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "trace_rank0.jsonl").read_text().splitlines()[1:]]
    assert kinds.count("forward") == 50 and kinds.count("gc") > 10


def test_the_metrics_sum_a_ranks_collections_in_the_iteration(tmp_path):
    with Tracer(tmp_path, TraceMeta(global_rank=0, pp_rank=0)) as tracer:
        tracer.record("forward", 0.0, 100.0, iteration=1, chunk=0, microbatch=0)
        tracer.record("gc", 10.0, 40.0, iteration=1, generation=2, collected=5)
        tracer.record("backward", 100.0, 300.0, iteration=1, chunk=0, microbatch=0)
        tracer.record("gc", 150.0, 155.0, iteration=1, generation=0, collected=0)
    [rank] = iteration_metrics(read_trace_dir(tmp_path), 1).ranks
    assert (rank.gc_us, rank.gc_longest_us) == (35.0, 30.0)


def test_a_file_without_any_collection_did_not_record_them(tmp_path):
    with Tracer(tmp_path, TraceMeta(global_rank=0, pp_rank=0)) as tracer:   # the simulator's, a user's own loop
        tracer.record("forward", 0.0, 100.0, iteration=1, chunk=0, microbatch=0)
        tracer.record("backward", 100.0, 300.0, iteration=1, chunk=0, microbatch=0)
    [rank] = iteration_metrics(read_trace_dir(tmp_path), 1).ranks
    assert (rank.gc_us, rank.gc_longest_us) == (None, None)


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
    # The same run's memory events (schema 1.8): one per iteration, spanning its call, the process's resident peak.
    memory = [e for e in events if e["kind"] == "memory"]
    starts = {e["iteration"]: e["start"] for e in events if e["kind"] == "iteration"}
    assert [e["iteration"] for e in memory] == [1, 2, 3, 4]
    assert all(e["start"] <= starts[e["iteration"]] and e["end"] >= ends[e["iteration"]] for e in memory)
    assert all(e["extra"]["measure"] == "resident" and e["extra"]["peak_mib"] > 10 for e in memory), memory


WORKER = """
import os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from megatron_app.train import loop, stops
from megatron_app.train.args import parse_args

real = loop.after_iteration


def after(trainer, iteration, collector=None):
    if iteration == 2:   # a Ctrl-C whose KeyboardInterrupt a gc callback swallowed: only the flag says it came
        stops._CtrlC.seen = True
    return real(trainer, iteration, collector)


loop.after_iteration = after
try:
    loop.train(parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                           "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "2",
                           "--global-batch-size", "4", "--device", "cpu", "--iters", "5", "--no-trace"]))
except stops.TrainingInterrupted as interrupted:
    print("INTERRUPTED", interrupted)
"""


def test_a_ctrl_c_a_collection_swallowed_stops_the_run_at_the_next_iterations_end():
    from helpers.fork_ranks import free_port

    result = subprocess.run([sys.executable, "-c", WORKER, str(free_port())], cwd=REPO, capture_output=True,
                            text=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "iter 2/5" in result.stdout and "iter 3/5" not in result.stdout, result.stdout
    assert "INTERRUPTED" in result.stdout and "iteration 2" in result.stdout.split("INTERRUPTED", 1)[1]
