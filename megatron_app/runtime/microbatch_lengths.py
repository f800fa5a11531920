"""The sequence length of each microbatch of the next iteration, told to the schedule by the training loop.

Every rank must tell the same lengths (all ranks build the same sample order). Without a call, the schedule assumes
equal lengths, as before. The lengths wait on the current job (job.py, next_call.py) for its next call.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from .job import current_job


def set_microbatch_lengths(seq_lengths: Sequence[int]) -> None:
    """Padded sequence length of each microbatch of the next forward_backward call, in data order."""
    current_job().next_call.set_lengths(seq_lengths)


def take_microbatch_lengths(num_microbatches: int) -> Optional[Tuple[int, ...]]:
    """The lengths told for this call (consumed), or None when the loop told none."""
    return current_job().next_call.take_lengths(num_microbatches)
