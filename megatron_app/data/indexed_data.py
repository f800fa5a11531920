"""Checks on Megatron indexed datasets (.bin/.idx pairs) before training starts.

Megatron's reader asserts on a bad header and trusts the .idx to describe the .bin; a mismatched pair then
fails deep inside a data-loader worker or, worse, reads garbage tokens. Here each prefix's index is read, the byte
count the .idx implies is compared with the .bin's size, and the largest token id is found so the model's
vocabulary can be sized from (or checked against) the data.

The index, the --data-path blend and the --split matrix are read here as Megatron-Core reads them
(indexed_dataset._IndexReader, utils.get_blend_from_list, blended_megatron_dataset_config's split functions),
without importing megatron-core: a launcher's --check-config then needs neither it nor its import, which took 12-16
s of every launch on an H200 host (2.4 s here). tests/test_data_path.py holds each of them to Megatron's own answer.
The ranks build their datasets with Megatron-Core's builder.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import numpy

_SCAN_CHUNK = 1 << 24  # tokens per step of the max-id scan (64 MiB of int32)


class DataError(ValueError):
    """An indexed dataset that cannot be trained on; the message is one line meant for the user."""


@dataclass(frozen=True, eq=False)
class IndexedDataInfo:
    prefix: str
    documents: int
    sequences: int
    tokens: int
    dtype: str
    max_token_id: int            # -1 when not scanned
    document_offsets: numpy.ndarray  # token offset of each document's start, plus the total at the end

    def tokens_in_documents(self, begin: int, end: int) -> int:
        return int(self.document_offsets[end] - self.document_offsets[begin])

    def split_ranges(self, split_matrix) -> list:
        """[(first document, end document) or None] per split, with the rounding of Megatron's builder
        (BlendedMegatronDatasetBuilder._build_megatron_dataset_splits)."""
        return [None if bookends is None else
                (int(round(bookends[0] * self.documents)), int(round(bookends[1] * self.documents)))
                for bookends in split_matrix]


# Megatron's .idx header (indexed_dataset._INDEX_HEADER, then version, dtype code, sequence and document counts),
# and the bytes per entry of its three arrays (sequence lengths int32, pointers int64, document indices int64).
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = len(_IDX_MAGIC) + 8 + 1 + 8 + 8
_IDX_BYTES_PER_SEQUENCE = 4 + 8
_IDX_BYTES_PER_DOCUMENT = 8


def _check_files(prefix: str) -> None:
    """The checks Megatron's reader does not make before it fails half-constructed (its __del__ then prints
    'Exception ignored ... AttributeError' after our message): both files exist, the .bin is not empty, the
    .idx header is whole and the .idx is as long as its counts say."""
    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise DataError(f"--data-path: {prefix + suffix} does not exist")
    if os.path.getsize(prefix + ".bin") == 0:
        raise DataError(f"--data-path: {prefix}.bin is empty (re-run tools/preprocess_data.py)")
    idx_path = prefix + ".idx"
    idx_bytes = os.path.getsize(idx_path)
    with open(idx_path, "rb") as handle:
        header = handle.read(_IDX_HEADER_BYTES)
    if len(header) < _IDX_HEADER_BYTES or not header.startswith(_IDX_MAGIC):
        raise DataError(f"--data-path: {idx_path} is not a readable Megatron index "
                        f"({'truncated header' if header.startswith(_IDX_MAGIC[:len(header)]) else 'bad magic'}, "
                        f"{idx_bytes} bytes)")
    sequences, documents = struct.unpack_from("<QQ", header, len(_IDX_MAGIC) + 9)
    needed = _IDX_HEADER_BYTES + sequences * _IDX_BYTES_PER_SEQUENCE + documents * _IDX_BYTES_PER_DOCUMENT
    if idx_bytes < needed:
        raise DataError(f"--data-path: {idx_path} is truncated: its header counts {sequences} sequences and "
                        f"{documents} documents ({needed} bytes) but the file has {idx_bytes} bytes")


# Megatron's token type codes in the .idx header (indexed_dataset.DType).
_IDX_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64, 6: numpy.float64,
               7: numpy.float32, 8: numpy.uint16}


@dataclass(frozen=True, eq=False)
class _Index:
    dtype: type
    sequence_lengths: numpy.ndarray    # int32, tokens of each sequence
    sequence_pointers: numpy.ndarray   # int64, byte offset of each sequence in the .bin
    document_indices: numpy.ndarray    # int64, first sequence of each document, then the sequence count


def _read_index(prefix: str) -> _Index:
    """The .idx as Megatron's _IndexReader reads it: magic, version 1, token type code, sequence and document
    counts, then the sequence lengths, pointers and document indices (a multimodal index's modes follow; not read)."""
    _check_files(prefix)
    path = prefix + ".idx"
    with open(path, "rb") as handle:
        header = handle.read(_IDX_HEADER_BYTES)
    version, code = struct.unpack_from("<QB", header, len(_IDX_MAGIC))
    sequences, documents = struct.unpack_from("<QQ", header, len(_IDX_MAGIC) + 9)
    if version != 1:
        raise DataError(f"--data-path: {path} is not a readable Megatron index (version {version}, Megatron reads 1)")
    if code not in _IDX_DTYPES:
        raise DataError(f"--data-path: {path} is not a readable Megatron index (unknown token type code {code})")
    mapped = numpy.memmap(path, dtype=numpy.uint8, mode="r")
    arrays, offset = [], _IDX_HEADER_BYTES
    for dtype, count in ((numpy.int32, sequences), (numpy.int64, sequences), (numpy.int64, documents)):
        arrays.append(numpy.frombuffer(mapped, dtype=dtype, count=count, offset=offset) if count
                      else numpy.zeros(0, dtype=dtype))
        offset += count * numpy.dtype(dtype).itemsize
    return _Index(_IDX_DTYPES[code], *arrays)


def _token_id_range(bin_path: str, dtype, count: int):
    """(smallest, largest) token id, read in chunks so memory stays bounded."""
    tokens = numpy.memmap(bin_path, dtype=dtype, mode="r", shape=(count,))
    low, high = None, None
    for start in range(0, count, _SCAN_CHUNK):
        chunk = tokens[start:start + _SCAN_CHUNK]
        low = int(chunk.min()) if low is None else min(low, int(chunk.min()))
        high = int(chunk.max()) if high is None else max(high, int(chunk.max()))
    del tokens
    return low, high


def inspect_indexed_dataset(prefix: str, scan_tokens: bool = True) -> IndexedDataInfo:
    """Validate one prefix; raises DataError naming the file and what is wrong."""
    index = _read_index(prefix)
    lengths, pointers = index.sequence_lengths, index.sequence_pointers
    itemsize = numpy.dtype(index.dtype).itemsize
    expected_bytes = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    actual_bytes = os.path.getsize(prefix + ".bin")
    documents = len(index.document_indices) - 1
    if actual_bytes != expected_bytes:
        raise DataError(
            f"--data-path: {prefix}.idx describes {expected_bytes} bytes of {numpy.dtype(index.dtype).name} tokens "
            f"but {prefix}.bin has {actual_bytes} bytes: the pair does not belong together "
            f"(re-run tools/preprocess_data.py)")
    if documents < 1 or len(lengths) == 0:
        raise DataError(f"--data-path: {prefix} holds no documents")
    tokens = expected_bytes // itemsize
    max_id = -1
    if scan_tokens and tokens:
        min_id, max_id = _token_id_range(prefix + ".bin", index.dtype, tokens)
        if min_id < 0:
            raise DataError(f"--data-path: {prefix}.bin holds a negative token id ({min_id})")
    sequence_offsets = numpy.concatenate([[0], numpy.cumsum(lengths, dtype=numpy.int64)])
    document_offsets = sequence_offsets[numpy.asarray(index.document_indices)]
    return IndexedDataInfo(prefix, documents, len(lengths), tokens, numpy.dtype(index.dtype).name, max_id,
                           document_offsets)


_SPLIT_NAMES = ("train", "validation", "test")


def split_matrix_of(split: str):
    """Megatron's split matrix for a '--split' string like '949,50,1': [(first, end) as shares of the documents, or
    None] for train, validation and test. Megatron takes every run of digits and dots as a number, pads to three
    with zeros and normalises; a string it would read otherwise than as written (1e-3) is refused."""
    parts = [part.strip() for part in split.replace("/", ",").split(",")]
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        weights = []
    numbers = re.findall(r"[.0-9]+", split)
    if (not 1 <= len(weights) <= 3 or any(not w >= 0 for w in weights) or not weights[0] > 0
            or numbers != parts):
        raise DataError(f"--split {split!r} must be up to three non-negative numbers TRAIN,VALID,TEST "
                        "with TRAIN > 0, e.g. 949,50,1")
    weights = numpy.array(weights + [0.0] * (3 - len(weights)), dtype=numpy.float64)
    shares = (weights / weights.sum()).tolist()
    ends = [0.0]
    for share in shares:
        ends.append(ends[-1] + share)
    return [(begin, end) if end > begin else None for begin, end in zip(ends[:-1], ends[1:])]


def blend_prefixes(data_path) -> list:
    """The dataset prefixes of a --data-path blend as Megatron's get_blend_from_list reads it: an odd-length list is
    prefixes; an even-length one WEIGHT PREFIX pairs when every weight is a number, prefixes otherwise."""
    items = list(data_path)
    if len(items) % 2 == 0 and all(_is_number(weight) for weight in items[0::2]):
        items = items[1::2]
    return [item.strip() for item in items]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_blend(data_path, split: str, need_validation: bool) -> int:
    """Check every dataset of a --data-path blend and that the splits the run reads hold tokens (Megatron's
    dataset loops forever on an empty split). Returns the largest token id in the blend."""
    matrix = split_matrix_of(split)
    if need_validation and matrix[1] is None:
        raise DataError(f"--split {split} gives the validation split no share, but --eval-interval asks for "
                        "evaluation")
    largest = -1
    for prefix in blend_prefixes(data_path):
        info = inspect_indexed_dataset(prefix)
        largest = max(largest, info.max_token_id)
        for which, bounds in enumerate(info.split_ranges(matrix)):
            if which == 2 or (which == 1 and not need_validation):
                continue  # splits this run never reads are not built
            if bounds is None or info.tokens_in_documents(*bounds) == 0:
                raise DataError(
                    f"--split {split} leaves the {_SPLIT_NAMES[which]} split of {prefix} without tokens "
                    f"({info.documents} documents in all); give that split a larger share or add data")
    return largest
