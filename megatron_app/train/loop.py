"""The training loop: build everything once, then iterate forward_backward + optimizer step."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_app.lossy.training import start_loss_layer
from megatron_app.runtime import enable_keyed_randomness, set_iteration
from megatron_app.runtime import add_transport_wrapper, current_tracer, remove_transport_wrapper
from megatron_app.runtime.peer_gone import peer_behind
from megatron_app.devices import local_device
from megatron_app.runtime.layout import data_parallel_rank
from megatron_app.trace.runs import LATEST

from .flags import completed, writes_traces
from .checkpoint import load_checkpoint, save_checkpoint
from .composed_data import compose_global_batch
from .data import build_data_iterators, build_datasets, global_batch_tokens, microbatch_lengths
from .dumps import dump_grads, dump_weights
from .forward_backward import (close_schedule, optimizer_span, runtime_settings,
                               select_forward_backward_func, with_told_lengths)
from .init import init_distributed, init_model_parallel, seed_all, shutdown
from .model import build_model_chunks
from .lr_schedule import build_scheduler, current_lr, varies_lr
from .optim import AdamSettings, MixedPrecision, finalize_model_grads
from .optimizer_choice import build_optimizer
from .evaluate import evaluate
from .report import IterationReporter, is_reporting_rank, reduce_lm_loss
from .start_gate import wait_for_start_gate
from .startup import EndingClock, StartupClock
from .tensorboard_scalars import TensorBoardScalars, tensorboard_importable
from .step import forward_step
from .stops import (ExitSignal, any_rank, check_finite, ctrl_c_seen, interrupt_follows, interrupted,
                    raise_once_on_ctrl_c)
from .gc_trace import CollectionTracer
from .manual_gc import ManualCollector
from .memory_report import IterationMemory
from .profiling import StepProfiler
from .trace_run import start_trace_run

_RUN_CONFIG_KEYS = (
    "pipeline_parallel", "model_chunks", "tensor_parallel", "data_parallel", "world_size",
    "num_microbatches", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
    "micro_batch_size", "global_batch_size", "iters", "seed", "lr", "lr_decay_style", "clip_grad", "weight_decay",
    "hidden_dropout", "attention_dropout", "untie_embeddings_and_output_weights", "use_distributed_optimizer",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "schedule", "policy", "device", "precision",
    "data_path", "variable_seq_lengths", "composition", "calculate_per_token_loss", "split", "eval_interval", "eval_iters", "save",
    "save_interval", "load", "start_iteration",
)


def run_config(args) -> dict:
    values = vars(completed(args))
    return {key: values.get(key) for key in _RUN_CONFIG_KEYS}


@dataclass
class Trainer:
    args: object
    chunks: List[torch.nn.Module]
    optimizer: object               # optim.Fp32Optimizer, MixedPrecisionOptimizer or DistributedOptimizer
    scheduler: object               # lr_schedule's (Megatron-Core's OptimizerParamScheduler)
    data_iterator: object  # one iterator, or one per chunk when V > 1
    forward_backward: Callable
    reporter: IterationReporter
    valid_dataset: object = None    # None: no evaluation
    start_iteration: int = 0        # iterations already done (from a checkpoint)
    forward_step_func: Callable = forward_step
    emulation: object = None        # a ComputeEmulation under --emulate-compute
    train_dataset: object = None    # where each microbatch's length comes from (None under emulation)
    dp_rank: int = 0
    saved_iteration: Optional[int] = None   # the newest checkpoint's iteration (--load's, or this run's last save)
    last_plan: object = None        # the last composed iteration's IterationPlan (None when not composing)
    stop_on_nonfinite: bool = False  # --check-for-nan-in-loss-and-grad
    plan_ahead: bool = False        # --plan-ahead: plan each next global batch while this one trains
    last_lr: Optional[float] = None  # the learning rate of the last step
    trace_dir: Optional[Path] = None  # this run's trace directory (None: no traces)
    run_started_s: Optional[float] = None  # time.monotonic() when the run began (--exit-duration-in-mins)
    exit_signal: Optional[ExitSignal] = None  # --exit-signal-handler's

    @property
    def composes(self) -> bool:
        """Variable-length documents: each global batch's microbatches come from a composition (composed_data.py);
        emulated compute composes its own."""
        return bool(self.args.variable_seq_lengths) and self.emulation is None


def _resume(args, chunks, optimizer, scheduler) -> Tuple[int, str]:
    """Load --load's checkpoint into the model, optimizer and learning-rate schedule; returns (iteration reached,
    note for the user)."""
    if not args.load:
        return 0, ""
    found, rng_restored = load_checkpoint(args.load, args, chunks, optimizer, scheduler)
    if found is None:
        return 0, f"no checkpoint in {args.load} yet: starting from iteration 0"
    note = f"resumed from {found.directory} (iteration {found.iteration}, {found.consumed_samples} samples)"
    if not rng_restored:
        note += f"; data_parallel changed from {found.manifest['layout']['data_parallel']}, RNG streams re-seeded"
    return found.iteration, note


def build_trainer(args, startup: Optional[StartupClock] = None) -> Trainer:
    """Model chunks, optimizer (restored from --load when given), data and schedule; process groups must exist.
    ``startup`` is told the end of each part (startup.TRAINER_PARTS)."""
    mark_part = startup.mark_part if startup is not None else (lambda part: None)
    seed_all(args.seed, args.device)
    emulation = None
    if args.emulate_compute is not None:
        from .emulation import ComputeEmulation

        emulation = ComputeEmulation.from_args(args)
    chunks = build_model_chunks(args) if emulation is None else emulation.build_chunks()
    if emulation is None and (args.hidden_dropout or args.attention_dropout):
        enable_keyed_randomness(chunks, args.seed)   # the same masks under every schedule, P and V
    mark_part("model")
    chunks[0].config.finalize_model_grads_func = finalize_model_grads  # shared by all chunks
    optimizer = build_optimizer(chunks, AdamSettings.from_args(args),
                                None if emulation is not None else MixedPrecision.from_args(args),
                                distributed=args.use_distributed_optimizer)
    scheduler = build_scheduler(optimizer, args)
    start_iteration, resume_note = _resume(args, chunks, optimizer, scheduler)
    args.start_iteration = start_iteration
    mark_part("optimizer")
    train_dataset, dp_rank = None, data_parallel_rank()
    if emulation is None:
        train_dataset, valid_dataset = build_datasets(args)
        data_iterator = None if args.variable_seq_lengths else build_data_iterators(
            args, args.model_chunks, dp_rank,
            consumed_samples=start_iteration * args.global_batch_size, dataset=train_dataset)
    else:
        valid_dataset, data_iterator = None, emulation.data_iterators()
    mark_part("data")
    trace_dir = start_trace_run(args.trace_dir) if writes_traces(args) else None   # else no run directory
    forward_backward = select_forward_backward_func(runtime_settings(args, trace_dir), args.device)
    scalars = None
    if args.tensorboard_dir and is_reporting_rank():   # the iteration lines' numbers, from the rank that prints them
        if tensorboard_importable():
            scalars = TensorBoardScalars.open(args.tensorboard_dir, args.global_batch_size,
                                              emulated=emulation is not None)
        else:   # validate() let the profiler's traces go there alone
            _say(getattr(args, "tensorboard_scalars_note", "tensorboard is not installed: no scalars are written"))
    reporter = IterationReporter(run_config(args), args.iters, args.global_batch_size * args.seq_length,
                                 args.log_json, emulated=emulation is not None, shows_lr=varies_lr(args),
                                 log_interval=args.log_interval, scalars=scalars)
    if resume_note:
        reporter.note(resume_note)
    if hasattr(optimizer, "describe"):
        reporter.note(optimizer.describe())
    if trace_dir is not None:
        reporter.note(f"traces: {trace_dir} ({Path(args.trace_dir) / LATEST} points there)")
    mark_part("runtime")
    return Trainer(args, chunks, optimizer, scheduler, data_iterator, forward_backward, reporter, valid_dataset,
                   start_iteration,
                   forward_step_func=forward_step if emulation is None else emulation.forward_step,
                   emulation=emulation, train_dataset=train_dataset,
                   dp_rank=dp_rank,
                   saved_iteration=start_iteration or None,
                   stop_on_nonfinite=args.check_for_nan_in_loss_and_grad, plan_ahead=args.plan_ahead,
                   trace_dir=trace_dir)


def train_step(trainer: Trainer, iteration: int) -> Optional[float]:
    """One iteration (1-based); returns the global-batch loss on the last stage, None elsewhere."""
    args = trainer.args
    trainer.optimizer.zero_grad(set_to_none=True)
    set_iteration(iteration)   # this step's dropout keys and its trace iteration: the log's number, from 1
    data_iterator, num_microbatches = trainer.data_iterator, args.num_microbatches
    forward_step_func = trainer.forward_step_func
    first_sample = (iteration - 1) * args.global_batch_size
    if trainer.emulation is not None:
        num_microbatches, data_iterator = trainer.emulation.begin_iteration(iteration - 1, data_iterator)
    elif trainer.composes:   # the composition's microbatches; their iterators carry the call's plan
        composed = compose_global_batch(args, trainer.train_dataset, trainer.dp_rank, first_sample, args.model_chunks,
                                        plan_ahead=trainer.plan_ahead and iteration < args.iters)
        data_iterator, num_microbatches = composed.data_iterator, composed.num_microbatches
        forward_step_func = composed.forward_step_func
        trainer.last_plan = composed.plan
    else:
        data_iterator = with_told_lengths(args.schedule, data_iterator,
                                          microbatch_lengths(args, trainer.train_dataset, trainer.dp_rank,
                                                             first_sample))
    losses_reduced = trainer.forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=trainer.chunks,
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=False,
    )
    if iteration == 1 and args.dump_grads:
        dump_grads(trainer.chunks, args.dump_grads)
    loss = reduce_lm_loss(losses_reduced)
    if trainer.stop_on_nonfinite:
        # all ranks stop here together, or none; under a loss scale an overflow skips the step instead (Megatron's)
        check_finite(iteration, loss, trainer.chunks, args.device,
                     gradients=getattr(trainer.optimizer, "grad_scaler", None) is None)
    trainer.last_lr = current_lr(trainer.scheduler)
    with optimizer_span(args.schedule, iteration):
        if trainer.optimizer.step():   # Megatron-LM: the schedule advances by the global batch after a step taken
            trainer.scheduler.step(increment=args.global_batch_size)
    if trainer.emulation is not None:
        trainer.emulation.end_iteration()
    return loss


def _due(iteration: int, interval: Optional[int]) -> bool:
    return bool(interval) and iteration % interval == 0


def after_iteration(trainer: Trainer, iteration: int, collector: Optional[ManualCollector] = None) -> bool:
    """Evaluation and checkpointing after ``iteration``; returns False when the run should stop here."""
    args = trainer.args
    if trainer.valid_dataset is not None and _due(iteration, args.eval_interval):
        with collector.evaluation() if collector is not None else contextlib.nullcontext():
            loss = evaluate(args, trainer.chunks, trainer.forward_backward, trainer.valid_dataset)
        trainer.reporter.record_validation(iteration, loss)
    stop = _due(iteration, args.exit_interval)
    why = f"--exit-interval {args.exit_interval}"
    reasons = []   # (this rank's flag, why) of the stops every rank must agree on
    if args.exit_duration_in_mins is not None:
        minutes = (time.monotonic() - trainer.run_started_s) / 60.0
        reasons.append((minutes >= args.exit_duration_in_mins, f"--exit-duration-in-mins "
                        f"{args.exit_duration_in_mins:g}: {minutes:.2f} minutes since the run began"))
    if trainer.exit_signal is not None:
        reasons.append((trainer.exit_signal.received, "--exit-signal-handler: SIGTERM received"))
    if not stop and reasons:
        agreed = [text for (_, text), seen in zip(reasons, any_rank(*(flag for flag, _ in reasons))) if seen]
        stop, why = bool(agreed), agreed[0] if agreed else why
    if stop:
        trainer.reporter.flush()   # the --log-interval line of the iterations up to here comes first
    save_dir = args.save
    if save_dir and (_due(iteration, args.save_interval) or stop or iteration == args.iters):
        directory = save_checkpoint(save_dir, args, trainer.chunks, trainer.optimizer, trainer.scheduler, iteration,
                                    iteration * args.global_batch_size)
        trainer.saved_iteration = iteration
        trainer.reporter.note(f"saved checkpoint {directory}")
    if stop and iteration < args.iters:
        trainer.reporter.note(f"stopping after iteration {iteration} ({why})")
    if collector is not None and not stop:   # last, as Megatron-LM: after evaluation and the checkpoint
        collector.after_iteration(iteration)
    return not stop


def _trace_memory(iteration: int, from_ns: int, peak_mib: float, measure: str) -> None:
    """The iteration's peak into this rank's trace: a `memory` event over what it measured (the iteration's start
    to after its optimizer step)."""
    from megatron_app.trace.schema import MEMORY

    tracer = current_tracer()
    if tracer is not None and tracer.enabled:
        tracer.record(MEMORY, tracer.us_of(from_ns), tracer.us_of(time.monotonic_ns()), iteration=iteration,
                      peak_mib=round(peak_mib, 1), measure=measure)


def _memory_line(memory: IterationMemory, iteration: int, peak_mib: float) -> Optional[str]:
    """The first iteration's peak, from one rank of each pipeline stage (tensor and data-parallel rank 0), as
    Megatron-LM reports it."""
    from megatron.core import parallel_state

    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return memory.describe(iteration, peak_mib, 0, None)
    if parallel_state.get_tensor_model_parallel_rank() != 0 or parallel_state.get_data_parallel_rank() != 0:
        return None
    return memory.describe(iteration, peak_mib, dist.get_rank(), parallel_state.get_pipeline_model_parallel_rank())


def _say(line: Optional[str]) -> None:
    if line:
        print(line, flush=True)


def train(args) -> None:
    """Run iterations start+1 .. ``args.iters`` on this rank (one process per rank, launched by torchrun);
    start is 0, or the iteration of the checkpoint ``--load`` names.

    ``args`` comes from args.parse_args. An existing default process group is used and left open.
    """
    startup = StartupClock()
    startup.mark("imports")
    if wait_for_start_gate():
        startup.mark("gate")
    owns_process_group = not dist.is_initialized()
    restore_ctrl_c = raise_once_on_ctrl_c()
    exit_signal = ExitSignal().install() if args.exit_signal_handler else None
    earlier_ctrl_c = ctrl_c_seen()   # a process that trains twice: only this call's Ctrl-C stops it
    run_started_s = time.monotonic()   # after the start gate: a run waiting its turn has not begun
    try:
        init_distributed(args.device, args.distributed_timeout_minutes)
    except BaseException:   # before the try below: its clean-up would not put the handlers back
        restore_ctrl_c()
        if exit_signal is not None:
            exit_signal.restore()
        raise
    startup.mark("process_group")
    trainer = None
    loss_layer = None
    profiler = None
    gc_events = None
    collector = None
    iteration = None
    ending = None
    try:
        init_model_parallel(args.tensor_parallel, args.pipeline_parallel, args.model_chunks, args.device,
                            args.distributed_timeout_minutes)
        startup.mark("model_parallel")
        trainer = build_trainer(args, startup)
        trainer.run_started_s = run_started_s
        trainer.exit_signal = exit_signal
        startup.mark("trainer")
        trainer.reporter.record_startup(startup.report())
        loss_layer = start_loss_layer(args, dist.get_rank())  # before the first step creates the transport
        if loss_layer is not None:
            add_transport_wrapper(loss_layer.wrap_transport)
        if trainer.reporter.enabled:
            print("megatron_app.train: " + " ".join(f"{k}={v}" for k, v in run_config(args).items()), flush=True)
        profiler = StepProfiler.from_args(args, dist.get_rank(), trainer.trace_dir)
        behind = None if profiler is None else profiler.resumed_at(trainer.start_iteration)
        if behind is not None:
            _say(behind)
            profiler = None
        ending = EndingClock()
        gc_events = CollectionTracer().start() if trainer.trace_dir is not None else None
        collector = ManualCollector.from_args(args)
        if collector is not None:
            collector.start()
        memory = IterationMemory(local_device(args.device))
        for iteration in range(trainer.start_iteration + 1, args.iters + 1):
            if gc_events is not None:
                gc_events.iteration = iteration
            if profiler is not None:    # before the iteration's clock: its line times the profiled work
                _say(profiler.before(iteration))
            memory.begin()
            memory_from_ns = time.monotonic_ns()   # the tracer may not exist yet: the first call makes it
            start = time.perf_counter()
            loss = train_step(trainer, iteration)
            seconds = time.perf_counter() - start
            peak_mib = memory.peak_mib()
            _trace_memory(iteration, memory_from_ns, peak_mib, memory.measure)
            if iteration == trainer.start_iteration + 1:
                _say(_memory_line(memory, iteration, peak_mib))
            tokens = None if trainer.emulation is not None or not trainer.reporter.enabled else global_batch_tokens(
                args, trainer.train_dataset, (iteration - 1) * args.global_batch_size)
            composed = trainer.emulation.composition_report(iteration - 1) if trainer.emulation is not None else \
                None if trainer.last_plan is None else trainer.last_plan.report(trainer.dp_rank)
            trainer.reporter.record(iteration, loss, seconds, tokens, composed,
                                    {"lr": trainer.last_lr, **trainer.optimizer.report(),
                                     "peak_memory_mib": round(peak_mib, 1)})
            if loss_layer is not None:
                loss_layer.end_iteration(iteration, current_tracer())
            if profiler is not None:
                _say(profiler.after(iteration))
            if not after_iteration(trainer, iteration, collector):
                break
            if gc_events is not None:
                gc_events.record()
            if ctrl_c_seen() and not earlier_ctrl_c:   # one whose KeyboardInterrupt a gc callback swallowed
                raise KeyboardInterrupt
        trainer.reporter.flush()   # a run stopped inside a --log-interval (--exit-interval) shows its last ones
        trainer.reporter.close()   # --tensorboard-dir's scalars: a failure to close is the run's error
        if profiler is not None and profiler.running:   # stopped inside the range: what was recorded, not what follows
            _say(profiler.finish(iteration))
        if args.dump_weights:
            dump_weights(trainer.chunks, args.dump_weights)
    except (Exception, KeyboardInterrupt) as error:   # Ctrl-C, or a peer gone just before this rank's own Ctrl-C
        # This rank's own Ctrl-C may land anywhere in here (it is often pending when a peer's exit broke a
        # collective): whenever it comes, the run was interrupted.
        try:
            by_ctrl_c = isinstance(error, KeyboardInterrupt) or interrupt_follows(error)
            named = None if by_ctrl_c else peer_behind(error)
        except KeyboardInterrupt:
            by_ctrl_c, named = True, None
        if not by_ctrl_c:
            if named is not None:
                raise named from None
            raise
        report = trainer.reporter.enabled if trainer is not None else dist.get_rank() == 0
        raise interrupted(iteration, args.iters, args.save,
                          trainer.saved_iteration if trainer is not None else None, report) from None
    finally:
        if collector is not None:
            collector.stop()
        if gc_events is not None:
            gc_events.stop()
        if profiler is not None and profiler.running:   # an error inside the range: write what was recorded
            _say(profiler.finish(iteration))
        if ending is not None:
            ending.mark("loop")
        if loss_layer is not None:
            remove_transport_wrapper(loss_layer.wrap_transport)
            loss_layer.close()
        if trainer is not None:
            with contextlib.suppress(Exception):   # after an error: each iteration's scalars were flushed already
                trainer.reporter.close()
            if trainer.emulation is not None:
                trainer.emulation.close()
            close_schedule(args.schedule)
        if ending is not None:
            ending.mark("closing")
        shutdown(destroy_process_group=owns_process_group)
        if ending is not None and sys.exc_info()[0] is None:   # not while an error propagates: a write would hide it
            ending.mark("process_group")
            trainer.reporter.record_ending(ending.report())
        restore_ctrl_c()
        if exit_signal is not None:
            exit_signal.restore()
