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


def select_forward_backward_func(schedule: str, policy: str, trace_dir, tracing: bool,
                                 device_type: str, memory_factor: Optional[float] = None,
                                 split_backward: bool = False, schedule_file: Optional[str] = None,
                                 replica_speeds: bool = True) -> Callable:
    if schedule == MEGATRON:
        func = megatron_pp.get_forward_backward_func()
        return _on_cpu(func) if device_type == "cpu" else func
    from megatron_app.runtime import install

    install(schedule=schedule, policy=policy, trace_dir=trace_dir, tracing=tracing, memory_factor=memory_factor,
            split_backward=split_backward, schedule_file=schedule_file, replica_speeds=replica_speeds)
    return megatron_pp.get_forward_backward_func()


def optimizer_span(schedule: str, iteration: int):
    """Trace the optimizer step in the runtime's per-rank trace (under the loop's iteration number, as its calls)."""
    if schedule == MEGATRON:
        return contextlib.nullcontext()
    from megatron_app.runtime import current_tracer
    from megatron_app.trace.schema import OPTIMIZER

    tracer = current_tracer()
    return contextlib.nullcontext() if tracer is None else tracer.span(OPTIMIZER, iteration=iteration)


def tell_microbatch_lengths(schedule: str, lengths) -> None:
    """Tell our schedule each microbatch's padded length before a forward_backward call. Nothing to tell for
    equal lengths (None), nor to Megatron's own schedule."""
    if schedule == MEGATRON or lengths is None:
        return
    from megatron_app.runtime import set_microbatch_lengths

    set_microbatch_lengths(lengths)


def close_schedule(schedule: str) -> None:
    """Close the runtime's transport and flush its trace (before the process groups go away)."""
    if schedule == MEGATRON:
        return
    from megatron_app.runtime import shutdown

    shutdown()
