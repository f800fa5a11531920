"""Megatron-LM's --manual-gc: Python's cyclic garbage collector does not run by itself while training; it collects
before the first iteration, after every --manual-gc-interval-th (0: never between iterations) and around each
evaluation (fully before, the young generation after; --no-manual-gc-eval: neither). Every rank then collects at
the same points, between iterations, instead of wherever a threshold falls: inside one rank's task, which the
pipeline waits for. Collections are outside the iterations' clocks; the trace records them (gc_trace.py).
"""

from __future__ import annotations

import contextlib
import gc


class ManualCollector:
    def __init__(self, interval: int, around_evaluation: bool):
        self.interval, self.around_evaluation = interval, around_evaluation
        self._was_enabled = False

    @classmethod
    def from_args(cls, args):
        return cls(args.manual_gc_interval, args.manual_gc_eval) if args.manual_gc else None

    def start(self) -> "ManualCollector":
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        return self

    def after_iteration(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self):
        if self.around_evaluation:
            gc.collect()
        yield
        if self.around_evaluation:
            gc.collect(generation=0)   # what the evaluation made and dropped

    def stop(self) -> None:
        """The collector as it was before start() (a caller that trains in its own process keeps its policy)."""
        if self._was_enabled:
            gc.enable()
