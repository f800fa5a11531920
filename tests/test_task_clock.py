"""Task timing: the host clock on CPU, CUDA events (read at the pipeline's end) on a GPU."""

import time

import pytest
import torch

from megatron_app.runtime.task_clock import CudaEventTaskClock, HostTaskClock, task_clock_for


class _ShiftedGpu:
    """A stand-in for a CUDA stream that finishes each recorded event ``lag_us`` after the host records it, the
    way queued kernels complete after their launch: events on the stand-in's own clock."""

    def __init__(self, lag_us: float):
        self.lag_us = lag_us
        self.host_us = 0.0

    def event(self):
        gpu = self

        class Event:
            def record(self):
                self.at = gpu.host_us + gpu.lag_us

            def synchronize(self):
                gpu.host_us = max(gpu.host_us, self.at)   # the host waits until the stream reaches the event

            def elapsed_time(self, other):
                return (other.at - self.at) / 1e3           # milliseconds, as torch.cuda.Event's

        return Event()


def test_host_clock_returns_each_span_at_once():
    times = iter([10.0, 25.0])
    clock = HostTaskClock(lambda: next(times))
    assert clock.stop(clock.start(), "task") == (10.0, 25.0)
    assert clock.resolve() == [] and not clock.deferred


def test_event_clock_places_device_spans_on_the_host_clock_at_resolve():
    """Tasks launched at host times 0..3 us complete 1 ms later on the device: the spans are the device's, on the
    host's clock, and come only from resolve()."""
    gpu = _ShiftedGpu(lag_us=1000.0)
    clock = CudaEventTaskClock(lambda: gpu.host_us, event_factory=gpu.event)
    for key, (launch, done) in {"f0": (0.0, 1.0), "f1": (2.0, 3.0)}.items():
        gpu.host_us = launch
        started = clock.start()
        gpu.host_us = done
        assert clock.stop(started, key) is None
    spans = clock.resolve()
    assert [timed.key for timed in spans] == ["f0", "f1"]
    for timed, (launch, done) in zip(spans, [(0.0, 1.0), (2.0, 3.0)]):
        assert timed.start_us == pytest.approx(launch + 1000.0) and timed.end_us == pytest.approx(done + 1000.0)
        # the host's own span of the task: from start() to stop(), on the same clock
        assert (timed.host_start_us, timed.host_end_us) == (launch, done)
    assert clock.resolve() == []


def test_event_clock_tells_a_task_whose_time_was_the_hosts():
    """A device idle when the task starts (no lag) and a host that takes 5 ms inside the task before its launches:
    the device span equals the host's, which the trace then shows (host_us about the span, queued_us about nil)."""
    gpu = _ShiftedGpu(lag_us=0.0)
    clock = CudaEventTaskClock(lambda: gpu.host_us, event_factory=gpu.event)
    started = clock.start()
    gpu.host_us += 5000.0     # host work inside the task (a stall, or launches the device waits for)
    clock.stop(started, "stalled")
    [timed] = clock.resolve()
    assert timed.end_us - timed.start_us == pytest.approx(timed.host_end_us - timed.host_start_us) == 5000.0
    assert timed.start_us - timed.host_start_us == pytest.approx(0.0)


def test_the_clock_follows_the_device():
    now = time.monotonic
    assert isinstance(task_clock_for(torch.device("cpu"), now), HostTaskClock)
    assert isinstance(task_clock_for("cuda", now), CudaEventTaskClock)


@pytest.mark.cuda
def test_event_spans_match_a_synchronised_timer_on_cuda():
    """A task of known device time (a matrix product loop) timed by events without synchronising, against the same
    work timed with a synchronise before and after: within 5% or 0.2 ms."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()

    def work():
        for _ in range(20):
            a @ a

    begin = time.monotonic_ns()
    work()
    torch.cuda.synchronize()
    synchronised_us = (time.monotonic_ns() - begin) / 1e3

    clock = CudaEventTaskClock(lambda: time.monotonic_ns() / 1e3)
    launch_begin = time.monotonic_ns()
    started = clock.start()
    work()
    clock.stop(started, "work")
    launch_us = (time.monotonic_ns() - launch_begin) / 1e3
    [timed] = clock.resolve()
    start, end = timed.start_us, timed.end_us
    assert abs((end - start) - synchronised_us) <= max(0.05 * synchronised_us, 200.0), \
        f"events {end - start:.0f} us, synchronised timer {synchronised_us:.0f} us, launches {launch_us:.0f} us"
