"""Training data: Megatron-Core GPT datasets and Megatron-ordered microbatch iterators.

Mock data (MockGPTDataset) unless ``--data-path`` names Megatron indexed datasets (.bin/.idx), in
which case the same builder makes a GPTDataset over them. Every rank builds the same dataset and
the same sample order; a data-parallel rank keeps only its slice of each microbatch.
"""

from __future__ import annotations

import logging
from typing import Iterator, List, Optional, Sequence, Union

import torch
from torch.utils.data import DataLoader

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizer

# "Unable to save MockGPTDataset indexes because path_to_cache is None", once per split and rank.
logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)


def build_tokenizer(vocab_size: int):
    """Megatron's null tokenizer: ids 0..vocab_size-2 plus end-of-document id vocab_size-1."""
    return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=vocab_size - 1)


def build_train_dataset(seq_length: int, vocab_size: int, num_samples: int, seed: int,
                        data_path: Optional[Sequence[str]] = None):
    """The training split; call on every rank (the builder synchronises ranks when distributed)."""
    tokenizer = build_tokenizer(vocab_size)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        blend=get_blend_from_list(list(data_path)) if data_path else None,
        split="100,0,0" if data_path else None,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # the causal mask is built inside attention
    )
    dataset_class = GPTDataset if data_path else MockGPTDataset
    train, _valid, _test = BlendedMegatronDatasetBuilder(
        dataset_class, [num_samples, 0, 0], lambda: True, config).build()
    if len(train) < num_samples:
        raise ValueError(f"dataset has {len(train)} samples, the run needs {num_samples}")
    return train


class MicrobatchSampler:
    """Megatron's pretraining order: the k-th microbatch step of the run covers samples
    [k*MBS*D, (k+1)*MBS*D) and data-parallel rank r takes samples [k*MBS*D + r*MBS, ... + MBS).

    So the global batch of an iteration is the same set of samples for any D.
    """

    def __init__(self, total_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.total_samples = total_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.span = micro_batch_size * dp_size
        self.consumed_samples = consumed_samples

    def __len__(self) -> int:
        return max(0, (self.total_samples - self.consumed_samples) // self.span)

    def __iter__(self) -> Iterator[List[int]]:
        first = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - self.span + 1, self.span):
            yield list(range(start + first, start + first + self.micro_batch_size))


def microbatch_iterator(dataset, sampler: MicrobatchSampler) -> Iterator[dict]:
    """Batches of {'tokens', 'labels', 'loss_mask', 'position_ids'}, each [MBS, seq]."""
    return iter(DataLoader(dataset, batch_sampler=sampler, num_workers=0))


def build_data_iterators(args, num_chunks: int, dp_rank: int,
                         consumed_samples: int = 0) -> Union[Iterator[dict], List[Iterator[dict]]]:
    """One iterator (V == 1) or one per model chunk (V > 1, Megatron's convention), all yielding
    the same microbatches in the same order; a chunk only draws from its own iterator."""
    total = consumed_samples + args.iters * args.global_batch_size
    dataset = build_train_dataset(args.seq_length, args.vocab_size, total, args.seed, args.data_path)

    def make() -> Iterator[dict]:
        sampler = MicrobatchSampler(total, args.micro_batch_size, dp_rank, args.data_parallel,
                                    consumed_samples)
        return microbatch_iterator(dataset, sampler)

    if num_chunks == 1:
        return make()
    return [make() for _ in range(num_chunks)]


def move_batch(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}
