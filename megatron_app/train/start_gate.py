"""The start gate: a file whose existence lets a rank go on past its imports.

A harness (tools/gpu_check.py) starts the next timed launch while the current one runs and opens its gate when that
one ends, so the launcher's check, torchrun and the imports (about 25 s a launch on an H200 host) overlap another
run's set-up instead of adding to the wall time. Nothing before the gate touches the GPU or the process group. The
rank's wait is the "gate" phase of its start-up record (startup.py).
"""

from __future__ import annotations

import os
import sys
import time

START_GATE_ENV = "MEGATRON_APP_START_GATE"
START_GATE_TIMEOUT_ENV = "MEGATRON_APP_START_GATE_TIMEOUT_S"
START_GATE_OWNER_ENV = "MEGATRON_APP_START_GATE_OWNER"   # the harness's pid: its death ends the wait at once
START_GATE_TIMEOUT_S = 1800.0


class StartGateTimeout(RuntimeError):
    """The start gate did not open in time (the harness that owns it is gone)."""


def wait_for_start_gate(environ=os.environ, poll_s: float = 0.05) -> bool:
    """Waits until the file START_GATE_ENV names exists; False at once where none is named. Raises StartGateTimeout
    after START_GATE_TIMEOUT_ENV seconds (default 30 minutes), or as soon as the process START_GATE_OWNER_ENV names
    is gone, so an orphaned launch never waits on."""
    path = environ.get(START_GATE_ENV, "")
    if not path:
        return False
    try:
        timeout_s = float(environ.get(START_GATE_TIMEOUT_ENV, START_GATE_TIMEOUT_S))
    except ValueError:
        raise StartGateTimeout(f"{START_GATE_TIMEOUT_ENV} must be a number of seconds, got "
                               f"{environ.get(START_GATE_TIMEOUT_ENV)!r}") from None
    owner = environ.get(START_GATE_OWNER_ENV, "")
    deadline = time.monotonic() + timeout_s
    if not os.path.exists(path):
        print(f"megatron_app.train: rank {environ.get('RANK', '0')} waits for its start gate {path}", file=sys.stderr,
              flush=True)
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            raise StartGateTimeout(f"the start gate {path} ({START_GATE_ENV}) did not open within {timeout_s:g} s")
        if owner and not _alive(owner):
            raise StartGateTimeout(f"the start gate {path} ({START_GATE_ENV}) will not open: its owner, process "
                                   f"{owner}, is gone")
        time.sleep(poll_s)
    return True


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:   # alive, another user's
        return True
    return True
