"""Activation recomputation that redraws the forward's randomness, on CPU and on CUDA.

Megatron-Core's recomputation (tensor_parallel.CheckpointFunction, CheckpointWithoutOutput) saves the generators'
states when a checkpointed part runs forward and puts them back to rerun it in the backward pass, through two
functions of its random module, `_get_all_rng_states` and `_set_all_rng_states`. Two things escape them:
- a CPU-only torch has no CUDA generator to read, so recomputation fails on CPU;
- keyed randomness (keyed_randomness.py) reseeds each layer from its (microbatch, layer) key, and a document's
  dropout reads the running layer. A rerun in the backward pass would key by the microbatch of the moment (under
  Megatron's own 1F1B, the one that last ran forward) and, rerunning only core attention, by the last layer that ran.

install() replaces the two functions once per process (Megatron's module is the process's, whichever job made the
model), keeping Megatron's own on that module: the saved state also holds the keyed randomness's context
(KeyedRandomness.recompute_context) and CUDA's generator only while CUDA runs. With CUDA running and no keyed
randomness they save and restore exactly what Megatron's do, so nothing else changes.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .job import current_job

_MEGATRONS_OWN = "_megatron_app_replaced_rng_functions"   # on Megatron's random module once install() ran


def install() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    if hasattr(megatron_random, _MEGATRONS_OWN):
        return
    setattr(megatron_random, _MEGATRONS_OWN,
            (megatron_random._get_all_rng_states, megatron_random._set_all_rng_states))
    megatron_random._get_all_rng_states = saved_states
    megatron_random._set_all_rng_states = restore_states


def _megatron_functions() -> Tuple:
    from megatron.core.tensor_parallel import random as megatron_random

    return getattr(megatron_random, _MEGATRONS_OWN)


def _cuda_runs() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def saved_states() -> tuple:
    """The generators' states (CPU; CUDA's or None; Megatron's named streams) and the keyed randomness's context."""
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_get, _ = _megatron_functions()
    if _cuda_runs():
        states = tuple(megatron_get())
    else:
        states = (torch.get_rng_state(), None, megatron_random.get_cuda_rng_tracker().get_states())
    keyed = current_job().keyed_randomness
    return states + (None if keyed is None else keyed.recompute_context(),)


def restore_states(cpu_state, cuda_state, tracker_states, keyed_context=None) -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    _, megatron_set = _megatron_functions()
    if cuda_state is not None:
        megatron_set(cpu_state, cuda_state, tracker_states)
    else:
        torch.set_rng_state(cpu_state)
        megatron_random.get_cuda_rng_tracker().set_states(tracker_states)
    keyed = current_job().keyed_randomness
    if keyed is not None and keyed_context is not None:
        keyed.restore_recompute_context(keyed_context)
