"""A training call's trace span starts where the device reached the call (executor.run's marker on the task clock),
not where the host entered it: on a GPU the previous step's optimizer can still be running then (7-19 ms of each
call's host span on an H200 at P=1), and the call's compute spans are the device's. Here a stand-in device that
completes every event LAG after the host records it, on a CPU run. The pipeline time the planner learns from
(session.record_pipeline_time) is taken from there too."""

import json
import subprocess
import sys

from pipeline_runs import REPO, run_env

LAG_US = 40_000.0

WORKER = """
import json, os, sys, time
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
from megatron_app.runtime import executor
from megatron_app.runtime.session import RuntimeSession
from megatron_app.runtime.task_clock import CudaEventTaskClock
from megatron_app.train.args import parse_args
from megatron_app.train.loop import train

LAG_US = float(sys.argv[3])


class LaggingEvent:
    # completes LAG_US after the host records it; the host waits for it in synchronize(), as for a CUDA event
    def record(self):
        self.at = time.monotonic() * 1e6 + LAG_US

    def synchronize(self):
        time.sleep(max(0.0, self.at - time.monotonic() * 1e6) / 1e6)

    def elapsed_time(self, other):
        return (other.at - self.at) / 1e3


executor.task_clock_for = lambda device, now: CudaEventTaskClock(now, event_factory=LaggingEvent)
recorded = []   # each training call's pipeline time as the session learns it, and the microbatches run so far
real_record = RuntimeSession.record_pipeline_time
RuntimeSession.record_pipeline_time = lambda self, plan, seconds: (recorded.append((seconds, self.microbatches_run)),
                                                                   real_record(self, plan, seconds))
train(parse_args(["--pipeline_parallel", "1", "--model_chunks", "1", "--num-layers", "2", "--hidden-size", "32",
                  "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
                  "--global-batch-size", "8", "--iters", "3", "--trace-dir", sys.argv[1], "--device", "cpu"]))
print("RECORDED", json.dumps(recorded))
"""


def test_the_call_span_starts_where_the_device_reached_the_call(tmp_path, monkeypatch):
    from helpers.fork_ranks import free_port
    from megatron_app.trace.metrics import iteration_metrics
    from megatron_app.trace.reader import read_trace_dir
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    from gpu_check import host_bound_shares

    result = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path), str(free_port()), str(LAG_US)], cwd=REPO,
                            env=run_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run = read_trace_dir(str(tmp_path / "latest"))
    rank = run.ranks[0]
    heads, spans = [], []
    for iteration in run.iterations():
        events = rank.events_of(iteration)
        call = next(e for e in events if e.kind == "iteration")
        tasks = [e for e in events if e.kind in ("forward", "backward")]
        assert tasks and call.start <= min(e.start for e in tasks) and max(e.end for e in tasks) <= call.end
        # each device-timed task carries the host's own time in it and how far the device trailed the host at its
        # start: here the device runs each event LAG behind and takes the host's time for the rest
        for task in tasks:
            assert abs(task.extra["queued_us"] - LAG_US) < LAG_US / 2, task.extra
            assert abs(task.extra["host_us"] - (task.end - task.start)) < LAG_US / 4, (task.extra, task.duration)
        heads.append(min(e.start for e in tasks) - call.start)
        spans.append(call.end - call.start)
    # the stand-in device trails the host by LAG all along: it never waited for the host, so none of its time is
    # host-bound (process_trace's column, gpu_check's prediction rows), though the host took each task's span
    for iteration in run.iterations():
        [metrics] = iteration_metrics(run, iteration).ranks
        assert metrics.host_bound_us == 0.0 and metrics.compute_us > 0
    assert host_bound_shares(run, skip=0) == {"pp0": 0.0}
    # the host's entry was LAG before the device reached the call: a span from there would open with LAG of nothing
    assert max(heads) < LAG_US / 2, json.dumps(heads)
    # the pipeline time the planner learns from is the same span (the lag is outside the pipeline: it is what the
    # device still ran of the step before), not the host's LAG longer
    recorded = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RECORDED "))[9:])
    assert len(recorded) == len(spans)
    assert all(abs(seconds * 1e6 - span) < LAG_US / 2 for (seconds, _), span in zip(recorded, spans)), (recorded, spans)
    # each training call's count is what `balanced` may grow from (4 microbatches: global batch 8 of 2)
    assert [run for _, run in recorded] == [4] * len(spans)
