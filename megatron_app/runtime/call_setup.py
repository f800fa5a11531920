"""The parts one forward_backward call is built from, each resolved once per call: what the caller asked for
(CallRequest), the model chunks with their data (ModelChunks), and this rank's place in the call's pipeline
(RankPlacement)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch.distributed as dist

from megatron.core.utils import get_model_config, get_model_type

from megatron_app.schedule import PipelineShape

from .call_contract import ScheduleGroups, full_checkpoint_flags
from .microbatch_data import MicrobatchReplay


@dataclass(frozen=True)
class CallRequest:
    """Megatron's forward_backward keywords besides the model, the data and the groups."""
    forward_step_func: Callable
    num_microbatches: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: Optional[bool]
    force_all_reduce: bool


class ModelChunks:
    """This rank's model chunks, one replayable data iterator each, their config, model type and device."""

    def __init__(self, model, data_iterator):
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        V = len(self.models)
        if isinstance(data_iterator, (list, tuple)):
            if len(data_iterator) != V:
                raise ValueError(f"got {len(data_iterator)} data iterators for {V} model chunks")
            iterators = list(data_iterator)
        elif V == 1:
            iterators = [data_iterator]
        else:
            raise ValueError("with several model chunks, data_iterator must be a list with one iterator per chunk")
        self.data: List[Optional[MicrobatchReplay]] = [None if it is None else MicrobatchReplay(it)
                                                       for it in iterators]
        self.config = get_model_config(self.models[0])
        if getattr(self.config, "defer_embedding_wgrad_compute", False):
            raise ValueError("megatron_app does not support defer_embedding_wgrad_compute yet")
        self.model_type = get_model_type(self.models[0])
        self.device = next(self.models[0].parameters()).device


class RankPlacement:
    """The call's pipeline shape and this rank's place in it: pipeline rank and group members, the tensor-parallel
    group, and which forwards Megatron's partial recomputation checkpoints fully."""

    def __init__(self, groups: ScheduleGroups, chunks: ModelChunks, request: CallRequest, split_backward: bool):
        self.pp_group, self.tp_group, self.cp_size = groups.pp, groups.tp, groups.cp_size
        self.pg_collection = groups.pg_collection
        if self.pp_group is None:     # no pipelining: this rank alone, whatever parallel_state's pipeline is
            self.pp_rank, self.pp_global = 0, [dist.get_rank()]
        else:
            self.pp_rank = dist.get_rank(self.pp_group)
            self.pp_global = dist.get_process_group_ranks(self.pp_group)
        V, config = len(chunks.models), chunks.config
        self.split_backward = split_backward and not request.forward_only
        self.shape = PipelineShape(num_stages=len(self.pp_global), num_chunks=V,
                                   num_microbatches=request.num_microbatches, forward_only=request.forward_only,
                                   split_backward=self.split_backward,
                                   microbatch_group_size=getattr(config, "microbatch_group_size_per_vp_stage",
                                                                 None) if V > 1 else None)
        self.full_checkpoint = full_checkpoint_flags(
            self.shape, self.pp_rank, getattr(config, "num_microbatches_with_partial_activation_checkpoints", None))
