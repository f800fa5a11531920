"""One whole line to a stream in one write, so lines of ranks sharing a stream never mix.

print(text, file=f) writes the text and its newline in two calls; under PYTHONUNBUFFERED (or write-through stderr)
each call is a write(2) of its own, and another rank's line can land between them ("...)megatron_app: rank 1 ...").
A single write of the line with its newline is atomic on a pipe (under PIPE_BUF bytes) and on a terminal.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO


def say(line: str, stream: Optional[TextIO] = None) -> None:
    """Write `line` and its newline in one call, then flush. Default stream: the current sys.stderr."""
    stream = sys.stderr if stream is None else stream
    stream.write(line + "\n")
    stream.flush()
