"""Make Megatron-Core's get_forward_backward_func() return our schedule, and undo it.

get_forward_backward_func looks its three schedule functions up in its module's globals at call time, so replacing
those globals reaches every call site — also scripts that did `from ... import get_forward_backward_func` before
install() ran. Each is replaced by its own entry point (executor.MEGATRON_ENTRY_POINTS), which refuses what the
function it replaces refuses, in its order, and then runs our schedule.
"""

from __future__ import annotations

import argparse
from typing import Optional

from megatron_app.schedule import DEFAULT_POLICY

from .settings import AppSettings, SCHEDULES, ADAPTIVE_POLICIES
from . import linear_wgrad
from .job import current_job

def install(schedule: str = "app", policy: str = DEFAULT_POLICY, trace_dir: Optional[str] = None, *,
            memory_cap: Optional[int] = None, timeout_s: float = 300.0, job_id: Optional[str] = None,
            tracing: bool = True, memory_factor: Optional[float] = None,
            allow_untested_megatron: Optional[bool] = None, split_backward: bool = False,
            schedule_file: Optional[str] = None, replica_speeds: bool = True) -> AppSettings:
    """Route Megatron's forward_backward functions to ours. Idempotent; a second call updates the settings.

    split_backward: run each backward as B (input gradient, sent upstream at once) and a later W (weight gradients)
    that the policy places in idle time (runtime/split_backward.py).
    replica_speeds: under composition `balanced`, learn each data-parallel replica's speed and give a slower one less
    work (False: every replica planned as equally fast).
    schedule_file: run these per-rank action lists (torch.distributed.pipelining's compute-only CSV, one row per
    pipeline rank; schedule/action_lists.py) instead of a policy; implies schedule "file".

    An installed megatron-core outside the tested range is refused (UnsupportedMegatronError, one line) unless
    allow_untested_megatron (or $MEGATRON_APP_ALLOW_UNTESTED_MEGATRON=1) says to try anyway.
    """
    from megatron.core.pipeline_parallel import schedules

    from megatron_app.megatron_compat import check_megatron_version

    check_megatron_version(allow_untested_megatron)

    from .executor import MEGATRON_ENTRY_POINTS

    settings = AppSettings(schedule="file" if schedule_file is not None else schedule, policy=policy,
                           memory_cap=memory_cap, memory_factor=memory_factor,
                           trace_dir=trace_dir if tracing else None, timeout_s=timeout_s, job_id=job_id,
                           split_backward=split_backward, schedule_file=schedule_file,
                           replica_speeds=replica_speeds).validate()
    job = current_job()
    job.use_settings(settings)
    if job.installation.schedule_functions is None:
        job.installation.schedule_functions = {name: getattr(schedules, name) for name in MEGATRON_ENTRY_POINTS}
        for name, entry_point in MEGATRON_ENTRY_POINTS.items():
            setattr(schedules, name, entry_point)
    return settings


def uninstall() -> None:
    """Restore Megatron's own schedule functions (and its linear backward, when a split backward replaced it)."""
    installation = current_job().installation
    linear_wgrad.uninstall(installation)
    if installation.schedule_functions is None:
        return
    from megatron.core.pipeline_parallel import schedules

    for name, func in installation.schedule_functions.items():
        setattr(schedules, name, func)
    installation.schedule_functions = None


def is_installed() -> bool:
    return current_job().installation.schedule_functions is not None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags for a Megatron-style argument parser (use as extra_args_provider)."""
    group = parser.add_argument_group("megatron_app")
    group.add_argument("--use-app", action="store_true", help="run pipeline parallelism with megatron_app's schedule")
    group.add_argument("--app-schedule", default="app", choices=SCHEDULES)
    group.add_argument("--app-policy", default=DEFAULT_POLICY, choices=ADAPTIVE_POLICIES)
    group.add_argument("--app-memory-cap", type=int, default=None)
    group.add_argument("--app-memory-factor", type=float, default=None,
                       help="policy planned (and planned-fixed): activation bytes a rank may hold, x Megatron's peak "
                            "(default 1.0)")
    group.add_argument("--app-trace-dir", default=None)
    group.add_argument("--app-split-backward", action="store_true",
                       help="run each backward as an input-gradient task and a later weight-gradient task")
    group.add_argument("--app-schedule-file", default=None, metavar="CSV",
                       help="run these per-rank action lists (torch.distributed.pipelining's compute-only format)")
    group.add_argument("--app-allow-untested-megatron", action="store_true",
                       help="run with a megatron-core version megatron_app was not tested with")
    return parser


def install_from_args(args: argparse.Namespace) -> Optional[AppSettings]:
    """install() when --use-app was given; returns the settings, or None when not requested."""
    if not getattr(args, "use_app", False):
        return None
    return install(schedule=args.app_schedule, policy=args.app_policy, trace_dir=args.app_trace_dir,
                   memory_cap=args.app_memory_cap, memory_factor=getattr(args, "app_memory_factor", None),
                   allow_untested_megatron=getattr(args, "app_allow_untested_megatron", False) or None,
                   split_backward=getattr(args, "app_split_backward", False),
                   schedule_file=getattr(args, "app_schedule_file", None))
