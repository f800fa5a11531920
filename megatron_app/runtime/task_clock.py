"""When a compute task ran: the host clock on CPU, CUDA events on the compute stream on a GPU.

On a GPU, forward_step and backward_step return once their kernels are queued: the host clock between them measures
launches, not compute. ``CudaEventTaskClock`` records an event on the current stream before and after each task,
adds no synchronisation, and reads the events once at the end of the call's pipeline (``resolve``), where it places
them on the host clock through one final event: the host reads the clock as soon as that event completes, so the
event's GPU time is that reading, and every other event's time is the reading minus its elapsed time to it.

Both clocks share one interface: ``start()`` before a task, ``stop(started)`` after it; a clock whose ``deferred`` is
False returns the task's (start_us, end_us) from stop() at once, a deferred one returns None and hands every span of
the call over from ``resolve()``, each with the host's own span of the task (from start() to stop(): its launches,
and whatever else the host did meanwhile): a device span about as long as the host's was the host's time, not the
device's (a launch-bound task, or a host stall inside it).
"""

from __future__ import annotations

from typing import Callable, Hashable, List, NamedTuple, Optional, Tuple

import torch

Span = Tuple[float, float]


class TimedTask(NamedTuple):
    """A deferred clock's answer for one task: its device span and the host's span of it, on the host clock."""
    key: Hashable
    start_us: float
    end_us: float
    host_start_us: float
    host_end_us: float


class HostTaskClock:
    """The host's clock (microseconds, the tracer's): exact where compute runs on the calling thread (CPU)."""

    deferred = False

    def __init__(self, now_us: Callable[[], float]):
        self._now_us = now_us

    def start(self) -> float:
        return self._now_us()

    def stop(self, started: float, key: Hashable = None) -> Optional[Span]:
        return started, self._now_us()

    def resolve(self) -> List[TimedTask]:
        return []


class CudaEventTaskClock:
    """CUDA events around each task on the current stream; times read once, at resolve()."""

    deferred = True

    def __init__(self, now_us: Callable[[], float], event_factory: Callable[[], object] = None):
        self._now_us = now_us
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._pending: List[Tuple[Hashable, object, object, float, float]] = []

    def start(self):
        event = self._event()
        event.record()
        return event, self._now_us()

    def stop(self, started, key: Hashable = None) -> Optional[Span]:
        ended = self._event()
        ended.record()
        event, host_start_us = started
        self._pending.append((key, event, ended, host_start_us, self._now_us()))
        return None

    def resolve(self) -> List[TimedTask]:
        """Every task since the last resolve, on the host clock. Waits for the stream to reach the last task's end
        (the call's pipeline is over then anyway)."""
        if not self._pending:
            return []
        final = self._event()
        final.record()
        final.synchronize()
        final_us = self._now_us()
        spans = [TimedTask(key, final_us - started.elapsed_time(final) * 1e3, final_us - ended.elapsed_time(final) * 1e3,
                           host_start_us, host_end_us)
                 for key, started, ended, host_start_us, host_end_us in self._pending]
        self._pending = []
        return spans


def task_clock_for(device: torch.device, now_us: Callable[[], float]):
    """The clock that measures compute on ``device``: CUDA events on a CUDA device, the host clock elsewhere."""
    if torch.device(device).type == "cuda":
        return CudaEventTaskClock(now_us)
    return HostTaskClock(now_us)
