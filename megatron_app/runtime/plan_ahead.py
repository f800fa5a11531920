"""Planning an iteration ahead: the next global batch's plan made in a worker process while this one trains.

Only the rank that decides plans (runtime/composition.py). It hands the worker the next iteration's request with
the costs and replica speeds it knows now (one iteration stale is fine: they change slowly), and at the next call
adopts the result if it is ready and was made for that same global batch; otherwise it plans in line as before (the
plan is late, or the batch differs). A process, not a thread: the planner is Python that would hold the GIL the
training loop needs. spawn, not fork: the parent holds gloo's threads and sockets.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from dataclasses import replace
from typing import Optional, Tuple

from megatron_app.schedule.iteration_plan import IterationPlan, PlanRequest, plan_iteration


def _plan_in_worker(request: PlanRequest, costs) -> Tuple[IterationPlan, float]:
    import time

    started = time.process_time()
    plan = plan_iteration(request, costs)
    return plan, time.process_time() - started


def _batch_key(request: PlanRequest) -> PlanRequest:
    """What must match for an early plan to serve a call: everything but the speeds, the model's error and the
    microbatches run (they may be a call stale)."""
    return replace(request, replica_speeds=None, min_gain=0.0, microbatches_run=None)


class PlanAhead:
    def __init__(self):
        self._pool: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self._pending: Optional[Tuple[PlanRequest, concurrent.futures.Future]] = None
        self.adopted = 0
        self.late = 0

    def submit(self, request: PlanRequest, costs) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        if self._pending is not None:
            self._pending[1].cancel()
        self._pending = (_batch_key(request), self._pool.submit(_plan_in_worker, request, costs))

    def take(self, request: PlanRequest) -> Optional[Tuple[IterationPlan, float]]:
        """(plan, the worker's planning CPU seconds) made early for this request's batch, if ready; else None (and
        a late plan is dropped)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != _batch_key(request):
            return None
        key, future = pending
        if not future.done():
            future.cancel()
            self.late += 1
            return None
        self.adopted += 1
        return future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._pending = None
