"""The sequence length of each microbatch of the next iteration, told to the schedule by the training loop.

Megatron's forward_backward contract passes data iterators, which cannot be peeked without consuming them, so a
loop that trains on variable-length microbatches says their (padded) lengths before each forward_backward call.
Every rank must tell the same lengths (all ranks build the same sample order). Without a call, the schedule assumes
equal lengths, as before.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

_next_lengths: Optional[Tuple[int, ...]] = None


def set_microbatch_lengths(seq_lengths: Sequence[int]) -> None:
    """Padded sequence length of each microbatch of the next forward_backward call, in data order."""
    global _next_lengths
    lengths = tuple(int(length) for length in seq_lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"microbatch lengths must be positive integers, got {list(seq_lengths)!r}")
    _next_lengths = lengths


def take_microbatch_lengths(num_microbatches: int) -> Optional[Tuple[int, ...]]:
    """The lengths told for this call (consumed), or None when the loop told none."""
    global _next_lengths
    lengths, _next_lengths = _next_lengths, None
    if lengths is not None and len(lengths) != num_microbatches:
        raise ValueError(f"{len(lengths)} microbatch lengths were set for a call with {num_microbatches} microbatches")
    return lengths
