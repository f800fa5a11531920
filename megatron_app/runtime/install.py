"""Make Megatron-Core's get_forward_backward_func() return our schedule, and undo it.

get_forward_backward_func looks its three schedule functions up in its module's globals at call time, so replacing
those globals reaches every call site — also scripts that did `from ... import get_forward_backward_func` before
install() ran. Each is replaced by its own entry point (executor.MEGATRON_ENTRY_POINTS), which refuses what the
function it replaces refuses, in its order, and then runs our schedule.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Optional

from .exit_grace import let_collective_threads_finish_at_exit
from .settings import AppSettings
from . import linear_wgrad, recompute_randomness
from .job import current_job

def install(settings: Optional[AppSettings] = None, *, tracing: bool = True,
            allow_untested_megatron: Optional[bool] = None, **options) -> AppSettings:
    """Route Megatron's forward_backward functions to ours. Idempotent; a second call updates the settings.

    ``settings``, or the options by name (every AppSettings field: schedule, policy, memory_cap, memory_factor,
    planning_share, trace_dir, timeout_s, job_id, split_backward, schedule_file, replica_speeds, composition; each
    field says its default and meaning): e.g. install(policy="dfc", timeout_s=60). schedule_file implies schedule
    "file". tracing=False is trace_dir=None (kept for callers that turn traces off by name).

    An installed megatron-core outside the tested range is refused (UnsupportedMegatronError, one line) unless
    allow_untested_megatron (or $MEGATRON_APP_ALLOW_UNTESTED_MEGATRON=1) says to try anyway.
    """
    from megatron.core.pipeline_parallel import schedules

    from megatron_app.megatron_compat import check_megatron_version

    check_megatron_version(allow_untested_megatron)

    from .executor import MEGATRON_ENTRY_POINTS

    if settings is None:
        settings = AppSettings(**options)
    elif options:
        settings = dataclasses.replace(settings, **options)
    if not tracing:
        settings = dataclasses.replace(settings, trace_dir=None)
    settings.validate()
    let_collective_threads_finish_at_exit()   # a user's loop that exits right after a gloo collective must not abort
    recompute_randomness.install()   # Megatron's recomputation on CPU, and keyed dropout redrawn equal in it
    job = current_job()
    job.use_settings(settings)
    if job.installation.schedule_functions is None:
        job.installation.schedule_functions = {name: getattr(schedules, name) for name in MEGATRON_ENTRY_POINTS}
        for name, entry_point in MEGATRON_ENTRY_POINTS.items():
            setattr(schedules, name, entry_point)
    return settings


def _signature_from_settings(func):
    """install's signature as help() and inspect show it: its own keywords, then every AppSettings option by name
    with the field's default (stated once, in the field)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    own = list(inspect.signature(func).parameters.values())[:-1]     # all but **options
    options = [inspect.Parameter(field.name, keyword, default=field.default, annotation=field.type)
               for field in AppSettings.flagged_fields()]
    func.__signature__ = inspect.Signature(own + options, return_annotation=AppSettings)
    return func


install = _signature_from_settings(install)


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


_FLAG_PREFIX = "app_"   # each AppSettings field NAME is flag --app-NAME, dest app_NAME


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags for a Megatron-style argument parser (use as extra_args_provider): --use-app, one --app-NAME per
    AppSettings field (--app-no-NAME for an option that is on by default) and --app-allow-untested-megatron."""
    group = parser.add_argument_group("megatron_app")
    group.add_argument("--use-app", action="store_true", help="run pipeline parallelism with megatron_app's schedule")
    for field in AppSettings.flagged_fields():
        dest, flag = _FLAG_PREFIX + field.name, "--app-" + field.name.replace("_", "-")
        if field.default is True:
            group.add_argument("--app-no-" + field.name.replace("_", "-"), dest=dest, action="store_false",
                               help=field.metadata["help"])
        elif field.default is False:
            group.add_argument(flag, dest=dest, action="store_true", help=field.metadata["help"])
        else:
            group.add_argument(flag, dest=dest, default=field.default, help=field.metadata["help"],
                               **field.metadata["parser"])
    group.add_argument("--app-allow-untested-megatron", action="store_true",
                       help="run with a megatron-core version megatron_app was not tested with")
    return parser


def install_from_args(args: argparse.Namespace) -> Optional[AppSettings]:
    """install() when --use-app was given; returns the settings, or None when not requested. A parser without
    add_arguments' flags (or without some of them) gets each missing option's default."""
    given = vars(args)
    if not given.get("use_app", False):
        return None
    options = {field.name: given[_FLAG_PREFIX + field.name] for field in AppSettings.flagged_fields()
               if _FLAG_PREFIX + field.name in given}
    return install(allow_untested_megatron=given.get("app_allow_untested_megatron", False) or None, **options)
