"""The parts one forward_backward call is built from, each resolved once per call: what the caller asked for
(CallRequest), the model chunks with their data (ModelChunks), and this rank's place in the call's pipeline
(RankPlacement)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.utils import get_model_config, get_model_type

from megatron_app.devices import model_device
from megatron_app.schedule import PipelineShape
from megatron_app.trace.model_shape import model_shape

from .call_contract import ScheduleGroups, full_checkpoint_flags
from .microbatch_data import MicrobatchReplay
from .next_call import CallPlan, call_plan_of, data_source
from .settings import AppConfigError


@dataclass(frozen=True)
class CallRequest:
    """Megatron's forward_backward keywords besides the model, the data and the groups."""
    forward_step_func: Callable
    num_microbatches: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: Optional[bool]
    force_all_reduce: bool


def _this_rank() -> str:
    """'rank N: ' where torch.distributed runs (a refusal names the rank that made it), else ''."""
    return f"rank {dist.get_rank()}: " if dist.is_available() and dist.is_initialized() else ""


class ModelChunks:
    """This rank's model chunks, one replayable data iterator each, their config, model type and device, and the
    call's plan when its data iterators carry one (next_call.PlannedIterator)."""

    def __init__(self, model, data_iterator):
        self.models = list(model) if isinstance(model, (list, tuple)) else [model]
        V = len(self.models)
        if isinstance(data_iterator, (list, tuple)):
            if len(data_iterator) != V:
                raise AppConfigError(f"{_this_rank()}got {len(data_iterator)} data iterators for {V} model chunks; pass "
                                     "one per chunk, in chunk order (None for a chunk that reads no data)")
            iterators = list(data_iterator)
        elif V == 1:
            iterators = [data_iterator]
        else:
            raise AppConfigError(f"{_this_rank()}with {V} model chunks, data_iterator must be a list with one iterator "
                                 "per chunk (None for a chunk that reads no data)")
        self.call_plan: Optional[CallPlan] = call_plan_of(iterators)   # the plan the caller handed with the data
        self.data: List[Optional[MicrobatchReplay]] = [None if data_source(it) is None
                                                       else MicrobatchReplay(data_source(it)) for it in iterators]
        self.config = get_model_config(self.models[0])
        if getattr(self.config, "defer_embedding_wgrad_compute", False):
            raise ValueError("megatron_app does not support defer_embedding_wgrad_compute yet")
        self.model_type = get_model_type(self.models[0])
        self.device = model_device(self.models[0])


class RankPlacement:
    """The call's pipeline shape and this rank's place in it: pipeline rank and group members, the tensor-parallel
    group, which forwards Megatron's partial recomputation checkpoints fully, and the shape of the model its chunks
    are part of (`model`, recorded in the trace header: cost curves fitted on the trace carry it on)."""

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
        # Raised by the session (agree_on_layout): at a group's first call every rank must hear of it.
        self.layout_refusal: Optional[AppConfigError] = None
        try:
            check_chunk_layout(chunks, self.pp_rank, len(self.pp_global))
        except AppConfigError as refusal:
            self.layout_refusal = refusal
        self.model = model_shape_of(chunks)
        self.full_checkpoint = full_checkpoint_flags(
            self.shape, self.pp_rank, getattr(config, "num_microbatches_with_partial_activation_checkpoints", None))


def _language_module(chunk):
    """The Megatron language model (GPTModel, MambaModel) inside a chunk's wrappers (DDP, Float16Module), or None
    for another module: those carry no pipeline layout to check."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.enums import ModelType

    while not isinstance(chunk, LanguageModule) and isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    if not isinstance(chunk, LanguageModule) or getattr(chunk, "model_type", None) != ModelType.encoder_or_decoder:
        return None
    return chunk


def model_shape_of(chunks: ModelChunks) -> dict:
    """The model's shape (trace/model_shape.py) from the chunks' config, with the vocabulary of the first chunk
    that is a Megatron language model (None when none is: another module)."""
    vocab = next((model.vocab_size for model in map(_language_module, chunks.models)
                  if model is not None and getattr(model, "vocab_size", None) is not None), None)
    return model_shape(chunks.config, vocab)


def check_chunk_layout(chunks: ModelChunks, pp_rank: int, P: int) -> None:
    """A pipelined call's model chunks must be built for their place: chunk c of pipeline rank r holds virtual
    stage c * P + r of P x V, so only the first one embeds (pre_process) and only the last one has the output layer
    and loss (post_process), chunk c has vp_stage c (V > 1), and the config's pipeline sizes are the call's.
    Otherwise a stage would send None or receive what it does not expect, deep inside the schedule; here the first
    call stops with one line naming the rank, the chunk and the fix (an AppConfigError)."""
    if P == 1:
        return
    V = len(chunks.models)
    where = f"P={P} V={V}"
    config_p = getattr(chunks.config, "pipeline_model_parallel_size", None)
    config_v = getattr(chunks.config, "virtual_pipeline_model_parallel_size", None) or 1
    for c, chunk in enumerate(chunks.models):
        model = _language_module(chunk)
        if model is None:
            continue
        name = f"pipeline rank {pp_rank}'s model chunk {c}"
        if config_p is not None and config_p != P:
            raise AppConfigError(
                f"{name}: its config has pipeline_model_parallel_size={config_p} but the call's pipeline group has "
                f"{P} ranks; build the TransformerConfig with pipeline_model_parallel_size={P}")
        if config_v != V:
            raise AppConfigError(
                f"{name}: its config has virtual_pipeline_model_parallel_size={config_v if config_v > 1 else None} "
                f"but this rank passes {V} model chunk(s); build V chunks with "
                f"virtual_pipeline_model_parallel_size={V if V > 1 else None}")
        stage = c * P + pp_rank
        for flag, expected, helper in (("pre_process", stage == 0, "is_pipeline_first_stage"),
                                       ("post_process", stage == P * V - 1, "is_pipeline_last_stage")):
            built = getattr(model, flag, None)
            if built is not None and bool(built) != expected:
                raise AppConfigError(
                    f"{name} (virtual stage {stage} of {P * V}, {where}) was built with {flag}={bool(built)}; "
                    f"build it with {flag}=parallel_state.{helper}(ignore_virtual=False, "
                    f"vp_stage={c if V > 1 else None})")
        vp_stage = getattr(model, "vp_stage", None)
        if V > 1 and vp_stage != c:
            raise AppConfigError(f"{name} ({where}) was built with vp_stage={vp_stage}; build chunk {c} with "
                                 f"vp_stage={c}")
        if V == 1 and vp_stage not in (None, 0):
            raise AppConfigError(f"{name} ({where}) was built with vp_stage={vp_stage}; with one chunk a rank "
                                 f"build it with vp_stage=None")
