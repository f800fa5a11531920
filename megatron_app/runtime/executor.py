"""forward_backward_app: Megatron's forward_backward contract, executed by a schedule policy.

Loop per rank: take arrivals from the transport -> ask the policy -> run Megatron's forward_step/backward_step for
the task -> post its output to the transport (asynchronous) -> record trace events. When the policy has nothing to
run, block on the transport until one of this rank's awaited inputs arrives.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.core.pipeline_parallel.schedules import (
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)
from megatron_app.megatron_compat import backward_step
from megatron_app.schedule import Kind, RankState, Task
from megatron_app.schedule.iteration_plan import PipelineSpec, plan_told_microbatches

from .call_contract import MEGATRON_SCHEDULES, MegatronSchedule, apply_tensor_shape_hook, schedule_for_call
from .call_setup import CallRequest, ModelChunks, RankPlacement
from .decide_once import decide_once
from .job import AppJob, current_job
from .links import PipelineLinks, direction_of
from .next_call import CallPlan
from .split_backward import defers_weights, run_input_backward, run_weight_backward
from .task_clock import task_clock_for
from .tp_agreement import TaskAgreement


_NOT_KEYED = contextlib.nullcontext()


def _unkeyed(microbatch: int):
    """The microbatch scope of a job without keyed randomness: nothing to set."""
    return _NOT_KEYED


_CALL_MARKER = object()   # the task clock's key for the call-start marker (run())


class PipelineStallError(RuntimeError):
    """The policy can run nothing and no input is awaited: a schedule bug, reported instead of hanging."""


class _GradSync:
    """Megatron's grad-sync protocol for model chunks: no_sync during the schedule, a chunk's sync when its last
    backward on this rank is done, the remaining ones at the end (same hooks the interleaved schedule calls)."""

    def __init__(self, config, models, forward_only: bool):
        self.config = config
        self.models = models
        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            funcs = no_sync

            def no_sync():
                stack = contextlib.ExitStack()
                for func in funcs:
                    stack.enter_context(func())
                return stack

        self._no_sync_func = no_sync or contextlib.nullcontext
        self._context = None
        self._forward_only = forward_only
        grad_sync = config.grad_sync_func
        if grad_sync is not None and not isinstance(grad_sync, list):
            grad_sync = [grad_sync for _ in models]
        self._grad_sync = None if forward_only else grad_sync
        self.synchronized = set()

    def disable(self):
        if self._context is None:
            self._context = self._no_sync_func()
            self._context.__enter__()

    def enable(self):
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    @contextlib.contextmanager
    def around_last_accumulation(self, chunk: int, chunk_done: bool):
        """Around the last task of one kind (B or W) that adds a chunk's weight gradients; chunk_done: no task of any
        kind adds more. Without a grad_sync_func Megatron lets DDP's hooks reduce during a chunk's last backward:
        enabled for each kind's last task, every weight's hook registers its gradient as ready exactly once. A
        grad_sync_func runs once the chunk is done."""
        if self._grad_sync is None and not self._forward_only:
            self.enable()
            if chunk_done:
                self.synchronized.add(chunk)
            try:
                yield
            finally:
                self.disable()
        else:
            yield
            if self._grad_sync is not None and chunk_done:
                self.enable()
                self._grad_sync[chunk](self.models[chunk].parameters())
                self.synchronized.add(chunk)
                self.disable()

    def finish(self):
        self.enable()
        if self._grad_sync is not None:
            for chunk, model in enumerate(self.models):
                if chunk not in self.synchronized:
                    self._grad_sync[chunk](model.parameters())
                    self.synchronized.add(chunk)


class PipelineStep:
    """One forward_backward call on one rank."""

    def __init__(self, job: AppJob, request: CallRequest, chunks: ModelChunks, placement: RankPlacement):
        session, settings = job.session, job.settings
        self.session, self.settings = session, settings
        # Copied once per call, so the loop below reads attributes of its own.
        self.forward_step_func, self.num_microbatches = request.forward_step_func, request.num_microbatches
        self.forward_only, self.collect_non_loss_data = request.forward_only, request.collect_non_loss_data
        self.first_val_step, self.force_all_reduce = request.first_val_step, request.force_all_reduce
        self.models, self.data, self.config = chunks.models, chunks.data, chunks.config
        self.model_type, self.device = chunks.model_type, chunks.device
        self.shape, self.pp_rank, self.cp_size = placement.shape, placement.pp_rank, placement.cp_size
        self.split_backward, self.full_checkpoint = placement.split_backward, placement.full_checkpoint
        self.pg_collection = placement.pg_collection
        self._pp_group, self._pp_global = placement.pp_group, placement.pp_global
        self.installation = job.installation
        keyed = job.keyed_randomness     # dropout keyed by microbatch, whatever the order (keyed_randomness.py)
        self._microbatch_scope = _unkeyed if keyed is None else keyed.microbatch_scope
        self._keyed = keyed

        # What was planned for this call (next_call.CallPlan), whatever the policy: the plan its data iterators carry
        # (the trainer's, wrap_data_iterator's), else what a loop of its own told the job (set_microbatch_lengths,
        # agree_iteration_plan). Tokens per microbatch size activations and feed planning; an agreed plan also
        # brings its order. The documents' layout for keyed dropout comes with the data (set_microbatch_documents).
        handed = chunks.call_plan
        self.call_plan = (job.next_call.take(self.num_microbatches) if handed is None
                          else handed.check_count(self.num_microbatches))
        self.lengths = None if self.call_plan is None else self.call_plan.tokens
        self.policy, self.transport, self.tracer = session.serve_call(placement, self.forward_only,
                                                                      self.num_microbatches)
        self.state = RankState(self.shape, self.pp_rank, self.lengths)
        self.links = PipelineLinks(self.shape, self.pp_rank, self._pp_global, session.calls)
        self.agreement = TaskAgreement(placement.tp_group)
        self.iteration = job.trace_iteration(session.training_calls)   # the loop's number (set_iteration), from 1

        # This call's bookkeeping.
        V, m = self.shape.num_chunks, self.num_microbatches
        self.grad_sync = _GradSync(self.config, self.models, self.forward_only)
        self._marked: set = set()                                  # keys already reported to the state
        self._held: Dict[Tuple[int, int], list] = {}                # (chunk, mb) -> [input, output, send handle]
        self._pending_sends: List[tuple] = []
        self._stored: Dict[int, list] = {}                          # microbatch -> forward_data_store entries
        self._first_forward_done = [False] * V
        # Tasks per chunk and kind that still add weight gradients: every B; with a split backward also the W of
        # every chunk that defers (all but the first virtual stage, whose B is the whole backward).
        self._accumulations_left = {
            (kind, c): m for c in range(V) for kind in (Kind.BACKWARD, Kind.WEIGHT)
            if kind is Kind.BACKWARD or (self.split_backward and self.shape.virtual_stage(self.pp_rank, c) > 0)}
        self._pending_weights: Dict[Tuple[int, int], Any] = {}  # (chunk, mb) -> what its W needs (split backward)
        self._handlers = {Kind.FORWARD: self._run_forward, Kind.BACKWARD: self._run_backward,
                          Kind.WEIGHT: self._run_weight}
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self._run_order: List[Tuple[Task, bool]] = []               # (task, the rank waited for an input before it)
        self._spans: Dict[Task, Tuple[float, float]] = {}           # task -> its compute span (trace clock, us)
        self._waited = False
        self.task_gap_s: Optional[float] = None                   # run() sets it (training calls)
        # Compute time as the device sees it: CUDA events on a GPU (read at the pipeline's end), the host clock else.
        self.task_clock = task_clock_for(self.device, self._now)
        # When the device reached this call (a deferred clock's marker at run()'s start; None on the host clock). On
        # an H200 the previous step's optimizer was still running there: 7-19 ms of the call's host span at P=1.
        self.device_call_start_us: Optional[float] = None

    def training_call_done(self):
        if self._keyed is not None:
            self._keyed.training_call_done()

    def _adopt_plan(self) -> None:
        """Every rank of the pipeline runs the same plan, so their orders fit together (schedule/planned.py). A plan
        that came with the call (its iteration's) is adopted as it is; lengths told alone are planned now by the one
        planning function, on pipeline rank 0 within its time budget, and every rank adopts that plan."""
        call = self.call_plan
        if call is not None and call.plan is None and self.policy.orders_told_lengths:
            call = self.call_plan = self._plan_told_lengths(call)
        self.policy.use_plan(self.lengths, None if call is None else call.plan,
                             squared_tokens=None if call is None else call.squared_tokens)

    def _plan_told_lengths(self, call: CallPlan) -> CallPlan:
        session, policy = self.session, self.policy
        pipeline = PipelineSpec.of_shape(self.shape, policy.memory_factor, policy.evaluations)
        plan, seconds = decide_once(
            lambda start: plan_told_microbatches(call.tokens, pipeline, session.shared_costs(),
                                                 stop=session.planning_stop(start)),
            len(self._pp_global) > 1, self._pp_group)
        if seconds:
            session.last_planning_s = seconds
        return call.planned_by(plan)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> List[Any]:
        started = time.perf_counter()
        call_marker = self.task_clock.start() if self.task_clock.deferred else None
        host_call_start_us = None
        if self.policy.plans_iterations:      # inside run(): the trace's iteration time includes planning
            self._adopt_plan()
        self._call_start_us = self._now()     # a plan's predicted starts count from here
        self.grad_sync.disable()
        while not self.state.finished:
            self._take_arrivals()
            task = self._decide()
            if task is None:
                self._wait_for_input()
                continue
            self._run_order.append((task, self._waited))
            self._waited = False
            self._handlers[task.kind](task)
            self._reap_sends(block=False)
        self._reap_sends(block=True)
        if call_marker is not None:
            self.task_clock.stop(call_marker, _CALL_MARKER)
        for timed in self.task_clock.resolve():
            if timed.key is _CALL_MARKER:
                self.device_call_start_us, host_call_start_us = timed.start_us, timed.host_start_us
                continue
            self._task_timed(timed.key, timed.start_us, timed.end_us,
                             host_us=timed.host_end_us - timed.host_start_us,
                             queued_us=timed.start_us - timed.host_start_us)
        self.task_gap_s = None if self.forward_only else self._mean_gap_s()
        if self.task_gap_s is not None:
            self.policy.observe_gap(self.task_gap_s)
        self.grad_sync.finish()
        if not self.forward_only:   # before the data-parallel reduction, which waits for the slowest replica
            self.session.microbatches_run = max(self.session.microbatches_run, self.num_microbatches)
            # from where the device reached the call: the work queued before it (the previous step's optimizer,
            # 7-19 ms on an H200 at P=1) is the time outside the pipeline, which the prediction adds apart
            device_lag_s = (0.0 if host_call_start_us is None or self.device_call_start_us is None
                            else max(0.0, (self.device_call_start_us - host_call_start_us) / 1e6))
            self.session.record_pipeline_time(self.call_plan, time.perf_counter() - started - device_lag_s)
        if self.config.finalize_model_grads_func is not None and not self.forward_only:
            self.config.finalize_model_grads_func(
                self.models,
                self.total_num_tokens if self.config.calculate_per_token_loss else None,
                pg_collection=self.pg_collection,
                force_all_reduce=self.force_all_reduce,
            )
        return [entry for mb in sorted(self._stored) for entry in self._stored[mb]]

    def _mean_gap_s(self) -> Optional[float]:
        """The rank's mean time from one task's end to the next's start where it waited for no input in between
        (taking the input, deciding, posting the send, tracing; on a GPU the device's idle time between the two,
        about nil while the host runs ahead): the planner adds it to every task (length_costs.observe_gap)."""
        gaps = [self._spans[task][0] - self._spans[previous][1]
                for (previous, _), (task, waited) in zip(self._run_order, self._run_order[1:])
                if not waited and task in self._spans and previous in self._spans]
        return max(0.0, sum(gaps) / len(gaps)) / 1e6 if gaps else None

    def _decide(self) -> Optional[Task]:
        if self.agreement.active and not self.agreement.is_leader:
            task = self.agreement.follow()
            key = self.links.input_key(task)
            if key is not None and key not in self._marked:
                self._block_until([key])
                self._take_arrivals()
            return task
        task = self.policy.next(self.state)
        if task is not None and self.agreement.active:
            self.agreement.share(task)
        return task

    def _take_arrivals(self):
        if self.transport is None:
            return
        for key in self.transport.poll():
            task = self.links.expected.get(key)
            if task is not None and key not in self._marked:
                self._marked.add(key)
                self.state.mark_arrived(task)

    def _wait_for_input(self):
        awaited = [key for key in self.links.expected if key not in self._marked]
        if not awaited or self.transport is None:
            raise PipelineStallError(
                f"policy {self.policy.name!r} on pipeline rank {self.pp_rank} has nothing to run and awaits no "
                f"input; done {len(self.state.done_tasks)} of {len(self.shape.tasks(self.pp_rank))} tasks")
        self._block_until(awaited)

    def _block_until(self, keys):
        start = self._now()
        self.transport.wait_any(keys, timeout=self.settings.timeout_s)
        end = self._now()
        self._waited = True
        self._trace("wait", start, end)

    # ---- tasks ------------------------------------------------------------------------------------------------
    def _take_input(self, task: Task) -> Optional[torch.Tensor]:
        key = self.links.input_key(task)
        if key is not None:
            start = self._now()
            tensor = self.transport.try_recv(*key, device=self.device)
            if tensor is None:  # polled as arrived, so this is a transport fault
                raise RuntimeError(f"input of {task} from rank {key[0]} vanished after it arrived")
            self._trace("recv", start, self._now(), task, peer=key[0], nbytes=tensor.numel() * tensor.element_size())
            return tensor
        return None

    def _run_forward(self, task: Task):
        c, i = task.chunk, task.microbatch
        input_tensor = self._take_input(task)
        if input_tensor is not None:
            input_tensor.requires_grad_(not self.forward_only)
        is_last = self.shape.output_target(self.pp_rank, task) is None
        first = not self._first_forward_done[c]
        self._first_forward_done[c] = True
        store: list = []
        self.state.mark_started(task)
        started = self.task_clock.start()
        with self._microbatch_scope(i), _profiled(task):   # dropout keyed by microbatch, whatever the order
            output_tensor, num_tokens = forward_step(
                self.forward_step_func,
                None if self.data[c] is None else self.data[c].select(i),
                self.models[c],
                self.num_microbatches,
                input_tensor,
                store,
                self.config,
                self.cp_size,
                self.collect_non_loss_data,
                checkpoint_activations_microbatch=None if self.full_checkpoint is None else
                self.full_checkpoint[(c, i)],
                is_first_microbatch=check_first_val_step(self.first_val_step, self.forward_only, first),
                current_microbatch=i,
                vp_stage=c if len(self.models) > 1 else None,
                is_last_stage=is_last,
            )
        self._task_done(task, started)
        if store:
            self._stored.setdefault(i, []).extend(store)
        if is_last:
            self.total_num_tokens += num_tokens
        handle = None if is_last else self._send_output(task, output_tensor)
        if not self.forward_only:
            self._held[(c, i)] = [input_tensor, output_tensor, handle]

    def _run_backward(self, task: Task):
        c, i = task.chunk, task.microbatch
        output_grad = self._take_input(task)
        input_tensor, output_tensor, handle = self._held.pop((c, i))
        # A split backward's B needs the output's real shape (autograd.grad checks it); the memory is freed at B.
        if self.config.deallocate_pipeline_outputs and handle is not None and not self.split_backward:
            handle.wait(self.settings.timeout_s)   # the transport reads the output's memory until the send is done
            deallocate_output_tensor(output_tensor, True)
        self.state.mark_started(task)
        started = self.task_clock.start()
        with self._microbatch_scope(i), self._accumulating(task), _profiled(task):   # recomputation redraws masks
            if self.split_backward:
                deferred = defers_weights(input_tensor)
                if deferred != ((Kind.WEIGHT, c) in self._accumulations_left):
                    raise RuntimeError(f"split backward: chunk {c}'s input tensor {'requires' if deferred else 'lacks'} "
                                       f"a gradient, unlike every microbatch's at virtual stage "
                                       f"{self.shape.virtual_stage(self.pp_rank, c)}")
                input_grad, pending = run_input_backward(input_tensor, output_tensor, output_grad,
                                                         self.model_type, self.config, self.installation)
                if deferred:
                    self._pending_weights[(c, i)] = pending
            else:
                input_grad = backward_step(input_tensor, output_tensor, output_grad, self.model_type, self.config)
        self._task_done(task, started)
        if self.shape.output_target(self.pp_rank, task) is not None:
            self._send_output(task, input_grad)

    def _run_weight(self, task: Task):
        """W: the weight gradients of one chunk and microbatch, kept since its B (split_backward.py)."""
        c, i = task.chunk, task.microbatch
        # Deferred at B (even with nothing to do, e.g. an output without gradient): this W is one of the chunk's
        # accumulations, so it counts toward the grad sync. Not deferred (first virtual stage): B did everything.
        deferred = (c, i) in self._pending_weights
        pending = self._pending_weights.pop((c, i), None)
        self.state.mark_started(task)
        started = self.task_clock.start()
        with self._accumulating(task) if deferred else contextlib.nullcontext(), _profiled(task):
            run_weight_backward(pending)
        self._task_done(task, started)

    def _task_done(self, task: Task, started):
        """Mark a compute task done and time it: at once with the host clock, at the pipeline's end with events."""
        self.state.mark_done(task)
        span = self.task_clock.stop(started, task)
        if span is not None:
            self._task_timed(task, *span)

    def _task_timed(self, task: Task, start_us: float, end_us: float, **device_timed):
        """Trace a compute task's span and tell the policy its duration (the cost model learns from it). A device
        span comes with the host's time in the task (host_us) and how far the device trailed the host at its start
        (queued_us): the trace then tells a task whose time was the host's."""
        self._trace(task.kind.trace_name, start_us, end_us, task,
                    **{name: round(value, 1) for name, value in device_timed.items()})
        self._spans[task] = (start_us, end_us)
        self.policy.observe(task, (end_us - start_us) / 1e6)

    def _accumulating(self, task: Task):
        """Context for a task that adds one microbatch's weight gradients of its chunk. The last such B and the last
        such W of a chunk run inside Megatron's grad sync (_GradSync): B and W add gradients of different weights."""
        key = (task.kind, task.chunk)
        self._accumulations_left[key] -= 1
        if self._accumulations_left[key] == 0:
            chunk_done = all(left == 0 for (_, c), left in self._accumulations_left.items() if c == task.chunk)
            return self.grad_sync.around_last_accumulation(task.chunk, chunk_done)
        return contextlib.nullcontext()

    def _send_output(self, task: Task, tensor: torch.Tensor):
        peer_pp, consumer = self.links.output_route(task)
        peer, tag = self.links.key_for(consumer, peer_pp)
        data = tensor.detach()
        handle = self.transport.send(peer, tag, data)
        self._pending_sends.append((handle, self._now(), peer, data.numel() * data.element_size(), task))
        return handle

    def _reap_sends(self, block: bool):
        if not self._pending_sends:
            return
        if block:
            self.transport.wait_sends(timeout=self.settings.timeout_s)
        still = []
        for entry in self._pending_sends:
            handle, posted, peer, nbytes, task = entry
            if handle.done():
                start, end, extra = self._send_span(handle, posted)
                self._trace("send", start, end, task, peer=peer, nbytes=nbytes,
                            direction=direction_of(task).name.lower(), **extra)
            else:
                still.append(entry)
        self._pending_sends = still

    def _send_span(self, handle, posted_us: float) -> tuple:
        """A done send's traced span: posting to the completion seen here; for a device tensor, its own transfer
        (device_staging.DeviceSendHandle.transfer_span: from its data being ready on the device to its copies'
        end; on a GPU the host posts long before the producer's kernels finish), with the wait before it kept as
        queued_us."""
        now_us = self._now()
        span = getattr(handle, "transfer_span", lambda: None)()
        if span is None:
            return posted_us, now_us, {}
        offset_us = now_us - time.monotonic() * 1e6      # the trace clock is time.monotonic's plus an offset
        end_us = min(now_us, span[1] * 1e6 + offset_us)
        start_us = min(end_us, max(posted_us, span[0] * 1e6 + offset_us))
        return start_us, end_us, {"queued_us": round(start_us - posted_us, 3)}

    # ---- tracing ----------------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self.tracer.now_us() if self.tracer is not None else time.monotonic_ns() / 1e3

    def _trace(self, kind: str, start: float, end: float, task: Optional[Task] = None, **fields):
        if self.tracer is not None:
            if task is not None:
                fields["chunk"], fields["microbatch"] = task.chunk, task.microbatch
            if task is not None and kind == task.kind.trace_name:
                self._task_fields(task, fields)
            self.tracer.record(kind, start, end, iteration=self.iteration, **fields)

    def _task_fields(self, task: Task, fields: dict) -> None:
        """A compute event's extras: what it computed on (cost curves are fitted from these) and what the plan
        expected of it (its start after the call's start, and its duration)."""
        if self.lengths is not None:
            fields["tokens"] = self.lengths[task.microbatch]
            squared = None if self.call_plan is None else self.call_plan.squared_tokens
            if squared is not None:
                fields["squared_tokens"] = squared[task.microbatch]
            segments = None if self.call_plan is None else self.call_plan.document_segments
            if segments is not None:
                fields["documents"] = len(segments[task.microbatch])
        predicted = getattr(self.policy, "predicted", {}).get(task)
        if predicted is not None:
            fields["predicted_start_us"] = self._call_start_us + predicted[0] * 1e6
            fields["predicted_us"] = predicted[1] * 1e6


def _profiled(task: Task):
    """The task as a range of torch.profiler's traces and nsys's NVTX (--profile): "forward 0-3" is chunk 0's
    forward of microbatch 3, the trace's own label. Only while a profiler runs (a range costs 6 us here otherwise;
    asking costs 0.1 us)."""
    if not _profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"{task.kind.trace_name} {task.chunk}-{task.microbatch}")


_profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)   # any profiler, NVTX's too


def forward_backward_app(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
):
    """Drop-in for megatron-core's three forward_backward functions (0.16 - 0.19), same keywords and rules.

    Called directly, it refuses what the schedule function get_forward_backward_func would pick for this call
    refuses (call_contract.schedule_for_call); install() puts MEGATRON_ENTRY_POINTS in Megatron's place, each with
    the refusals of the function it replaces. Message shapes come with the messages, so seq_length /
    micro_batch_size / decoder_seq_length only feed adjust_tensor_shapes_fn, which is called where Megatron calls
    it (1F1B without interleaving). p2p_communicator's pipeline group is the one our transport connects (one
    transport per pipeline group, session.py); its own send/recv is not used. Returns the forward data store (loss
    dicts on the last stage, in microbatch order), like Megatron.
    """
    return _forward_backward(
        schedule_for_call(model, p2p_communicator, pg_collection), forward_step_func=forward_step_func,
        data_iterator=data_iterator, model=model, num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
        pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def _forward_backward(schedule: MegatronSchedule, *, forward_step_func, data_iterator, model, num_microbatches,
                      seq_length, micro_batch_size, decoder_seq_length=None, forward_only=False,
                      collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
                      p2p_communicator=None, pg_collection=None, force_all_reduce=False):
    """One call: `schedule`'s refusals in Megatron's order, then ours, then the run."""
    groups = schedule.refusals(model=model, data_iterator=data_iterator, num_microbatches=num_microbatches,
                               adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
                               pg_collection=pg_collection)
    chunks = ModelChunks(model, data_iterator)     # ours: one data iterator per chunk, ...
    if schedule.calls_shape_hook:
        apply_tensor_shape_hook(adjust_tensor_shapes_fn, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                decoder_seq_length=decoder_seq_length, config=chunks.config, tp_group=groups.tp,
                                cp_group=groups.cp)
    job = current_job()      # the one current job, handed down from here (job.py)
    request = CallRequest(forward_step_func, num_microbatches, forward_only, collect_non_loss_data, first_val_step,
                          bool(force_all_reduce))
    step = PipelineStep(job, request, chunks, RankPlacement(groups, chunks, request, job.settings.split_backward))
    session = step.session
    session.calls += 1
    if step.tracer is not None:
        session.training_calls += 1
        session.last_call_start = time.perf_counter()
        start = step.tracer.now_us()
        result = step.run()
        end = step.tracer.now_us()
        if step.device_call_start_us is not None:   # the call's span as the device saw it (task spans are too)
            start = min(max(start, step.device_call_start_us), end)
        session.last_iteration_s = (end - start) / 1e6
        gap = {} if step.task_gap_s is None else {"task_gap_us": round(step.task_gap_s * 1e6, 3)}
        step.tracer.record("iteration", start, end, iteration=step.iteration, **gap)
        step.tracer.flush()   # a crash loses at most the iteration in flight
        step.training_call_done()
        return result
    return step.run()


def _megatron_entry_point(schedule: MegatronSchedule):
    """Megatron's `schedule.name`, served by our runtime: its refusals, then our schedule (keywords only, as
    Megatron's; the signature shown is forward_backward_app's)."""

    @functools.wraps(forward_backward_app)
    def entry_point(**kwargs):
        return _forward_backward(schedule, **kwargs)

    entry_point.__name__ = entry_point.__qualname__ = schedule.name
    entry_point.__doc__ = f"megatron-core's {schedule.name}, run by megatron_app's schedule with its refusals."
    return entry_point


# What install() puts in place of each of Megatron's schedule functions, by name.
MEGATRON_ENTRY_POINTS = {schedule.name: _megatron_entry_point(schedule) for schedule in MEGATRON_SCHEDULES}
