"""The parts of Megatron's forward_backward contract beyond "run the tasks": what each of Megatron-Core's three
schedule functions refuses, which process groups to use, the tensor-shape hook, and which microbatches checkpoint
all their layers' activations.

Each rule is Megatron-Core's own (schedules.py, 0.16 - 0.19). A refusal is checked where Megatron checks it and
raised as the exception type Megatron raises (AssertionError, ValueError, RuntimeError, TypeError), with our
one-line message; every one is also an AppConfigError, a ValueError. What differs between megatron-core versions
comes from megatron_compat. Our own refusals (what our schedule cannot run) come after Megatron's. The checkpoint
rule is answered per (chunk, microbatch) so that it does not depend on the order a policy runs the tasks in.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config

from megatron_app.megatron_compat import (is_multimodule, one_chunk_schedule_refuses_type_of,
                                          pg_collection_asserted_groups)
from megatron_app.schedule import (LastMicrobatchGroupError, MicrobatchGroupError, PipelineShape,
                                   check_microbatch_groups)
from megatron_app.schedule.megatron_order import megatron_forward_sequence, megatron_warmup_microbatches

from .layout import pipeline_group, tensor_and_context_groups
from .settings import AppConfigError


class ContractAssertionError(AppConfigError, AssertionError):
    """A call Megatron-Core's schedule refuses with ``assert``: an AssertionError like Megatron's, and a ValueError
    like every AppConfigError."""


class ContractRuntimeError(AppConfigError, RuntimeError):
    """A call Megatron-Core's schedule refuses with RuntimeError (the last interleaved microbatch group)."""


class ContractTypeError(AppConfigError, TypeError):
    """A call Megatron-Core's schedule refuses with TypeError (a pg_collection of another type, 0.17+)."""


@dataclasses.dataclass
class ScheduleGroups:
    pp: object               # the pipeline group messages travel in; None: this rank alone (no pipelining)
    tp: object
    cp: object
    pg_collection: object    # handed on to finalize_model_grads_func as given (None: Megatron's defaults)

    @property
    def cp_size(self) -> int:
        return self.cp.size()


def _require_groups(pg_collection) -> None:
    """Megatron's asserts on an explicit pg_collection (which groups depends on the version), then ours: the tp and
    cp groups it is read for are set."""
    for name in pg_collection_asserted_groups():
        if not hasattr(pg_collection, name):
            raise ContractAssertionError(f"pg_collection must have {name}")
    missing = [name for name in ("tp", "cp") if getattr(pg_collection, name, None) is None]
    if missing:
        raise ContractAssertionError(f"pg_collection must have {' and '.join(missing)}")


def _one_of_two_groups(p2p_communicator, pg_collection) -> None:
    if (p2p_communicator is None) != (pg_collection is None):
        raise AppConfigError("Provide both p2p_communicator and pg_collection, or neither")


def _require_communicator_config(p2p_communicator) -> None:
    if not hasattr(p2p_communicator, "config"):
        raise ContractAssertionError(f"p2p_communicator {type(p2p_communicator).__name__} must have a config")


def _no_multimodule(p2p_communicator, pg_collection) -> None:
    """Ours: a pipeline across several modules' grids (0.17+) is not scheduled here."""
    if is_multimodule(pg_collection, p2p_communicator):
        raise AppConfigError("megatron_app does not schedule multi-module pipelines (MultiModuleProcessGroupCollection"
                             "); call megatron_app.uninstall() to use Megatron's own schedule for this model")


def _one_chunk_each(what: str, model, data_iterator) -> None:
    for name, value in (("model chunks", model), ("data iterators", data_iterator)):
        if isinstance(value, list) and len(value) != 1:
            raise ContractAssertionError(f"{what} runs one model chunk, got {len(value)} {name}")


def _groups(pp, pg_collection) -> ScheduleGroups:
    """The pipeline group `pp` with tp/cp from pg_collection, or parallel_state's without one (layout.py)."""
    tp, cp = tensor_and_context_groups(pg_collection)
    return ScheduleGroups(pp, tp, cp, pg_collection)


def _pipeline_group(p2p_communicator):
    """The pipeline group of a pipelined schedule's call (layout.pipeline_group); a communicator without one is
    refused."""
    if p2p_communicator is not None and getattr(p2p_communicator, "pp_group", None) is None:
        raise AppConfigError(f"p2p_communicator {type(p2p_communicator).__name__} has no pp_group")
    return pipeline_group(p2p_communicator)


def refusals_without_pipelining(*, model, data_iterator, num_microbatches, adjust_tensor_shapes_fn,
                                p2p_communicator, pg_collection) -> ScheduleGroups:
    """forward_backward_no_pipelining: p2p_communicator is not used, and this rank runs alone."""
    if pg_collection is not None:
        _require_groups(pg_collection)
    _one_chunk_each("the schedule without pipeline parallelism", model, data_iterator)
    if adjust_tensor_shapes_fn is not None:
        raise ContractAssertionError("adjust_tensor_shapes_fn is not supported for non-pipeline-parallel schedule")
    return _groups(None, pg_collection)


def refusals_without_interleaving(*, model, data_iterator, num_microbatches, adjust_tensor_shapes_fn,
                                  p2p_communicator, pg_collection) -> ScheduleGroups:
    """forward_backward_pipelining_without_interleaving (1F1B, one model chunk); it calls adjust_tensor_shapes_fn."""
    _one_chunk_each("1F1B without interleaving", model, data_iterator)
    config = get_model_config(model[0] if isinstance(model, (list, tuple)) else model)
    if getattr(config, "overlap_p2p_comm", False):
        raise AppConfigError("Non-interleaved pipeline parallelism does not support overlapping p2p communication")
    _one_of_two_groups(p2p_communicator, pg_collection)
    if p2p_communicator is not None:
        _require_communicator_config(p2p_communicator)
        _no_multimodule(p2p_communicator, pg_collection)
        if one_chunk_schedule_refuses_type_of(pg_collection):
            raise ContractTypeError(f"pg_collection must be a ProcessGroupCollection, got "
                                    f"{type(pg_collection).__name__}")
        _require_groups(pg_collection)
    return _groups(_pipeline_group(p2p_communicator), pg_collection)


def refusals_with_interleaving(*, model, data_iterator, num_microbatches, adjust_tensor_shapes_fn,
                               p2p_communicator, pg_collection) -> ScheduleGroups:
    """forward_backward_pipelining_with_interleaving: the groups, the chunk lists, then the microbatch counts."""
    _one_of_two_groups(p2p_communicator, pg_collection)
    if p2p_communicator is not None:
        _require_communicator_config(p2p_communicator)
        _require_groups(pg_collection)
    if not isinstance(model, list):
        raise ContractAssertionError(f"interleaved pipeline parallelism takes the model as a list of chunks, got "
                                     f"{type(model).__name__}")
    if not all(isinstance(chunk, torch.nn.Module) for chunk in model):
        raise ContractAssertionError("interleaved pipeline parallelism takes model chunks that are torch.nn.Modules")
    if not isinstance(data_iterator, list):
        raise ContractAssertionError(f"interleaved pipeline parallelism takes one data iterator per model chunk, "
                                     f"as a list; got {type(data_iterator).__name__}")
    if adjust_tensor_shapes_fn is not None:
        raise ContractAssertionError("adjust_tensor_shapes_fn is not supported for interleaved pipeline parallelism")
    config = get_model_config(model[0])
    if getattr(config, "overlap_p2p_comm", False) and getattr(config, "batch_p2p_comm", False):
        raise AppConfigError("Can not use both overlap_p2p_comm and batch_p2p_comm")
    pp = _pipeline_group(p2p_communicator)
    P = dist.get_world_size(pp)
    try:   # Megatron: a ValueError for the group size, a RuntimeError for the last group
        check_microbatch_groups(P, num_microbatches, getattr(config, "microbatch_group_size_per_vp_stage", None) or P)
    except MicrobatchGroupError as error:
        raise AppConfigError(str(error)) from None
    except LastMicrobatchGroupError as error:
        raise ContractRuntimeError(str(error)) from None
    _no_multimodule(p2p_communicator, pg_collection)
    return _groups(pp, pg_collection)


@dataclasses.dataclass(frozen=True)
class MegatronSchedule:
    """One of Megatron-Core's schedule functions that install() replaces: its name in
    megatron.core.pipeline_parallel.schedules, its refusals in its order (returning the call's groups), and whether
    it calls adjust_tensor_shapes_fn."""
    name: str
    refusals: Callable[..., ScheduleGroups]
    calls_shape_hook: bool = False


WITHOUT_PIPELINING = MegatronSchedule("forward_backward_no_pipelining", refusals_without_pipelining)
WITHOUT_INTERLEAVING = MegatronSchedule("forward_backward_pipelining_without_interleaving",
                                        refusals_without_interleaving, calls_shape_hook=True)
WITH_INTERLEAVING = MegatronSchedule("forward_backward_pipelining_with_interleaving", refusals_with_interleaving)
MEGATRON_SCHEDULES: Tuple[MegatronSchedule, ...] = (WITHOUT_PIPELINING, WITHOUT_INTERLEAVING, WITH_INTERLEAVING)


def schedule_for_call(model, p2p_communicator, pg_collection) -> MegatronSchedule:
    """The schedule get_forward_backward_func picks for a call of this shape, for a caller of forward_backward_app
    itself: none for a pipeline of one rank, interleaving for several model chunks, 1F1B otherwise."""
    if dist.get_world_size(pipeline_group(p2p_communicator, pg_collection)) == 1:
        return WITHOUT_PIPELINING
    return WITH_INTERLEAVING if isinstance(model, (list, tuple)) and len(model) > 1 else WITHOUT_INTERLEAVING


def apply_tensor_shape_hook(adjust_tensor_shapes_fn: Optional[Callable], *, seq_length: int, micro_batch_size: int,
                            decoder_seq_length: Optional[int], config, tp_group, cp_group):
    """Call adjust_tensor_shapes_fn as Megatron's 1F1B does (the schedules that refuse it did so in their
    refusals). Returns the adjusted (recv, send) shapes, or None without a hook.

    Our messages carry their own shapes, so the result only documents what the user expects to flow.
    """
    if adjust_tensor_shapes_fn is None:
        return None
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
