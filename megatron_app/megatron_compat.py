"""The one place that knows how megatron-core's API differs across the supported versions (0.16.x - 0.19.x).

Everything else in megatron_app calls these adapters and never branches on a version. Each adapter detects the
difference from the installed megatron-core itself (a signature, a registered name) where that is reliable, so a
patch release that back-ports a change needs no edit here.

What differs, and since when:
- ``backward_step``: ``(input, output, output_grad, model_type, config)`` up to 0.16; ``model_type`` gone from 0.17.
- the null tokenizer: library ``"null"`` with ``vocab_size`` = ids without end-of-document up to 0.16;
  ``"null-text"`` from 0.17, whose ``vocab_size`` counts the end-of-document id from 0.18.
- ``MultiModuleProcessGroupCollection`` (pipelines spanning several modules' grids) exists from 0.17.
- what the schedule functions refuse of an explicit ``pg_collection`` (read from 0.16.1, 0.17.0, 0.18.0, 0.19.2):
  up to 0.16 each asserts it has tp, cp, embd, pos_embd, pp and dp_cp; from 0.17 only tp and cp, and
  ``forward_backward_pipelining_without_interleaving`` raises TypeError for one that is neither a
  ProcessGroupCollection nor a MultiModuleProcessGroupCollection.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Optional, Tuple

from packaging.version import Version

SUPPORTED_RANGE = ("0.16.0", "0.20.0")   # tested: 0.16.1 and 0.19.2 (CI runs both ends)
ALLOW_UNTESTED_ENV = "MEGATRON_APP_ALLOW_UNTESTED_MEGATRON"


class UnsupportedMegatronError(RuntimeError):
    """The installed megatron-core is outside the tested range (one line, with the way out)."""


def megatron_core_version() -> Version:
    """The installed megatron-core's version, as its package reports it."""
    from megatron.core import package_info

    return Version(package_info.__version__)


def is_supported(version: Version) -> bool:
    low, high = (Version(v) for v in SUPPORTED_RANGE)
    return low <= Version(version.base_version) < high


def check_megatron_version(allow_untested: Optional[bool] = None) -> Version:
    """Refuse an untested megatron-core in one line; ``allow_untested`` (or $MEGATRON_APP_ALLOW_UNTESTED_MEGATRON=1)
    lets it through for the brave."""
    version = megatron_core_version()
    if allow_untested is None:
        allow_untested = os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0")
    if not is_supported(version) and not allow_untested:
        low, high = SUPPORTED_RANGE
        raise UnsupportedMegatronError(
            f"megatron-core {version} is untested with megatron_app (supported: >={low},<{high}); install a "
            f"supported one, or set {ALLOW_UNTESTED_ENV}=1 (install(allow_untested_megatron=True)) to try anyway")
    return version


# ---- backward_step ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _backward_step_takes_model_type() -> bool:
    from megatron.core.pipeline_parallel import schedules

    return "model_type" in inspect.signature(schedules.backward_step).parameters


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """megatron-core's backward_step for one chunk and microbatch, whichever signature it has."""
    from megatron.core.pipeline_parallel import schedules

    if _backward_step_takes_model_type():
        return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


# ---- tokenizer ---------------------------------------------------------------------------------------------------
def null_tokenizer(vocab_size: int):
    """Megatron's null tokenizer with ``vocab_size`` ids in all: 0..vocab_size-2 plus end-of-document vocab_size-1."""
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.core.tokenizers import megatron_tokenizer as registry

    libraries = getattr(registry, "TEXT_LIBRARIES", None) or getattr(registry, "TOKENIZER_LIBRARIES", ())
    library = "null-text" if "null-text" in libraries else "null"   # renamed in 0.17
    # Build as "ids without end-of-document" (<= 0.17); from 0.18 the size counts it, so one id would be missing.
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=vocab_size - 1)
    if tokenizer.vocab_size != vocab_size:
        tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=vocab_size)
    if tokenizer.vocab_size != vocab_size or tokenizer.eod != vocab_size - 1:
        raise RuntimeError(f"megatron-core {megatron_core_version()}: the null tokenizer gives vocabulary "
                           f"{tokenizer.vocab_size} and end-of-document {tokenizer.eod}, expected {vocab_size} and "
                           f"{vocab_size - 1}")
    return tokenizer


# ---- process-group collections -----------------------------------------------------------------------------------
def is_multimodule(pg_collection, p2p_communicator) -> bool:
    """A MultiModuleProcessGroupCollection or MultiModulePipelineCommunicator (megatron-core >= 0.17): a pipeline
    across several modules' grids, with no single .pp/.tp/.cp group."""
    try:
        from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
    except ImportError:   # older megatron-core: the classes do not exist, so nothing can be one
        return False
    return isinstance(pg_collection, MultiModuleProcessGroupCollection) or isinstance(
        p2p_communicator, MultiModulePipelineCommunicator)


# ---- what the schedule functions refuse of an explicit pg_collection -------------------------------------------
_GROUPS_ASSERTED_UP_TO_0_16 = ("tp", "cp", "embd", "pos_embd", "pp", "dp_cp")
_GROUPS_ASSERTED_FROM_0_17 = ("tp", "cp")


@functools.lru_cache(maxsize=None)
def _before_0_17() -> bool:
    return Version(megatron_core_version().base_version) < Version("0.17.0")


def pg_collection_asserted_groups() -> Tuple[str, ...]:
    """The attributes megatron-core's schedule functions assert (``hasattr``) an explicit pg_collection has, in
    their order. 0.17 made ProcessGroupCollection answer None for a group it was not given, and asserts only the
    two it reads."""
    return _GROUPS_ASSERTED_UP_TO_0_16 if _before_0_17() else _GROUPS_ASSERTED_FROM_0_17


def one_chunk_schedule_refuses_type_of(pg_collection) -> bool:
    """Whether forward_backward_pipelining_without_interleaving refuses this pg_collection for its type
    (TypeError): from 0.17 anything but a ProcessGroupCollection or MultiModuleProcessGroupCollection; up to 0.16
    any object with the asserted groups serves."""
    if _before_0_17():
        return False
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection, ProcessGroupCollection

    return not isinstance(pg_collection, (ProcessGroupCollection, MultiModuleProcessGroupCollection))
