"""The parts of Megatron's forward_backward contract beyond "run the tasks": which process groups to use, the
tensor-shape hook, and which microbatches checkpoint all their layers' activations.

Each rule is Megatron-Core's own (schedules.py, 0.16 - 0.19), answered per (chunk, microbatch) so that it does not
depend on the order a policy happens to run the tasks in.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_app.megatron_compat import is_multimodule
from megatron_app.schedule import PipelineShape
from megatron_app.schedule.megatron_order import megatron_forward_sequence, megatron_warmup_microbatches

from .settings import AppConfigError


@dataclasses.dataclass
class ScheduleGroups:
    pp: object               # the pipeline group messages travel in
    tp: object
    cp: object
    pg_collection: object    # handed on to finalize_model_grads_func as given (None: Megatron's defaults)

    @property
    def cp_size(self) -> int:
        return self.cp.size()


def resolve_groups(p2p_communicator, pg_collection) -> ScheduleGroups:
    """Megatron's rule: with pipelining, both p2p_communicator and pg_collection or neither; the pipeline group is
    the communicator's (pg_collection's .pp, or parallel_state's, otherwise), tp/cp come from pg_collection."""
    if is_multimodule(pg_collection, p2p_communicator):
        raise AppConfigError("megatron_app does not schedule multi-module pipelines (MultiModuleProcessGroupCollection"
                             "); call megatron_app.uninstall() to use Megatron's own schedule for this model")
    if p2p_communicator is not None:
        pp = getattr(p2p_communicator, "pp_group", None)
        if pp is None:
            raise AppConfigError(f"p2p_communicator {type(p2p_communicator).__name__} has no pp_group")
    else:
        pp = getattr(pg_collection, "pp", None)
        if pp is None:
            pp = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp) > 1 and (p2p_communicator is None) != (pg_collection is None):
        raise AppConfigError("Provide both p2p_communicator and pg_collection, or neither")
    if pg_collection is None:
        return ScheduleGroups(pp, parallel_state.get_tensor_model_parallel_group(),
                              parallel_state.get_context_parallel_group(), None)
    missing = [name for name in ("tp", "cp") if getattr(pg_collection, name, None) is None]
    if missing:
        raise AppConfigError(f"pg_collection must have {' and '.join(missing)}")
    return ScheduleGroups(pp, pg_collection.tp, pg_collection.cp, pg_collection)


def apply_tensor_shape_hook(adjust_tensor_shapes_fn: Optional[Callable], *, num_stages: int, num_chunks: int,
                            seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int], config,
                            tp_group, cp_group):
    """Call adjust_tensor_shapes_fn where Megatron does (1F1B without interleaving) and refuse it where Megatron
    does (no pipelining, interleaving). Returns the adjusted (recv, send) shapes, or None without a hook.

    Our messages carry their own shapes, so the result only documents what the user expects to flow.
    """
    if adjust_tensor_shapes_fn is None:
        return None
    if num_stages == 1:
        raise AppConfigError("adjust_tensor_shapes_fn is not supported for non-pipeline-parallel schedule")
    if num_chunks > 1:
        raise AppConfigError("adjust_tensor_shapes_fn is not supported for interleaved pipeline parallelism")
    from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

    def default_shapes():
        return get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                                 decoder_seq_length=decoder_seq_length, config=config, tp_group=tp_group,
                                 cp_group=cp_group)

    return adjust_tensor_shapes_fn(default_shapes(), default_shapes())


def full_checkpoint_flags(shape: PipelineShape, rank: int, num_partial: Optional[int]
                          ) -> Optional[Dict[Tuple[int, int], bool]]:
    """checkpoint_activations_microbatch per (chunk, microbatch), as Megatron decides it for `rank`.

    With config.num_microbatches_with_partial_activation_checkpoints = k, Megatron's pipelined schedules number
    this rank's forwards in their own order (the k-th virtual microbatch) and, within each window of (warm-up + 1)
    forwards, let the first k checkpoint partially and the rest fully. None when the option is off, and without
    pipelining, where Megatron passes nothing either.
    """
    if num_partial is None or shape.num_stages == 1:
        return None
    if shape.num_chunks == 1:
        # forward_backward_pipelining_without_interleaving: warm-up P - rank - 1, also when forward_only
        window = min(shape.num_stages - rank - 1, shape.num_microbatches) + 1
        forwards = [(0, mb) for mb in range(shape.num_microbatches)]
    else:
        window = megatron_warmup_microbatches(shape, rank) + 1
        forwards = [(chunk, mb) for mb, chunk in megatron_forward_sequence(shape)]
    return {key: k % window >= num_partial for k, key in enumerate(forwards)}
