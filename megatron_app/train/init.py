"""Process start-up: torch.distributed, Megatron's parallel state, and RNG seeding.

The CPU path replaces ``tensor_parallel.model_parallel_cuda_manual_seed`` (CUDA-only) with a tracker
that keeps the same named RNG streams on the CPU generator, so Megatron's TP code paths that fork
the "model-parallel-rng" stream (dropout in TP regions, recomputation) keep working.
"""

from __future__ import annotations

import contextlib
import os
import random
from datetime import timedelta

import numpy
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as megatron_random

from megatron_app.devices import local_device
from megatron_app.runtime.exit_grace import let_collective_threads_finish_at_exit


def init_distributed(device_type: str, timeout_minutes: int = 10) -> torch.device:
    """Start the default process group (gloo on CPU, nccl on CUDA) and return this rank's device.

    Under torchrun the env:// variables are used; a bare ``python -m`` run becomes a 1-rank group.
    """
    device = local_device(device_type)
    if device_type == "cuda":
        gpus = torch.cuda.device_count()
        torch.cuda.set_device(device)
        # NCCL refuses two ranks on one GPU; ranks sharing GPUs use gloo for collectives (pipeline tensors go
        # through our transport either way).
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        backend = "nccl" if local_ranks <= gpus else "gloo"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            # Pipeline waits notice a dead peer through the transport within seconds; collectives only by timeout.
            dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    let_collective_threads_finish_at_exit()   # a rank that exits right after a gloo collective must not abort
    return device


def init_model_parallel(tensor_parallel: int, pipeline_parallel: int, model_chunks: int,
                        device_type: str, timeout_minutes: int = 10) -> None:
    """Megatron's rank layout (order tp-cp-ep-dp-pp): rank = tp + T*(dp + D*pp)."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=model_chunks if model_chunks > 1 else None,
        # On CPU the default groups already use gloo; a second gloo copy of each would be waste.
        create_gloo_process_groups=device_type == "cuda",
        distributed_timeout_minutes=timeout_minutes,
    )


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's named RNG streams, kept as CPU generator states."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


def _install_cpu_rng_tracker(tracker: CpuRNGStatesTracker) -> None:
    # get_cuda_rng_tracker() returns this module-level instance once marked initialised.
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_all(seed: int, device_type: str) -> None:
    """Seed like Megatron: per pipeline/data rank for the default stream, per TP rank for TP regions.

    Initial weights do not depend on these streams (see model.reinitialize_by_global_name).
    """
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    rank_seed = seed + 100 * pp_rank + 10 * dp_rank
    random.seed(rank_seed)
    numpy.random.seed(rank_seed)
    torch.manual_seed(rank_seed)
    if device_type == "cuda":
        megatron_random.model_parallel_cuda_manual_seed(rank_seed)
        return
    tracker = CpuRNGStatesTracker()
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, rank_seed)
    # Same offsets as model_parallel_cuda_manual_seed.
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, rank_seed + 2718 + tp_rank)
    tracker.add(megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, rank_seed + 1024)
    _install_cpu_rng_tracker(tracker)


def shutdown(destroy_process_group: bool = True) -> None:
    """Tear down in reverse order; safe to call when start-up stopped half-way. Leave the default
    process group alone when the caller created it (train() embedded in a larger program)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
