"""Which half of a split backward is running (runtime/split_backward.py sets it): autograd nodes that compute both
an input and a weight gradient in one call (Megatron's local linear layers, the emulated chunks) read it to compute
only the half asked for. Outside the layers so that runtime and emulation share it."""

from __future__ import annotations

import contextlib
from typing import Optional

INPUT, WEIGHT = "input", "weight"
_current: Optional[str] = None


def current() -> Optional[str]:
    """INPUT inside a split backward's B, WEIGHT inside its W, None otherwise (a whole backward)."""
    return _current


@contextlib.contextmanager
def phase(name: str):
    global _current
    previous, _current = _current, name
    try:
        yield
    finally:
        _current = previous
