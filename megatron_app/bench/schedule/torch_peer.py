"""torch.distributed.pipelining with the same emulated compute as megatron_app's --emulate-compute (bench side).

Each pipeline stage is a module whose forward waits the emulated forward time and whose backward waits the backward
time (megatron_app.emulation.compute.TimedScale), with durations from the same draws (emulation.spec.TaskDurations),
indexed by the same (iteration, rank, chunk, microbatch): stage rank + P*chunk is chunk `chunk` of rank `rank`, as in
Megatron's interleaving. For ScheduleInterleavedZeroBubble the backward is split into an input-gradient part and a
weight-gradient part of half the backward time each, as two autograd nodes torch's stage_backward_input/_weight can
run separately (the first stage, whose input needs no gradient, does its whole backward in the weight step, as torch
does).

Runs on CPU/gloo in the processes of worker.py. Records every compute span for bubble and memory
metrics; microbatch ids are counted per stage in forward order (every torch schedule runs a stage's forwards in
microbatch order) and carried to the backward by autograd. The first step includes torch's metadata inference and
must be a warm-up.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

from megatron_app.schedule import Kind
from megatron_app.emulation.compute import TimedScale, tokens_to_activation
from megatron_app.emulation.wait import emulated_wait
from megatron_app.emulation.spec import TaskDurations
from megatron_app.sim.network import SlowLink

SCHEDULES = {
    "torch-1F1B": Schedule1F1B,
    "torch-Interleaved1F1B": ScheduleInterleaved1F1B,
    "torch-InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
}
SPLIT_BACKWARD = {"torch-InterleavedZeroBubble"}


class SpanRecorder:
    """Compute spans of one rank: (iteration, kind, chunk, microbatch, start_s, end_s); kind is forward, backward,
    backward_input or backward_weight."""

    def __init__(self):
        self.spans: List[tuple] = []

    def callback(self, iteration: int, kind: str, chunk: int, microbatch: int) -> Callable[[float, float], None]:
        return lambda start, end: self.spans.append((iteration, kind, chunk, microbatch, start, end))


class _InputGradWait(torch.autograd.Function):
    """Identity whose backward (the input-gradient part) waits."""

    @staticmethod
    def forward(ctx, x, seconds: float, on_backward):
        ctx.seconds, ctx.on_backward = seconds, on_backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        start = time.monotonic()
        emulated_wait(ctx.seconds)
        ctx.on_backward(start, time.monotonic())
        return grad, None, None


class _WeightGradWait(torch.autograd.Function):
    """detached_x * weight whose backward (the weight-gradient part) waits."""

    @staticmethod
    def forward(ctx, weight, detached_x, seconds: float, on_backward):
        ctx.seconds, ctx.on_backward = seconds, on_backward
        ctx.save_for_backward(detached_x)
        return detached_x * weight

    @staticmethod
    def backward(ctx, grad):
        start = time.monotonic()
        (x,) = ctx.saved_tensors
        emulated_wait(ctx.seconds)
        grad_weight = (grad * x).sum(dim=tuple(range(grad.dim() - 1)))
        ctx.on_backward(start, time.monotonic())
        return grad_weight, None, None, None


class EmulatedStage(torch.nn.Module):
    def __init__(self, durations: TaskDurations, rank: int, chunk: int, first: bool, split_backward: bool,
                 hidden_size: int, vocab_size: int, recorder: SpanRecorder):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.durations, self.rank, self.chunk, self.first = durations, rank, chunk, first
        self.split_backward, self.hidden_size, self.vocab_size = split_backward, hidden_size, vocab_size
        self.recorder = recorder
        self.iteration = 0
        self._next_microbatch = 0

    def begin_iteration(self, iteration: int) -> None:
        self.iteration, self._next_microbatch = iteration, 0

    def forward(self, x):
        start = time.monotonic()
        # The first step also runs torch's metadata inference (one extra forward and backward per stage), so its
        # count is off by one: modulo keeps it in range; that step is a warm-up and never measured.
        microbatch = self._next_microbatch % self.durations.shape.num_microbatches
        self._next_microbatch += 1
        if self.first:
            x = tokens_to_activation(x, self.hidden_size, self.vocab_size)
        forward_s = self.durations.seconds(self.iteration, self.rank, Kind.FORWARD, self.chunk, microbatch)
        # a split shape's table holds B and W apart (the first stage's backward is both, as in our runtime)
        input_s = self.durations.seconds(self.iteration, self.rank, Kind.BACKWARD, self.chunk, microbatch)
        weight_s = self.durations.seconds(self.iteration, self.rank, Kind.WEIGHT, self.chunk, microbatch)
        backward_s = input_s + weight_s
        record = self.recorder.callback
        if not self.split_backward:
            y = TimedScale.apply(x, self.weight, forward_s, backward_s, 0.0,
                                 record(self.iteration, "backward", self.chunk, microbatch))
        else:
            emulated_wait(forward_s)
            weight_s = backward_s if self.first else weight_s
            y = _WeightGradWait.apply(self.weight, x.detach(), weight_s,
                                      record(self.iteration, "backward_weight", self.chunk, microbatch))
            if not self.first:
                y = y + _InputGradWait.apply(x, backward_s - weight_s,
                                             record(self.iteration, "backward_input", self.chunk, microbatch))
        self.recorder.spans.append((self.iteration, "forward", self.chunk, microbatch, start, time.monotonic()))
        return y


class _DelayedWork:
    def __init__(self):
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

    def wait(self, timeout=None):
        self._done.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class DelayedIsend:
    """torch.distributed.isend with the slow-link rule of megatron_app.emulation.link_delay: a send on the slow link
    posted inside the window is issued DELAY later by a per-link thread (FIFO), without blocking the sender."""

    def __init__(self, spec: SlowLink, rank: int):
        self.spec, self.rank = spec, rank
        self.original = c10d.isend
        self.iteration_start = time.monotonic()
        self._queues: Dict[int, queue.Queue] = {}
        self._last_due: Dict[int, float] = {}
        self._pending: Dict[int, int] = {}
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []

    def __call__(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        peer = dst if dst is not None else dist.get_global_rank(group or c10d._get_default_group(), group_dst)
        now = time.monotonic()
        delay = self.spec.delay_at_us(self.rank, peer, (now - self.iteration_start) * 1e6) / 1e6
        with self._lock:
            pending = self._pending.get(peer, 0)
            if delay <= 0 and pending == 0:
                return self.original(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
            due = max(now + delay, self._last_due.get(peer, now))
            self._last_due[peer] = due
            self._pending[peer] = pending + 1
        work = _DelayedWork()
        self._queue(peer).put((due, tensor, dict(dst=dst, group=group, tag=tag, group_dst=group_dst), work))
        return work

    def _queue(self, peer: int) -> queue.Queue:
        if peer not in self._queues:
            self._queues[peer] = queue.Queue()
            thread = threading.Thread(target=self._drain, args=(peer,), daemon=True, name=f"slow-link-{peer}")
            thread.start()
            self._threads.append(thread)
        return self._queues[peer]

    def _drain(self, peer: int) -> None:
        while True:
            item = self._queues[peer].get()
            if item is None:
                return
            due, tensor, kwargs, work = item
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                self.original(tensor, **kwargs).wait()
            except BaseException as exc:   # handed to the waiting schedule
                work.error = exc
            with self._lock:
                self._pending[peer] -= 1
            work._done.set()

    def install(self) -> None:
        # stage.py builds P2POp(dist.isend, ...); batch_isend_irecv checks the op against c10d.isend: patch both.
        c10d.isend = dist.isend = self

    def uninstall(self) -> None:
        c10d.isend = dist.isend = self.original
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()


def run_torch_schedule(run: dict, durations: TaskDurations, recorder: SpanRecorder) -> List[tuple]:
    """Run `run['iterations']` steps of a torch schedule; returns this rank's (start, end) monotonic seconds of
    each schedule.step (steps are separated by a barrier, like megatron_app's emulated trainer)."""
    rank, P = dist.get_rank(), dist.get_world_size()
    V, m, mbs = run["model_chunks"], run["microbatches"], run["micro_batch_size"]
    seq, hidden, vocab = run["seq_length"], run["hidden_size"], run["vocab_size"]
    name = run["schedule"]
    split = name in SPLIT_BACKWARD
    modules, stages = [], []
    for chunk in range(V):
        index = rank + P * chunk
        module = EmulatedStage(durations, rank, chunk, index == 0, split, hidden, vocab, recorder)
        modules.append(module)
        stages.append(PipelineStage(module, index, P * V, torch.device("cpu")))
    schedule_class = SCHEDULES[name]
    loss_fn = lambda output, target: output.pow(2).mean()   # noqa: E731 - the last stage's "loss"
    schedule = schedule_class(stages[0] if V == 1 else stages, m, loss_fn=loss_fn)
    delayed = None
    if run.get("slow_link"):
        delayed = DelayedIsend(SlowLink.parse_delay(run["slow_link"]), rank)
        delayed.install()
    tokens = torch.arange(m * mbs * seq).view(m * mbs, seq) % vocab
    target = torch.zeros(m * mbs, seq, hidden)
    last = rank == P - 1   # holds the last stage for every placement used here
    steps = []
    try:
        dist.barrier()
        for iteration in range(run["iterations"]):
            for module in modules:
                module.begin_iteration(iteration)
            if delayed is not None:
                delayed.iteration_start = time.monotonic()
            for module in modules:
                module.zero_grad(set_to_none=True)
            args = (tokens,) if rank == 0 else ()
            kwargs = {"target": target, "losses": []} if last else {}
            start = time.monotonic()
            schedule.step(*args, **kwargs)
            steps.append((start, time.monotonic()))
            dist.barrier()
    finally:
        if delayed is not None:
            delayed.uninstall()
    return steps
