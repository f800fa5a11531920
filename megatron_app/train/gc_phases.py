"""When the package's commands (`python -m megatron_app.train`: the launchers' --check-config and every rank) let
Python's cyclic garbage collector run: not while they import torch and megatron-core, and not as they exit.

Both are its full collections over every object of a process that grows to millions of them. Measured here
(BENCHMARKS.md, "Launch time", tools/bench_gc_phases.py): importing torch, megatron-core, the runtime and the loop
took 2.55 s with the collector on and 1.93 s paused; from the last atexit handler to the process's end 0.96 s, nearly
all in the collections of finalization, and 0.17 s with the objects frozen first. So the program pauses the
collector before it parses its flags; the trainer resumes it once the heavy imports are done (the objects they made
are frozen: kept out of every later collection, their few import-time cycles never freed), before it builds the
model; at exit everything is frozen again. Objects left in reference cycles at exit are then not finalized: the trainer
closes its files, transport and tracer itself (its finally, the session's atexit close, which run before this),
and the launchers remove a job's /dev/shm segments whatever happened. For this package's commands only, not for a
user's process that imports it.
"""

from __future__ import annotations

import atexit
import functools
import gc
import threading

_paused = threading.Event()       # process-wide by nature: the collector is the process's


@functools.cache      # once per process: atexit is the process's
def _freeze_at_exit() -> None:
    atexit.register(gc.freeze)


def pause_collections_while_importing() -> None:
    """The collector off until resume_collections(); gc.freeze registered, once per process, to run after every
    atexit handler registered later."""
    _freeze_at_exit()
    if gc.isenabled():
        gc.disable()
        _paused.set()


def resume_collections() -> None:
    """After the heavy imports: what exists now is frozen (no later collection traverses it) and the collector is
    on again. Nothing when pause_collections_while_importing() did not pause it (an in-process caller's own
    collector is left alone)."""
    if _paused.is_set():
        _paused.clear()
        gc.freeze()
        gc.enable()
