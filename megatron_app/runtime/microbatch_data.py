"""Hand each microbatch its own data, whatever order the policy runs the microbatches in."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional


class MicrobatchReplay:
    """Wraps one chunk's data iterator so that `next()` during microbatch i's forward yields item i.

    Megatron's forward_step_func pulls `next(data_iterator)` once per forward of the chunks that need data; the static
    orders pull in microbatch order, an adaptive policy may not. Items are read from the real iterator in order and
    kept until their microbatch asks for them, so no item is read twice or skipped.
    """

    def __init__(self, iterator: Iterator[Any]):
        self._source = iterator
        self._fetched = 0                       # items read from the source so far
        self._pending: Dict[int, Any] = {}      # item index -> item, read but not handed out yet
        self._selected: Optional[int] = None

    def select(self, microbatch: int) -> "MicrobatchReplay":
        self._selected = microbatch
        return self

    def __iter__(self) -> "MicrobatchReplay":
        return self

    def __next__(self) -> Any:
        if self._selected is None:
            raise RuntimeError("MicrobatchReplay: next() called outside a forward task")
        index, self._selected = self._selected, None
        while self._fetched <= index:
            self._pending[self._fetched] = next(self._source)
            self._fetched += 1
        return self._pending.pop(index)

    @property
    def held_items(self) -> int:
        return len(self._pending)
