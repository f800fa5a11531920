"""Text tokenizers for preprocessing and for the trainer's vocabulary size, on Hugging Face ``tokenizers``.

Two sources, as in Megatron-LM: ``GPT2BPETokenizer`` (a GPT-2 ``vocab.json`` + ``merges.txt`` pair, byte-level
BPE with GPT-2's pre-tokenisation regex) and ``HuggingFaceTokenizer`` (a ``tokenizer.json`` file). The end-of-
document token is looked up by its text (GPT-2's ``<|endoftext|>`` unless told otherwise).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence

GPT2_BPE = "GPT2BPETokenizer"
HUGGING_FACE = "HuggingFaceTokenizer"
TOKENIZER_TYPES = (GPT2_BPE, HUGGING_FACE)
DEFAULT_EOD_TOKEN = "<|endoftext|>"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; the message is one line meant for the user."""


@dataclass
class TextTokenizer:
    """A loaded tokenizer: ``encode`` text to ids; ``vocab_size`` counts added tokens too."""

    backend: object          # tokenizers.Tokenizer
    kind: str                # one of TOKENIZER_TYPES
    source: str              # the file(s) it came from, for messages and dataset descriptions
    eod_token: str
    eod: Optional[int]       # None when the vocabulary has no eod_token

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [enc.ids for enc in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def require_eod(self) -> int:
        if self.eod is None:
            raise TokenizerError(f"the end-of-document token {self.eod_token!r} is not in the vocabulary of "
                                 f"{self.source} (give the right one with --eod-token)")
        return self.eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        # Megatron's dataset descriptions serialise the tokenizer through this attribute.
        return OrderedDict(kind=self.kind, source=self.source, vocab_size=self.vocab_size)


def _existing_file(path: Optional[str], flag: str, needed_for: str) -> str:
    if not path:
        raise TokenizerError(f"{needed_for} needs {flag}")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path} does not exist")
    return path


def _finish(backend, kind: str, source: str, eod_token: str) -> TextTokenizer:
    return TextTokenizer(backend, kind, source, eod_token, backend.token_to_id(eod_token))


def gpt2_bpe_tokenizer(vocab_file: Optional[str], merge_file: Optional[str],
                       eod_token: str = DEFAULT_EOD_TOKEN) -> TextTokenizer:
    """GPT-2's byte-level BPE from its vocab.json and merges.txt (no prefix space, GPT-2's split regex)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab_file = _existing_file(vocab_file, "--vocab-file", GPT2_BPE)
    merge_file = _existing_file(merge_file, "--merge-file", GPT2_BPE)
    try:
        with open(vocab_file, encoding="utf-8") as handle:
            if not isinstance(json.load(handle), dict):
                raise ValueError("not a JSON object of token -> id")
        model = models.BPE.from_file(vocab_file, merge_file)
    except Exception as exc:  # the Rust loader raises plain Exception with a short reason
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenizerError(f"cannot load GPT-2 BPE from --vocab-file {vocab_file} and --merge-file "
                             f"{merge_file}: {reason}") from None
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return _finish(backend, GPT2_BPE, f"{vocab_file} + {merge_file}", eod_token)


def tokenizer_from_json(path: Optional[str], eod_token: str = DEFAULT_EOD_TOKEN) -> TextTokenizer:
    """A Hugging Face tokenizer.json (any model the library supports)."""
    from tokenizers import Tokenizer

    path = _existing_file(path, "--tokenizer-json", HUGGING_FACE)
    try:
        backend = Tokenizer.from_file(path)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenizerError(f"cannot load --tokenizer-json {path}: {reason}") from None
    return _finish(backend, HUGGING_FACE, path, eod_token)


def load_tokenizer(tokenizer_type: Optional[str] = None, *, vocab_file: Optional[str] = None,
                   merge_file: Optional[str] = None, tokenizer_json: Optional[str] = None,
                   eod_token: str = DEFAULT_EOD_TOKEN) -> TextTokenizer:
    """The tokenizer the flags name; the type defaults to HuggingFaceTokenizer when a tokenizer.json is given."""
    if tokenizer_type is None:
        tokenizer_type = HUGGING_FACE if tokenizer_json else GPT2_BPE
    if tokenizer_type == GPT2_BPE:
        if tokenizer_json:
            raise TokenizerError(f"--tokenizer-json goes with --tokenizer-type {HUGGING_FACE}, not {GPT2_BPE}")
        return gpt2_bpe_tokenizer(vocab_file, merge_file, eod_token)
    if tokenizer_type == HUGGING_FACE:
        if vocab_file or merge_file:
            raise TokenizerError(f"--vocab-file/--merge-file go with --tokenizer-type {GPT2_BPE}; "
                                 f"{HUGGING_FACE} reads --tokenizer-json")
        return tokenizer_from_json(tokenizer_json, eod_token)
    raise TokenizerError(f"unknown tokenizer type {tokenizer_type!r} (choose from {', '.join(TOKENIZER_TYPES)})")
