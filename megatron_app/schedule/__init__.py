"""Pure scheduling decisions for pipeline parallelism: tasks, dependency rules, rank state and policies.

No torch, sockets, clocks or threads; megatron-core is imported lazily, only to derive its own static orders.
"""

from .admission import forward_fits, minimum_memory_cap
from .driver import drive
from .errors import ScheduleConfigError, ScheduleStallError, ScheduleStateError
from .megatron_order import megatron_interleaved_cap, megatron_order, megatron_warmup_microbatches
from .policies import POLICY_NAMES, GreedyPolicy, Policy, StaticOrderPolicy, make_policy
from .shape import PipelineShape
from .state import RankState
from .tasks import Kind, Task

__all__ = [
    "Kind", "Task", "PipelineShape", "RankState", "Policy", "GreedyPolicy", "StaticOrderPolicy", "make_policy",
    "POLICY_NAMES", "megatron_interleaved_cap", "megatron_order", "megatron_warmup_microbatches",
    "minimum_memory_cap", "forward_fits", "drive", "ScheduleConfigError", "ScheduleStateError",
    "ScheduleStallError",
]
