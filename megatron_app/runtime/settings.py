"""What the installed forward_backward function should do: schedule, policy, tracing, timeouts, composition: the one
list of the runtime's options (AppSettings), from which install(), add_arguments and install_from_args follow."""

from __future__ import annotations

import csv
import dataclasses
from typing import Any, Callable, List, Optional, Tuple

from megatron_app.schedule import ADAPTIVE_POLICY_NAMES, DEFAULT_POLICY, STATIC_POLICY_NAMES
from megatron_app.schedule.composition import COMPOSITION_NAMES, DEFAULT_COMPOSITION

# "app" runs an adaptive policy (AppSettings.policy); every static policy is a schedule of its own; "file" runs the
# per-rank action lists of a schedule file (torch.distributed.pipelining's format, schedule/action_lists.py).
FILE_SCHEDULE = "file"
SCHEDULES = ("app",) + STATIC_POLICY_NAMES + (FILE_SCHEDULE,)
ADAPTIVE_POLICIES = ADAPTIVE_POLICY_NAMES


class AppConfigError(ValueError):
    """A user-facing configuration mistake (bad flag value, impossible layout)."""


def _option(default, help: str, *, check: Optional[Callable[[Any], Optional[str]]] = None, flag: bool = True,
            **parser_kwargs):
    """One runtime option, stated once: its default, what it means (``--help``), its own check (the value -> the
    one-line refusal, None when fine) and how ``add_arguments`` parses it (argparse keywords; a bool whose default is
    True becomes ``--app-no-NAME``). flag=False: set through install() only."""
    return dataclasses.field(default=default, repr=not isinstance(default, tuple),
                             metadata={"help": help, "check": check, "flag": flag, "parser": parser_kwargs})


def _check_memory_factor(value) -> Optional[str]:
    from megatron_app.schedule import ScheduleConfigError
    from megatron_app.schedule.planned import check_memory_factor

    try:
        check_memory_factor(value)
    except ScheduleConfigError as error:
        return str(error)
    return None


@dataclasses.dataclass
class AppSettings:
    """Every option of the installed runtime, each with its default, meaning and check (install(**options),
    add_arguments / install_from_args and the trainer all read this list)."""

    schedule: str = _option("app", "app: the adaptive policy of --app-policy; a static order's name; file: the "
                            "action lists of --app-schedule-file", choices=SCHEDULES)
    policy: str = _option(DEFAULT_POLICY, "task policy of the app schedule", choices=ADAPTIVE_POLICIES)
    memory_cap: Optional[int] = _option(
        None, "activations a rank may hold (default: Megatron's interleaved peak)", type=int,
        check=lambda cap: None if cap is None or cap >= 1 else f"memory cap must be >= 1 activation, got {cap}")
    memory_factor: Optional[float] = _option(
        None, "policy planned (and planned-fixed): activation bytes a rank may hold, x Megatron's peak (default: the "
        "policy's, 1.0)", type=float, check=lambda factor: None if factor is None else _check_memory_factor(factor))
    planning_share: float = _option(
        0.02, "planned: planning time budget, share of the last iteration", type=float,
        check=lambda share: None if 0 < share < 1 else f"planning share must lie in (0, 1), got {share}")
    trace_dir: Optional[str] = _option(None, "write per-rank trace files here (default: none)")
    timeout_s: float = _option(
        300.0, "seconds a silent peer may take before it is reported as stuck", type=float,
        check=lambda seconds: None if seconds > 0 else f"timeout must be positive, got {seconds}")
    job_id: Optional[str] = _option(None, "names the shared-memory segments (default: agreed across ranks)")
    split_backward: bool = _option(
        False, "run each backward as an input-gradient task and a later weight-gradient task",
        check=lambda split: None if isinstance(split, bool) else f"split_backward must be True or False, got {split!r}")
    schedule_file: Optional[str] = _option(
        None, "run these per-rank action lists (torch.distributed.pipelining's compute-only format)", metavar="CSV")
    replica_speeds: bool = _option(
        True, "balanced: learn each data-parallel replica's speed and give a slower one less work (--app-no-replica-"
        "speeds: plan every replica as equally fast)")
    composition: str = _option(
        DEFAULT_COMPOSITION, "variable lengths: which documents of the global batch form each microbatch "
        "(wrap_data_iterator's default)", choices=COMPOSITION_NAMES,
        check=lambda name: None if name in COMPOSITION_NAMES else f"unknown composition {name!r}; choose one of "
        f"{', '.join(COMPOSITION_NAMES)}")
    action_lists: Optional[tuple] = _option(None, "the schedule file's rows, read by validate()", flag=False)

    def validate(self) -> "AppSettings":
        if self.schedule_file is not None:    # a schedule file is the schedule
            self.schedule = FILE_SCHEDULE
        if self.schedule not in SCHEDULES:
            raise AppConfigError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.schedule == "app" and self.policy not in ADAPTIVE_POLICIES:
            raise AppConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(ADAPTIVE_POLICIES)}")
        for field in dataclasses.fields(self):
            check = field.metadata["check"]
            refusal = check(getattr(self, field.name)) if check is not None else None
            if refusal is not None:
                raise AppConfigError(refusal)
        if self.memory_factor is not None and not _policy_takes(self.policy_name, "memory_factor"):
            raise AppConfigError(f"a memory factor applies to policy {_takers('memory_factor')} only, not "
                                 f"{self.policy_name!r}")
        if (self.schedule == FILE_SCHEDULE) != (self.schedule_file is not None):
            raise AppConfigError("schedule 'file' and a schedule file go together (--schedule-file PATH)")
        if self.schedule_file is not None:     # its lists are checked against the pipeline once it is known
            self.action_lists = read_action_lists(self.schedule_file)
            return self
        from megatron_app.schedule import POLICIES
        if POLICIES[self.policy_name].split_only and not self.split_backward:
            raise AppConfigError(f"schedule {self.policy_name!r} needs --split-backward")
        return self

    @classmethod
    def flagged_fields(cls) -> Tuple[dataclasses.Field, ...]:
        """The options add_arguments makes flags of, in declaration order."""
        return tuple(field for field in dataclasses.fields(cls) if field.metadata["flag"])

    @property
    def policy_name(self) -> str:
        """The schedule-package policy that runs: the adaptive rule, the static order itself, or a schedule file's
        action lists (the name the banner and the trace show)."""
        if self.schedule == FILE_SCHEDULE:
            from megatron_app.schedule.action_lists import ACTION_LISTS

            return ACTION_LISTS
        return self.policy if self.schedule == "app" else self.schedule


def read_action_lists(path: str) -> Tuple[Tuple[str, ...], ...]:
    """A schedule file's rows (trailing empty rows dropped): per-rank action lists in torch.distributed.pipelining's
    compute-only CSV format, one row per pipeline rank (schedule/action_lists.py says what the actions mean).
    AppConfigError, one line, when it cannot be read."""
    try:
        with open(path, newline="") as handle:
            rows: List[Tuple[str, ...]] = [tuple(cell.strip() for cell in row) for row in csv.reader(handle)]
    except OSError as error:
        raise AppConfigError(f"cannot read schedule file {path}: {error.strerror or error}") from None
    except (csv.Error, UnicodeDecodeError) as error:
        raise AppConfigError(f"schedule file {path} is not a CSV of actions: {error}") from None
    while rows and not any(rows[-1]):
        rows.pop()
    if not rows:
        raise AppConfigError(f"schedule file {path} holds no action lists")
    return tuple(rows)


def _policy_takes(policy: str, option: str) -> bool:
    from megatron_app.schedule import POLICIES

    return policy in POLICIES and POLICIES[policy].takes(option)


def _takers(option: str) -> str:
    from megatron_app.schedule.policies import policies_taking

    return " or ".join(repr(name) for name in policies_taking(option))
