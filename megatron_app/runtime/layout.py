"""Where this rank sits: its process groups, resolved in one place and in Megatron-Core's order.

Megatron's schedules take the pipeline group from ``p2p_communicator`` when one is given, the other groups from
``pg_collection`` when one is given ("provide both or neither", checked by call_contract.py), and parallel_state's
otherwise. Every reader of a group (the call's placement, the plan's layout, the session's transports and trace
names, the trainer's gradient reduction and link emulation) asks here, so none of them can take one source for the
pipeline and another for the replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch.distributed as dist


def _model_parallel_ready() -> bool:
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def pipeline_group(p2p_communicator=None, pg_collection=None):
    """The pipeline group a call sends in: the communicator's (Megatron's pipelined schedules send in it), else
    pg_collection's, else parallel_state's. None when there is none to take (parallel_state not set up)."""
    pp = getattr(p2p_communicator, "pp_group", None)
    if pp is None:
        pp = getattr(pg_collection, "pp", None)
    if pp is None and _model_parallel_ready():
        from megatron.core import parallel_state

        pp = parallel_state.get_pipeline_model_parallel_group()
    return pp


def tensor_and_context_groups(pg_collection=None):
    """(tensor-parallel group, context-parallel group): pg_collection's when one is given, else parallel_state's."""
    if pg_collection is not None:
        return pg_collection.tp, pg_collection.cp
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()


def data_parallel_group(pg_collection=None, with_context_parallel: bool = False):
    """pg_collection's data-parallel group (``dp_cp`` with context parallelism), else parallel_state's. None when
    there is none to take."""
    name = "dp_cp" if with_context_parallel else "dp"
    group = getattr(pg_collection, name, None)
    if group is None and _model_parallel_ready():
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group(with_context_parallel=with_context_parallel)
    return group


def embedding_group(pg_collection=None):
    """The group joining the pipeline's first and last stage (its tied embedding and output weight): pg_collection's
    when one is given, else parallel_state's. None when there is none to take."""
    group = getattr(pg_collection, "embd", None)
    if group is None and _model_parallel_ready():
        from megatron.core import parallel_state

        group = parallel_state.get_embedding_group(check_initialized=False)
    return group


def data_parallel_rank(pg_collection=None) -> int:
    """This rank's replica: its rank in the data-parallel group (0 without one)."""
    group = data_parallel_group(pg_collection)
    return 0 if group is None else dist.get_rank(group)


def pipeline_ranks(p2p_communicator=None, pg_collection=None) -> Optional[Tuple[int, ...]]:
    """The global ranks of the pipeline group, sorted (None without one)."""
    group = pipeline_group(p2p_communicator, pg_collection)
    return None if group is None else tuple(sorted(dist.get_process_group_ranks(group)))


@dataclass(frozen=True)
class JobLayout:
    """Where this rank sits, as the plan needs it: its replica, the replica count and its pipeline's shape."""
    dp_rank: int = 0
    num_replicas: int = 1
    num_stages: int = 1
    num_chunks: int = 1
    distributed: bool = False


def job_layout(pg_collection=None, p2p_communicator=None) -> JobLayout:
    """The plan's view of this rank's place, from the same groups a call of these arguments runs in."""
    if not (dist.is_available() and dist.is_initialized()):
        return JobLayout()
    if pg_collection is None and not _model_parallel_ready():
        return JobLayout(distributed=True)
    from megatron.core import parallel_state

    V = (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) if _model_parallel_ready() else 1
    dp, pp = data_parallel_group(pg_collection), pipeline_group(p2p_communicator, pg_collection)
    return JobLayout(dist.get_rank(dp), dist.get_world_size(dp), dist.get_world_size(pp), V, True)
