"""Variable-length samples: one document per sample (no packing), each microbatch padded to its own longest sample.

Megatron's GPTDataset packs documents into fixed seq_length + 1 windows. Under ``--variable-seq-lengths`` a sample
is instead one document of the indexed dataset, truncated to seq_length + 1 tokens (tokens = all but the last,
labels = all but the first), so a sample holds 1..seq_length training positions. DocumentDataset is a
MegatronDataset, so Megatron's builder does the train/valid split (by document) and weighted blends as for
GPTDataset. ``pad_to_longest`` collates a microbatch: padding goes at the end (causal attention: a real token never
sees a later pad) and its loss_mask is 0. ``pack_documents`` collates a packed microbatch instead: the documents
concatenated in one row, no padding, position ids restarting at each document and ``cu_seqlens`` (the documents'
bounds) for attention, which stays inside each document (Megatron's PackedSeqParams; train/attention.py).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy
import torch

from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset

from .synthetic_documents import SyntheticDocuments

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
CU_SEQLENS = "cu_seqlens"   # a packed batch's extra key: [documents + 1] int32 bounds in its one row
PAD_TOKEN_ID = 0   # any valid id: padded positions are masked out of the loss and seen by no real token


class DocumentDataset(MegatronDataset):
    """Sample i is one whole document (truncated), documents in a seeded random order, epoch after epoch.

    Documents with fewer than two tokens hold no training position and are left out.
    """

    def __init__(self, indexed_dataset, dataset_path, indices, num_samples, index_split, config):
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, index_split, config)
        lengths = numpy.asarray(indexed_dataset.sequence_lengths)[indices]
        usable = numpy.asarray(indices)[lengths >= 2]
        if len(usable) == 0:
            raise ValueError(f"{dataset_path}: the {index_split.name} split has no document of two or more tokens")
        wanted = len(usable) if num_samples is None else max(int(num_samples), 1)
        epochs = -(-wanted // len(usable))
        rng = numpy.random.RandomState(config.random_seed)
        self.sample_documents = numpy.concatenate([rng.permutation(usable) for _ in range(epochs)])
        self._document_lengths = numpy.asarray(indexed_dataset.sequence_lengths)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset) -> int:
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config):
        return GPTDataset.build_low_level_dataset(dataset_path, config)

    def __len__(self) -> int:
        return len(self.sample_documents)

    def sample_length(self, index: int) -> int:
        """Training positions of sample ``index`` (its padded-free length), from the index alone."""
        document_tokens = int(self._document_lengths[self.sample_documents[index]])
        return min(document_tokens, self.config.sequence_length + 1) - 1

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        document = int(self.sample_documents[index])
        length = self.sample_length(index)
        ids = torch.from_numpy(self.dataset.get(document, offset=0, length=length + 1).astype(numpy.int64))
        return {
            "tokens": ids[:-1],
            "labels": ids[1:],
            "loss_mask": torch.ones(length, dtype=torch.float),
            "position_ids": torch.arange(length, dtype=torch.int64),
        }


def sample_length(dataset, index: int) -> int:
    """Length of sample ``index`` of a DocumentDataset, SyntheticDocuments or Megatron's BlendedDataset over
    DocumentDatasets."""
    if isinstance(dataset, (DocumentDataset, SyntheticDocuments)):
        return dataset.sample_length(index)
    if hasattr(dataset, "dataset_index"):   # megatron.core.datasets.blended_dataset.BlendedDataset
        if dataset.dataset_index is None:
            dataset[index]   # BlendedDataset loads its index arrays lazily, on first access
        return sample_length(dataset.datasets[int(dataset.dataset_index[index])],
                             int(dataset.dataset_sample_index[index]))
    raise TypeError(f"{type(dataset).__name__} has no per-sample lengths (variable-length data needs "
                    "DocumentDataset)")


def padded_lengths(dataset, microbatches: Sequence[Sequence[int]]) -> List[int]:
    """The padded length of each microbatch (the longest of its samples), without reading any token."""
    return [max(sample_length(dataset, index) for index in samples) for samples in microbatches]


def pad_to_longest(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack samples of different lengths into [MBS, longest]; padding at the end, out of the loss."""
    longest = max(sample["tokens"].numel() for sample in samples)
    batch = {}
    for key in BATCH_KEYS:
        rows = []
        for sample in samples:
            value = sample[key]
            missing = longest - value.numel()
            if key == "position_ids":
                rows.append(torch.arange(longest, dtype=value.dtype))
            else:
                fill = 0 if key == "loss_mask" else PAD_TOKEN_ID
                rows.append(torch.cat([value, value.new_full((missing,), fill)]))
        batch[key] = torch.stack(rows)
    return batch


def pack_documents(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Concatenate whole samples into one row [1, sum of lengths]: no padding; position ids restart per document."""
    batch = {key: torch.cat([sample[key] for sample in samples]).unsqueeze(0) for key in BATCH_KEYS}
    lengths = torch.tensor([sample["tokens"].numel() for sample in samples], dtype=torch.int32)
    batch[CU_SEQLENS] = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
    return batch
