"""What the installed forward_backward function should do: schedule, policy, tracing, timeouts."""

from __future__ import annotations

import csv
import dataclasses
from typing import List, Optional, Tuple

from megatron_app.schedule import ADAPTIVE_POLICY_NAMES, DEFAULT_POLICY, STATIC_POLICY_NAMES

# "app" runs an adaptive policy (AppSettings.policy); every static policy is a schedule of its own; "file" runs the
# per-rank action lists of a schedule file (torch.distributed.pipelining's format, schedule/action_lists.py).
FILE_SCHEDULE = "file"
SCHEDULES = ("app",) + STATIC_POLICY_NAMES + (FILE_SCHEDULE,)
ADAPTIVE_POLICIES = ADAPTIVE_POLICY_NAMES


class AppConfigError(ValueError):
    """A user-facing configuration mistake (bad flag value, impossible layout)."""


@dataclasses.dataclass
class AppSettings:
    schedule: str = "app"            # app = adaptive policy; interleaved / 1f1b = Megatron's fixed orders
    policy: str = DEFAULT_POLICY     # used when schedule == "app"
    memory_cap: Optional[int] = None  # activations held per rank; None = Megatron's interleaved peak
    memory_factor: Optional[float] = None  # planned: activation bytes per rank, x Megatron's peak; None = 1.0
    planning_share: float = 0.02      # planned: planning time budget, share of the last iteration
    trace_dir: Optional[str] = None   # None = no trace files
    timeout_s: float = 300.0          # a peer silent this long is reported as stuck
    job_id: Optional[str] = None      # names the shared-memory segments; agreed across ranks when None
    split_backward: bool = False      # each backward as B (input gradient) + a later W (weight gradients)
    schedule_file: Optional[str] = None  # with schedule "file": the CSV of per-rank action lists
    replica_speeds: bool = True       # balanced: learn each data-parallel replica's speed (False: plan them equal)
    action_lists: Optional[tuple] = dataclasses.field(default=None, repr=False)   # its rows, read by validate()

    def validate(self) -> "AppSettings":
        if self.schedule not in SCHEDULES:
            raise AppConfigError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.schedule == "app" and self.policy not in ADAPTIVE_POLICIES:
            raise AppConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(ADAPTIVE_POLICIES)}")
        if self.memory_cap is not None and self.memory_cap < 1:
            raise AppConfigError(f"memory cap must be >= 1 activation, got {self.memory_cap}")
        if self.memory_factor is not None and not self.memory_factor >= 1.0:
            raise AppConfigError(f"memory factor must be >= 1 (x Megatron's peak activation bytes), "
                                 f"got {self.memory_factor}")
        if self.memory_factor is not None and not _policy_takes(self.policy_name, "memory_factor"):
            raise AppConfigError(f"a memory factor applies to policy {_takers('memory_factor')} only, not "
                                 f"{self.policy_name!r}")
        if not 0 < self.planning_share < 1:
            raise AppConfigError(f"planning share must lie in (0, 1), got {self.planning_share}")
        if not isinstance(self.split_backward, bool):
            raise AppConfigError(f"split_backward must be True or False, got {self.split_backward!r}")
        if self.timeout_s <= 0:
            raise AppConfigError(f"timeout must be positive, got {self.timeout_s}")
        if (self.schedule == FILE_SCHEDULE) != (self.schedule_file is not None):
            raise AppConfigError("schedule 'file' and a schedule file go together (--schedule-file PATH)")
        if self.schedule_file is not None:     # its lists are checked against the pipeline once it is known
            self.action_lists = read_action_lists(self.schedule_file)
            return self
        from megatron_app.schedule import POLICIES
        if POLICIES[self.policy_name].split_only and not self.split_backward:
            raise AppConfigError(f"schedule {self.policy_name!r} needs --split-backward")
        return self

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
