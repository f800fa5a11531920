"""A command's exit without the interpreter's last garbage collections over torch's and megatron-core's objects.

Measured here: a process that imported megatron.core took about 1.0 s from its last atexit handler to its end
(0.34 s with torch alone), nearly all of it in the collections the interpreter runs while it finalizes; with every
object frozen first (gc.freeze), 0.12 s. A launch waits for two such exits on its way: the --check-config process's
and the ranks'. Objects left in reference cycles are then not finalized: the trainer closes its files, transport and
tracer itself (its finally, the session's atexit close, which run before this), and the launchers remove a job's
/dev/shm segments whatever happened. For this package's commands only, not for a user's process that imports it.
"""

from __future__ import annotations

import atexit
import gc
import threading

_registered = threading.Event()   # process-wide by nature: atexit is the process's


def skip_final_collections_at_exit() -> None:
    """Registers, once per process, gc.freeze to run after every atexit handler registered later."""
    if _registered.is_set():
        return
    _registered.set()
    atexit.register(gc.freeze)
