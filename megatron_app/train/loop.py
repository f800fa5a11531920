"""The training loop: build everything once, then iterate forward_backward + optimizer step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .data import build_data_iterators
from .dumps import dump_grads, dump_weights
from .forward_backward import close_schedule, optimizer_span, select_forward_backward_func
from .init import init_distributed, init_model_parallel, seed_all, shutdown
from .model import build_model_chunks
from .optim import build_optimizer, finalize_model_grads
from .report import IterationReporter, reduce_lm_loss
from .step import forward_step

_RUN_CONFIG_KEYS = (
    "pipeline_parallel", "model_chunks", "tensor_parallel", "data_parallel", "world_size",
    "num_microbatches", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
    "micro_batch_size", "global_batch_size", "iters", "seed", "lr", "schedule", "policy", "device",
)


def run_config(args) -> dict:
    return {key: getattr(args, key) for key in _RUN_CONFIG_KEYS}


@dataclass
class Trainer:
    args: object
    chunks: List[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    data_iterator: object  # one iterator, or one per chunk when V > 1
    forward_backward: Callable
    reporter: IterationReporter


def build_trainer(args) -> Trainer:
    """Model chunks, optimizer, data and schedule; process groups must already exist."""
    seed_all(args.seed, args.device)
    chunks = build_model_chunks(args)
    chunks[0].config.finalize_model_grads_func = finalize_model_grads  # shared by all chunks
    optimizer = build_optimizer(chunks, args.lr)
    data_iterator = build_data_iterators(args, args.model_chunks, parallel_state.get_data_parallel_rank())
    forward_backward = select_forward_backward_func(
        args.schedule, args.policy, None if args.no_trace else args.trace_dir, not args.no_trace, args.device)
    reporter = IterationReporter(run_config(args), args.iters, args.global_batch_size * args.seq_length,
                                 args.log_json)
    return Trainer(args, chunks, optimizer, data_iterator, forward_backward, reporter)


def train_step(trainer: Trainer, iteration: int) -> Optional[float]:
    """One iteration (1-based); returns the global-batch loss on the last stage, None elsewhere."""
    args = trainer.args
    trainer.optimizer.zero_grad(set_to_none=True)
    losses_reduced = trainer.forward_backward(
        forward_step_func=forward_step,
        data_iterator=trainer.data_iterator,
        model=trainer.chunks,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=False,
    )
    if iteration == 1 and args.dump_grads:
        dump_grads(trainer.chunks, args.dump_grads)
    with optimizer_span(args.schedule, iteration):
        trainer.optimizer.step()
    return reduce_lm_loss(losses_reduced)


def train(args) -> None:
    """Run ``args.iters`` iterations on this rank (one process per rank, launched by torchrun).

    ``args`` comes from args.parse_args. An existing default process group is used and left open.
    """
    owns_process_group = not dist.is_initialized()
    init_distributed(args.device)
    trainer = None
    try:
        init_model_parallel(args.tensor_parallel, args.pipeline_parallel, args.model_chunks, args.device)
        trainer = build_trainer(args)
        if trainer.reporter.enabled:
            print("megatron_app.train: " + " ".join(f"{k}={v}" for k, v in run_config(args).items()), flush=True)
        for iteration in range(1, args.iters + 1):
            start = time.perf_counter()
            loss = train_step(trainer, iteration)
            trainer.reporter.record(iteration, loss, time.perf_counter() - start)
        if args.dump_weights:
            dump_weights(trainer.chunks, args.dump_weights)
    finally:
        if trainer is not None:
            close_schedule(args.schedule)
        shutdown(destroy_process_group=owns_process_group)
