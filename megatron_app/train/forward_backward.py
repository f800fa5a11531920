"""Choosing the forward_backward function, and the few runtime hooks the loop needs.

``megatron``: Megatron-Core's get_forward_backward_func(), untouched (for P == 1 that is
forward_backward_no_pipelining, the loss reference). ``app`` / ``interleaved`` / ``1f1b``: call
``megatron_app.install(...)``, after which the same get_forward_backward_func() returns the
runtime's forward_backward_app.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import megatron.core.pipeline_parallel as megatron_pp

from .args import MEGATRON_SCHEDULE as MEGATRON
from .cpu_compat import CudaDeviceToCpu


def _on_cpu(func: Callable) -> Callable:
    @functools.wraps(func)
    def run(*args, **kwargs):
        with CudaDeviceToCpu():
            return func(*args, **kwargs)
    return run


def runtime_settings(args, trace_dir: Optional[str]):
    """The trainer's flags as the runtime's one AppSettings (built once, by build_trainer), or None when Megatron's
    own schedule runs. trace_dir: this run's trace directory, None when not tracing."""
    if args.schedule == MEGATRON:
        return None
    from megatron_app.runtime import AppSettings

    return AppSettings(schedule=args.schedule, policy=args.policy, memory_factor=args.memory_factor,
                       trace_dir=trace_dir, split_backward=args.split_backward, schedule_file=args.schedule_file,
                       replica_speeds=not args.no_replica_speeds, composition=args.composition)


def select_forward_backward_func(settings, device_type: str) -> Callable:
    """Megatron's own function when ``settings`` is None (on the CPU, under CudaDeviceToCpu); else ours, installed
    with these settings."""
    if settings is None:
        func = megatron_pp.get_forward_backward_func()
        return _on_cpu(func) if device_type == "cpu" else func
    from megatron_app.runtime import install

    install(settings)
    return megatron_pp.get_forward_backward_func()


def optimizer_span(schedule: str, iteration: int):
    """Trace the optimizer step in the runtime's per-rank trace (under the loop's iteration number, as its calls)."""
    if schedule == MEGATRON:
        return contextlib.nullcontext()
    from megatron_app.runtime import current_tracer
    from megatron_app.trace.schema import OPTIMIZER

    tracer = current_tracer()
    return contextlib.nullcontext() if tracer is None else tracer.span(OPTIMIZER, iteration=iteration)


def with_call(schedule: str, data_iterator, call_plan):
    """The data iterator to pass a forward_backward call, carrying the call's plan (next_call.CallPlan) to our
    schedule. Unchanged without a plan (None) and for Megatron's own schedule, which reads none."""
    if schedule == MEGATRON or call_plan is None:
        return data_iterator
    from megatron_app.runtime.next_call import with_call_plan

    return with_call_plan(data_iterator, call_plan)


def with_told_lengths(schedule: str, data_iterator, lengths):
    """with_call for a call whose microbatches' padded lengths are all it knows (None: equal lengths, none told)."""
    from megatron_app.runtime.next_call import CallPlan

    return with_call(schedule, data_iterator, None if lengths is None else CallPlan.of_lengths(lengths))


def close_schedule(schedule: str) -> None:
    """Close the runtime's transport and flush its trace (before the process groups go away)."""
    if schedule == MEGATRON:
        return
    from megatron_app.runtime import shutdown

    shutdown()
