"""How emulated compute waits: time.sleep, or a function that also posts due deferred sends (link_delay.py)."""

from __future__ import annotations

import time
from typing import Callable, Optional

_wait: Callable[[float], None] = time.sleep


def emulated_wait(seconds: float) -> None:
    """Stand-in for compute: blocks without using the CPU (a link-delay emulation may post due sends meanwhile)."""
    if seconds > 0:
        _wait(seconds)


def set_wait_function(wait: Optional[Callable[[float], None]]) -> None:
    """Replace how emulated compute waits (None restores time.sleep); used by link_delay to post sends on time."""
    global _wait
    _wait = time.sleep if wait is None else wait
