"""Pure scheduling decisions for pipeline parallelism: tasks, dependency rules, rank state and policies.

No torch, megatron-core, sockets, clocks or threads; Megatron-Core's static orders are computed here by our own code.
"""

from .admission import forward_fits, minimum_memory_cap
from .driver import drive
from .errors import (LastMicrobatchGroupError, MicrobatchGroupError, ScheduleConfigError, ScheduleStallError,
                     ScheduleStateError)
from .megatron_order import megatron_interleaved_cap, megatron_order, megatron_warmup_microbatches
from .greedy import GreedyPolicy
from .policies import (ADAPTIVE_POLICY_NAMES, DEFAULT_POLICY, POLICIES, POLICY_NAMES, STATIC_POLICY_NAMES, PolicyEntry,
                       make_policy, policies_for)
from .policy import Policy
from .static_order import StaticOrderPolicy
from .shape import PipelineShape, check_microbatch_groups
from .state import RankState
from .tasks import KIND_OF_TRACE_NAME, KINDS_BY_INDEX, TASK_KINDS, Kind, Task, TaskKindInfo

__all__ = [
    "Kind", "Task", "TASK_KINDS", "TaskKindInfo", "KIND_OF_TRACE_NAME", "KINDS_BY_INDEX", "PipelineShape", "RankState", "Policy", "GreedyPolicy", "StaticOrderPolicy", "make_policy",
    "POLICY_NAMES", "POLICIES", "DEFAULT_POLICY", "PolicyEntry", "ADAPTIVE_POLICY_NAMES", "STATIC_POLICY_NAMES", "policies_for",
    "megatron_interleaved_cap", "megatron_order", "megatron_warmup_microbatches",
    "minimum_memory_cap", "forward_fits", "drive", "ScheduleConfigError", "ScheduleStateError",
    "ScheduleStallError", "MicrobatchGroupError", "LastMicrobatchGroupError", "check_microbatch_groups",
]
