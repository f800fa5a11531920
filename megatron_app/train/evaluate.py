"""Validation loss: forward-only passes through the run's forward_backward function (our schedule).

Every evaluation reads the same first ``eval_iters`` global batches of the validation split, so successive
validation losses compare like with like, and a resumed run has no validation position to restore.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from megatron.core import parallel_state

from .flags import completed
from .composed_data import compose_global_batch
from .data import build_data_iterators, microbatch_lengths, validation_samples
from .forward_backward import with_told_lengths
from .report import reduce_lm_loss
from .step import forward_step


def evaluate(args, chunks: List[torch.nn.Module], forward_backward: Callable, valid_dataset) -> Optional[float]:
    """Token-weighted validation loss on last-stage ranks (a collective over the DP group); None elsewhere.

    Under --variable-seq-lengths each validation global batch is composed as training's are (--composition)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    composes = bool(completed(args).variable_seq_lengths)
    iterators = None if composes else build_data_iterators(args, args.model_chunks, dp_rank, dataset=valid_dataset,
                                                           num_samples=validation_samples(args))
    for chunk in chunks:
        chunk.eval()
    entries = []
    try:
        with torch.no_grad():
            for batch in range(args.eval_iters):
                first_sample, num_microbatches = batch * args.global_batch_size, args.num_microbatches
                forward_step_func = forward_step
                if composes:
                    composed = compose_global_batch(args, valid_dataset, dp_rank, first_sample, args.model_chunks)
                    data_iterator, num_microbatches = composed.data_iterator, composed.num_microbatches
                    forward_step_func = composed.forward_step_func
                else:   # the same iterators each batch, carrying this call's lengths (when they vary)
                    data_iterator = with_told_lengths(args.schedule, iterators,
                                                      microbatch_lengths(args, valid_dataset, dp_rank, first_sample))
                entries += forward_backward(
                    forward_step_func=forward_step_func,
                    data_iterator=data_iterator,
                    model=chunks,
                    num_microbatches=num_microbatches,
                    seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size,
                    decoder_seq_length=args.seq_length,
                    forward_only=True,
                )
    finally:
        for chunk in chunks:
            chunk.train()
    return reduce_lm_loss(entries)
