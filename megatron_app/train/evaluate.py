"""Validation loss: forward-only passes through the run's forward_backward function (our schedule).

Every evaluation reads the same first ``eval_iters`` global batches of the validation split, so successive
validation losses compare like with like, and a resumed run has no validation position to restore.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from megatron.core import parallel_state

from .data import build_data_iterators, validation_samples
from .report import reduce_lm_loss
from .step import forward_step


def evaluate(args, chunks: List[torch.nn.Module], forward_backward: Callable, valid_dataset) -> Optional[float]:
    """Token-weighted validation loss on last-stage ranks (a collective over the DP group); None elsewhere."""
    iterators = build_data_iterators(args, args.model_chunks, parallel_state.get_data_parallel_rank(),
                                     dataset=valid_dataset, num_samples=validation_samples(args))
    for chunk in chunks:
        chunk.eval()
    entries = []
    try:
        with torch.no_grad():
            for _ in range(args.eval_iters):
                entries += forward_backward(
                    forward_step_func=forward_step,
                    data_iterator=iterators,
                    model=chunks,
                    num_microbatches=args.num_microbatches,
                    seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size,
                    decoder_seq_length=args.seq_length,
                    forward_only=True,
                )
    finally:
        for chunk in chunks:
            chunk.train()
    return reduce_lm_loss(entries)
