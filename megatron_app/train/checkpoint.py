"""Save and resume training: one torch.save file per (pipeline rank, tensor rank), committed by a manifest.

Why not megatron-core's dist_checkpointing: on this CPU-only torch it fails (its filesystem writer calls
torch.cuda.synchronize() while staging tensors, and its save verification allocates on "cuda"), and our
optimizer is plain torch Adam, not a MegatronOptimizer with a sharded_state_dict. Per-rank files in the
layout that wrote them are simple and exact; a checkpoint of another layout is refused (checkpoint_manifest).

A rank file holds its model chunks' state_dicts, the optimizer's state, the learning-rate schedule's (lr_schedule.py),
the RNG states of every data-parallel rank
(python, numpy, torch, CUDA, Megatron's named tracker streams) and the iteration / consumed samples. Data-
parallel rank 0 writes it; all ranks agree the files are written before rank 0 commits the manifest.
"""

from __future__ import annotations

import os
import random
from typing import List, Optional, Tuple

import numpy
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as megatron_random
from megatron_app.devices import collective_device

from .lr_schedule import restore_scheduler
from .checkpoint_manifest import (
    MANIFEST, CheckpointError, FoundCheckpoint, check_compatible, commit, find_checkpoint, iteration_dir,
    manifest_for, rank_file_name)


# ---- RNG ----------------------------------------------------------------------------------------------------------

def capture_rng_state(device_type: str) -> dict:
    """This process's RNG streams, in types torch.load(weights_only=True) accepts."""
    kind, keys, position, has_gauss, cached = numpy.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(numpy.int64)), int(position), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "tracker": megatron_random.get_cuda_rng_tracker().get_states(),
    }
    if device_type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict, device_type: str) -> None:
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    numpy.random.set_state((kind, keys.numpy().astype(numpy.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    megatron_random.get_cuda_rng_tracker().set_states(state["tracker"])
    if device_type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# ---- save ---------------------------------------------------------------------------------------------------------

def _all_ranks_agree(ok: bool, device_type: str) -> bool:
    """True when every rank passes ok=True; a collective, so a failing rank cannot leave the others waiting."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _save_file(payload: dict, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save_checkpoint(save_dir: str, args, chunks: List[torch.nn.Module], optimizer, scheduler, iteration: int,
                    consumed_samples: int) -> str:
    """Collective over all ranks; returns the iteration directory once the checkpoint is committed."""
    directory = iteration_dir(save_dir, iteration)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        stale = os.path.join(directory, MANIFEST)
        if os.path.exists(stale):  # saving this iteration again: uncommitted until the new manifest
            os.remove(stale)
    dist.barrier()

    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    rng_states = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(rng_states, capture_rng_state(args.device), group=dp_group)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    writer = parallel_state.get_data_parallel_rank() == 0
    # Every replica when the optimizer gathers its shards; else only the writer (a state_dict may copy the state).
    collective = getattr(optimizer, "state_dict_is_collective", False)
    optimizer_state = optimizer.state_dict() if collective or writer else None
    error = None
    if writer:
        payload = {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "model": [chunk.state_dict() for chunk in chunks],
            "optimizer": optimizer_state,
            "opt_param_scheduler": scheduler.state_dict(),
            "rng": rng_states,
        }
        try:
            _save_file(payload, os.path.join(directory, rank_file_name(pp_rank, tp_rank)))
        except Exception as exc:  # any failure must reach the vote below, or the other ranks wait forever
            error = exc
    if not _all_ranks_agree(error is None, args.device):
        raise CheckpointError(f"saving {directory} failed on at least one rank"
                              + (f" (here: {error})" if error else "") + "; the checkpoint is not committed")
    if dist.get_rank() == 0:
        files = [rank_file_name(p, t) for p in range(args.pipeline_parallel) for t in range(args.tensor_parallel)]
        commit(save_dir, manifest_for(args, iteration, consumed_samples, files))
    dist.barrier()  # nobody moves on (or exits) before the commit
    return directory


# ---- load ---------------------------------------------------------------------------------------------------------

def load_checkpoint(load_dir: str, args, chunks: List[torch.nn.Module], optimizer, scheduler
                    ) -> Tuple[Optional[FoundCheckpoint], bool]:
    """Restore model, optimizer, learning-rate schedule and RNG from ``load_dir``; returns (checkpoint or None, RNG
    restored).

    None: ``load_dir`` holds no checkpoint yet (the caller starts from scratch). RNG states are restored when
    the data-parallel size is the one that saved them; the model and optimizer under any data-parallel size.
    """
    found = find_checkpoint(load_dir, getattr(args, "save", None))
    if found is None:
        return None, False
    check_compatible(found, args)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    path = os.path.join(found.directory, rank_file_name(pp_rank, tp_rank))
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
    if payload.get("iteration") != found.iteration or len(payload.get("model", ())) != len(chunks):
        raise CheckpointError(f"{path} does not belong to the checkpoint of iteration {found.iteration} "
                              f"with {len(chunks)} model chunks per rank")
    for chunk, state in zip(chunks, payload["model"]):
        chunk.load_state_dict(state, strict=True)
    try:
        optimizer.load_state_dict(payload["optimizer"])
    except ValueError as exc:   # torch: another number or size of parameter groups
        raise CheckpointError(f"{path}: its optimizer state does not fit this run's ({str(exc).splitlines()[0]}; "
                              "--weight-decay 0 keeps every parameter in one group, another value splits off "
                              "biases and norms)") from None
    # after the optimizer's groups, whose saved lr and weight decay it replaces (Megatron-LM's order)
    restore_scheduler(scheduler, payload.get("opt_param_scheduler"), found.consumed_samples, args)
    rng_states = payload["rng"]
    restored = len(rng_states) == parallel_state.get_data_parallel_world_size()
    if restored:
        restore_rng_state(rng_states[parallel_state.get_data_parallel_rank()], args.device)
    return found, restored
