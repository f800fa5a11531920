"""JSON lines -> Megatron indexed datasets (.bin/.idx), the engine of tools/preprocess_data.py.

Documents are tokenized in a multiprocessing pool (one tokenizer per worker), in batches, and written in input
order through megatron-core's IndexedDatasetBuilder, so Megatron-LM reads the result and we read its files.
Each output is written under a temporary name and renamed only when the whole input has been read: the .bin
first, the .idx last (after removing any older .idx), so a crash never leaves a pair that looks complete.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy

from .text_tokenizers import DEFAULT_EOD_TOKEN, TextTokenizer, load_tokenizer

LINES_PER_BATCH = 64


class PreprocessError(ValueError):
    """Input that cannot be converted; the message is one line meant for the user."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to load its own copy of the tokenizer (tokenizers are not shared across processes)."""

    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_json: Optional[str] = None
    eod_token: str = DEFAULT_EOD_TOKEN

    def load(self) -> TextTokenizer:
        return load_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file, merge_file=self.merge_file,
                              tokenizer_json=self.tokenizer_json, eod_token=self.eod_token)


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    bad_lines: int = 0          # not JSON / no such key / not a string, skipped under skip_bad_lines
    empty_documents: int = 0    # no tokens at all (and no end-of-document token asked for)
    started: float = field(default_factory=time.monotonic)

    @property
    def seconds(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    def rate_line(self) -> str:
        return (f"{self.documents} documents ({self.documents / self.seconds:.1f} docs/s, "
                f"{self.bytes_read / self.seconds / 1e6:.2f} MB/s)")


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: <output-prefix>_<json key>_document(.bin|.idx); pass that to --data-path."""
    return f"{output_prefix}_{key}_document"


# ---- workers ----------------------------------------------------------------------------------------------------

Encoded = Tuple[int, int, object]  # (line number, bytes, {key: ids} or an error message)


def _parse_line(raw: bytes, keys: Sequence[str]):
    """{key: text} of one input line, or an error message."""
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return f"not a JSON line ({str(exc).splitlines()[0]})"
    if not isinstance(record, dict):
        return f"not a JSON object (found {type(record).__name__})"
    texts = {}
    for key in keys:
        if key not in record:
            return f"no {key!r} field (the line's fields: {', '.join(map(str, record)) or 'none'})"
        if not isinstance(record[key], str):
            return f"field {key!r} is {type(record[key]).__name__}, not a string"
        texts[key] = record[key]
    return texts


class LineEncoder:
    """Turns a batch of (line number, raw line) into Encoded results; one per process."""

    def __init__(self, spec: TokenizerSpec, keys: Sequence[str], append_eod: bool):
        self.tokenizer = spec.load()
        self.keys = list(keys)
        self.eod = self.tokenizer.require_eod() if append_eod else None

    def __call__(self, batch: Sequence[Tuple[int, bytes]]) -> List[Encoded]:
        parsed = [(number, len(raw), _parse_line(raw, self.keys)) for number, raw in batch]
        good = [texts for _, _, texts in parsed if isinstance(texts, dict)]
        ids_per_key = {key: self.tokenizer.encode_batch([texts[key] for texts in good]) for key in self.keys}
        results, position = [], 0
        for number, size, texts in parsed:
            if isinstance(texts, str):
                results.append((number, size, texts))
                continue
            ids = {}
            for key in self.keys:
                doc = ids_per_key[key][position]
                ids[key] = doc + [self.eod] if self.eod is not None else doc
            position += 1
            results.append((number, size, ids))
        return results


_worker_encoder: Optional[LineEncoder] = None


def _init_worker(spec: TokenizerSpec, keys: Sequence[str], append_eod: bool) -> None:
    global _worker_encoder
    # Forked: a Python SIGTERM handler of the parent would be inherited, and Pool.terminate's SIGTERM could then
    # leave a worker waiting on the task queue's lock (a test run hung so); the default ends the worker at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_encoder = LineEncoder(spec, keys, append_eod)


def _encode_in_worker(batch):
    return _worker_encoder(batch)


def _in_pool(pool, batches: Iterator, window: int) -> Iterator[List[Encoded]]:
    """Like pool.imap, but with at most ``window`` batches in flight, so memory stays bounded on large inputs."""
    in_flight = collections.deque()
    for batch in batches:
        in_flight.append(pool.apply_async(_encode_in_worker, (batch,)))
        if len(in_flight) >= window:
            yield in_flight.popleft().get()
    while in_flight:
        yield in_flight.popleft().get()


def _batches(path: str) -> Iterator[List[Tuple[int, bytes]]]:
    """Numbered non-blank lines (1-based), LINES_PER_BATCH at a time."""
    batch = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                batch.append((number, raw))
                if len(batch) == LINES_PER_BATCH:
                    yield batch
                    batch = []
    if batch:
        yield batch


# ---- output -----------------------------------------------------------------------------------------------------

class AtomicIndexedWriter:
    """One output prefix: Megatron's builder writing to temporary names, committed by renames."""

    def __init__(self, prefix: str, dtype):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = prefix
        tag = f".tmp{os.getpid()}"
        self.tmp_bin, self.tmp_idx = prefix + ".bin" + tag, prefix + ".idx" + tag
        self.builder = IndexedDatasetBuilder(self.tmp_bin, dtype=dtype)
        self.finalized = False

    def add_document(self, ids: List[int]) -> None:
        self.builder.add_document(numpy.asarray(ids, dtype=self.builder.dtype), [len(ids)])

    def finalize(self) -> None:
        """Write the temporary .idx; nothing visible under the final names yet."""
        self.builder.finalize(self.tmp_idx)
        self.finalized = True

    def commit(self) -> None:
        final_bin, final_idx = self.prefix + ".bin", self.prefix + ".idx"
        if os.path.exists(final_idx):
            os.remove(final_idx)          # an old .idx must never pair with the new .bin
        os.replace(self.tmp_bin, final_bin)
        os.replace(self.tmp_idx, final_idx)

    def abort(self) -> None:
        if not self.builder.data_file.closed:
            self.builder.data_file.close()
        for path in (self.tmp_bin, self.tmp_idx):
            if os.path.exists(path):
                os.remove(path)


def _check_paths(input_path: str, output_prefix: str, keys: Sequence[str], workers: int) -> None:
    if not os.path.isfile(input_path):
        raise PreprocessError(f"--input {input_path} does not exist or is not a file")
    if not keys or any(not key for key in keys):
        raise PreprocessError("--json-keys needs at least one non-empty key")
    if len(set(keys)) != len(keys):
        raise PreprocessError(f"--json-keys names a key twice: {' '.join(keys)}")
    if workers < 1:
        raise PreprocessError(f"--workers must be a positive integer, got {workers}")
    directory = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(directory):
        raise PreprocessError(f"--output-prefix: directory {directory} does not exist")
    if os.path.basename(output_prefix) == "":
        raise PreprocessError(f"--output-prefix {output_prefix!r} names a directory, not a file prefix")


def preprocess(input_path: str, output_prefix: str, spec: TokenizerSpec, *, keys: Sequence[str] = ("text",),
               append_eod: bool = False, workers: int = 1, skip_bad_lines: bool = False,
               progress: Optional[Callable[[PreprocessStats], None]] = None,
               log_interval: int = 1000) -> Tuple[PreprocessStats, Dict[str, str]]:
    """Tokenize every JSON line of ``input_path``; returns the statistics and {key: dataset prefix}.

    A bad line (not JSON, not an object, no such key, not a string) raises PreprocessError naming the line,
    unless ``skip_bad_lines``: then it is skipped and counted. Blank lines are ignored. Raises
    PreprocessError when no document remains. On any error no output file is left under its final name.
    """
    _check_paths(input_path, output_prefix, keys, workers)
    encoder = LineEncoder(spec, keys, append_eod)   # loads the tokenizer once here: bad flags fail early
    from megatron.core.datasets.indexed_dataset import DType  # slow import, only once the flags are good

    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)
    prefixes = {key: output_prefix_for(output_prefix, key) for key in keys}
    writers: Dict[str, AtomicIndexedWriter] = {}
    stats = PreprocessStats()
    pool = None
    next_report = log_interval
    try:
        writers = {key: AtomicIndexedWriter(prefix, dtype) for key, prefix in prefixes.items()}
        if workers > 1:
            pool = multiprocessing.get_context("fork").Pool(workers, _init_worker, (spec, list(keys), append_eod))
            results = _in_pool(pool, _batches(input_path), window=4 * workers)
        else:
            results = map(encoder, _batches(input_path))
        for batch in results:
            for number, size, encoded in batch:
                stats.bytes_read += size
                if isinstance(encoded, str):
                    if not skip_bad_lines:
                        raise PreprocessError(f"{input_path}:{number}: {encoded} "
                                              "(fix the line, or pass --skip-bad-lines to skip such lines)")
                    stats.bad_lines += 1
                    continue
                if all(len(ids) == 0 for ids in encoded.values()):
                    stats.empty_documents += 1
                    continue
                for key, ids in encoded.items():
                    writers[key].add_document(ids)
                stats.documents += 1
                stats.tokens += sum(len(ids) for ids in encoded.values())
            if progress is not None and stats.documents >= next_report:
                progress(stats)
                next_report = (stats.documents // log_interval + 1) * log_interval
        if stats.documents == 0:
            raise PreprocessError(f"--input {input_path} holds no documents"
                                  + (f" ({stats.bad_lines} bad lines skipped)" if stats.bad_lines else "")
                                  + (f" ({stats.empty_documents} empty documents skipped)"
                                     if stats.empty_documents else ""))
        for writer in writers.values():
            writer.finalize()
        for writer in writers.values():
            writer.commit()
        writers = {}
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for writer in writers.values():
            writer.abort()
    return stats, prefixes
