"""The receive slots a transport opens when its caller names none: read by the runtime's transport and by the
launchers' /dev/shm estimate alike, before torch is imported (hence a module of its own)."""

from __future__ import annotations

import os

# MiB a slot and slots in all (shared among the peer rings). A message larger than a slot crosses in slot-size
# chunks, each a hand-off between the processes: on one H200, 8 MiB slots (4) moved 16-256 MiB CUDA tensors 1.9-2.3x
# faster than 1 MiB ones (16) and lost at 1-4 MiB (BENCHMARKS.md, 2026-11-27); one run, so the default stays.
SLOT_MIB_ENV, SLOTS_ENV = "MEGATRON_APP_SLOT_MIB", "MEGATRON_APP_SLOTS"
DEFAULT_SLOT_BYTES, DEFAULT_NUM_SLOTS = 1 << 20, 16


def default_slot_geometry(environ=None) -> tuple[int, int]:
    """(slot_bytes, num_slots) from MEGATRON_APP_SLOT_MIB and MEGATRON_APP_SLOTS, each defaulted on its own;
    ValueError, one line, for a value that is not a whole number in range."""
    environ = os.environ if environ is None else environ
    geometry = []
    for name, default, least, most in ((SLOT_MIB_ENV, DEFAULT_SLOT_BYTES >> 20, 1, 1024),
                                       (SLOTS_ENV, DEFAULT_NUM_SLOTS, 2, 1 << 20)):
        raw = environ.get(name, "").strip()
        try:
            value = int(raw) if raw else default
        except ValueError:
            value = None
        if value is None or not least <= value <= most:
            raise ValueError(f"{name}={raw!r} must be a whole number from {least} to {most}")
        geometry.append(value)
    return geometry[0] << 20, geometry[1]
