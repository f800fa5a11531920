"""The learning rate and weight decay of every iteration: Megatron-Core's OptimizerParamScheduler, counted in samples
as Megatron-LM counts them (warm-up and decay of N iterations are N x --global-batch-size samples; the schedule
advances by the global batch after each step taken, not after one skipped for an fp16 overflow).

A checkpoint keeps the scheduler's state, and its manifest the schedule's flags: resuming with other learning-rate
flags is refused in one line before any rank starts (Megatron-LM asserts), unless --override-opt-param-scheduler takes
this run's flags or --use-checkpoint-opt-param-scheduler the checkpoint's; a checkpoint from before schedules were
saved resumes at its consumed samples.
"""

from __future__ import annotations

from typing import Optional, Tuple

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from .flags import completed, lr_schedule_samples


def schedule_samples(args) -> Tuple[float, int]:
    """(warm-up, decay) in samples, as Megatron-LM derives them (from iterations and the global batch, or given in
    samples under --train-samples)."""
    warmup, decay, _, _ = lr_schedule_samples(args)
    return warmup, decay


def start_weight_decay(args) -> float:
    """The weight decay of the first step: --weight-decay, or --start-weight-decay under an increasing style."""
    args = completed(args)
    return args.weight_decay if args.weight_decay_incr_style == "constant" else args.start_weight_decay


def end_weight_decay(args) -> float:
    args = completed(args)
    return args.weight_decay if args.weight_decay_incr_style == "constant" else args.end_weight_decay


def build_scheduler(optimizer, args) -> OptimizerParamScheduler:
    """Sets every parameter group's lr and weight_decay (x its wd_mult) for the first iteration."""
    args = completed(args)
    warmup, decay, wsd, run = lr_schedule_samples(args)
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=args.lr_decay_style, start_wd=start_weight_decay(args),
        end_wd=end_weight_decay(args), wd_incr_steps=run, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=bool(args.use_checkpoint_opt_param_scheduler),
        override_opt_param_scheduler=bool(args.override_opt_param_scheduler),
        wsd_decay_steps=wsd, lr_wsd_decay_style=args.lr_wsd_decay_style)


def varies_lr(args) -> bool:
    """Whether the learning rate changes during the run (a decay or a warm-up): the iteration line then shows it."""
    return completed(args).lr_decay_style != "constant" or schedule_samples(args)[0] > 0


def current_lr(scheduler: OptimizerParamScheduler) -> float:
    """The learning rate of the next step (every group has the same: no per-group lr multipliers here)."""
    return float(scheduler.optimizer.param_groups[0]["lr"])


def restore_scheduler(scheduler: OptimizerParamScheduler, saved: Optional[dict], consumed_samples: int, args
                      ) -> None:
    """The checkpoint's place in the schedule. saved: the scheduler's state (None for a checkpoint from before
    schedules were kept, which trained at a constant lr: the run goes on at its consumed samples). This run's
    learning-rate flags apply unless --use-checkpoint-opt-param-scheduler; that they agree with the checkpoint's, or
    that --override-opt-param-scheduler lets them differ, was checked with its manifest before any rank started
    (checkpoint_manifest.check_compatible)."""
    if saved is None:
        scheduler.step(consumed_samples)
        return
    keep_ours = not completed(args).use_checkpoint_opt_param_scheduler
    # Megatron's override keeps the class values instead of asserting on fields no schedule here reads (a constant
    # lr's decay length, which follows --iters).
    scheduler.override_opt_param_scheduler = keep_ours
    try:
        scheduler.load_state_dict(saved)
    finally:
        scheduler.override_opt_param_scheduler = bool(completed(args).override_opt_param_scheduler)
