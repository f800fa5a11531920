"""Training data: Megatron-Core GPT datasets and Megatron-ordered microbatch iterators.

Mock data (MockGPTDataset) unless ``--data-path`` names Megatron indexed datasets (.bin/.idx), in
which case the same builder makes GPTDatasets (train and, with evaluation, validation splits per
``--split``) over them. Every rank builds the same datasets and the same sample order; a
data-parallel rank keeps only its slice of each microbatch.
"""

from __future__ import annotations

import logging
from typing import Iterator, List, Optional, Union

import torch
from torch.utils.data import DataLoader

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_app.megatron_compat import null_tokenizer

from megatron_app.data.document_data import DocumentDataset, pad_to_longest, padded_lengths, sample_length
from megatron_app.data.synthetic_documents import SyntheticDocuments

from .flags import DEFAULT_SPLIT, completed, counts_samples  # noqa: F401 (DEFAULT_SPLIT re-exported)

# "Unable to save MockGPTDataset indexes because path_to_cache is None", once per split and rank.
logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)


def build_tokenizer(vocab_size: int):
    """Megatron's null tokenizer: ids 0..vocab_size-2 plus end-of-document id vocab_size-1.

    The GPT datasets read only its vocabulary size and end-of-document id, and the id matters only with
    reset_position_ids / reset_attention_mask / eod_mask_loss, all off here.
    """
    return null_tokenizer(vocab_size)


def train_samples(args) -> int:
    """Samples of the whole run (--iters is the total, also when resuming; --train-samples itself when given), as in
    Megatron-LM; the dataset's sample order depends on it, so a resumed run must build the same number."""
    if counts_samples(args):
        return args.train_samples
    return args.iters * args.global_batch_size


def validation_samples(args) -> int:
    """Each evaluation reads the same first eval_iters global batches of the validation split."""
    return args.eval_iters * args.global_batch_size if wants_validation(args) else 0


def wants_validation(args) -> bool:
    return bool(completed(args).eval_interval)


def build_datasets(args):
    """(train, validation or None) GPT datasets; call on every rank (the builder synchronises ranks).

    ``args`` needs seq_length, vocab_size, seed, iters, global_batch_size, data_path and, for validation,
    split, eval_interval and eval_iters. Mock data (MockGPTDataset) when data_path is None, synthetic documents
    (SyntheticDocuments) under --synthetic-microbatches.
    """
    args = completed(args)
    if args.synthetic_plan is not None:    # --synthetic-microbatches: no corpus, no validation split
        return SyntheticDocuments(args.synthetic_plan, args.seed, args.vocab_size, train_samples(args)), None
    data_path = args.data_path
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        tokenizer=build_tokenizer(args.vocab_size),
        blend=get_blend_from_list(list(data_path)) if data_path else None,
        split=args.split if data_path else None,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # the causal mask is built inside attention
    )
    need_validation = wants_validation(args)
    # Splits this run never reads are not built: Megatron's GPTDataset never returns on a split without tokens,
    # which a small corpus's 0.1% test share easily is.
    config.split_matrix[2] = None
    if not need_validation:
        config.split_matrix[1] = None
    sizes = [train_samples(args), validation_samples(args), 0]
    dataset_class = MockGPTDataset
    if data_path:
        dataset_class = DocumentDataset if args.variable_seq_lengths else GPTDataset
    train, valid, _test = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()
    if len(train) < sizes[0]:
        raise ValueError(f"dataset has {len(train)} training samples, the run needs {sizes[0]}")
    if need_validation and len(valid) < sizes[1]:
        raise ValueError(f"dataset has {len(valid)} validation samples, evaluation needs {sizes[1]}")
    return train, (valid if need_validation else None)


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

    def microbatches_from(self, first_sample: int, count: int) -> List[List[int]]:
        """Sample indices of ``count`` microbatches of this rank, the first starting at ``first_sample``."""
        first = first_sample + self.dp_rank * self.micro_batch_size
        return [list(range(first + k * self.span, first + k * self.span + self.micro_batch_size))
                for k in range(count)]


def microbatch_iterator(dataset, sampler: MicrobatchSampler) -> Iterator[dict]:
    """Batches of {'tokens', 'labels', 'loss_mask', 'position_ids'}, each [MBS, seq] (variable-length
    samples: [MBS, longest sample of the microbatch])."""
    collate = pad_to_longest if isinstance(dataset, DocumentDataset) or _blends_documents(dataset) else None
    return iter(DataLoader(dataset, batch_sampler=sampler, num_workers=0, collate_fn=collate))


def _blends_documents(dataset) -> bool:
    return isinstance(getattr(dataset, "datasets", [None])[0], DocumentDataset)


def microbatch_lengths(args, dataset, dp_rank: int, first_sample: int) -> Optional[List[int]]:
    """Padded sequence length of each microbatch this data-parallel rank feeds into the global batch that starts
    at ``first_sample``, in data order (the longest sample of each); None for packed data, whose microbatches all
    have seq_length tokens (the schedule's assumption when told nothing)."""
    if not completed(args).variable_seq_lengths:
        return None
    sampler = MicrobatchSampler(first_sample + args.global_batch_size, args.micro_batch_size, dp_rank,
                                args.data_parallel)
    return padded_lengths(dataset, sampler.microbatches_from(first_sample, args.num_microbatches))


def build_data_iterators(args, num_chunks: int, dp_rank: int, consumed_samples: int = 0,
                         dataset=None, num_samples: Optional[int] = None
                         ) -> Union[Iterator[dict], List[Iterator[dict]]]:
    """One iterator (V == 1) or one per model chunk (V > 1, Megatron's convention), all yielding the same
    microbatches in the same order; a chunk only draws from its own iterator.

    Defaults: the training split, all of the run's samples, starting after ``consumed_samples`` (a resumed run).
    """
    if dataset is None:
        dataset = build_datasets(args)[0]
    total = train_samples(args) if num_samples is None else num_samples

    def make() -> Iterator[dict]:
        sampler = MicrobatchSampler(total, args.micro_batch_size, dp_rank, args.data_parallel,
                                    consumed_samples)
        return microbatch_iterator(dataset, sampler)

    if num_chunks == 1:
        return make()
    return [make() for _ in range(num_chunks)]


def move_batch(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def global_batch_tokens(args, dataset, first_sample: int) -> int:
    """Tokens (padding excluded) of the global batch that starts at ``first_sample``."""
    if not completed(args).variable_seq_lengths:
        return args.global_batch_size * args.seq_length
    return sum(sample_length(dataset, index) for index in range(first_sample, first_sample + args.global_batch_size))
