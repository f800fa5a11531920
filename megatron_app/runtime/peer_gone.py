"""Which peer is behind an error: the transport's words for a peer that died, in place of a collective's.

A rank's collectives (gloo, NCCL: the trainer's finite check and timings, a user's own all-reduce) can meet a dead
host before the pipeline's own links report it, and then fail with "Connection reset by peer" and a C++ traceback.
The transport knows which peer went away and how (runtime.peer_failures); peer_behind turns such an error into the
PeerDied the user should read. Used by the trainer (train/loop.py) and by the hook of a user's own loop
(one_line_errors.py).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

# How a collective words a peer that went away: gloo ("Connection closed/reset by peer", "Broken pipe"), NCCL
# ("remote process exited or there was a network error", an aborted communicator).
COLLECTIVE_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
                        "Broken pipe", "communicator was aborted")
PEER_NAMING_WAIT_S = 5.0


def peer_behind(error: BaseException, failures: Optional[Callable[[], List[Tuple[bool, str]]]] = None,
                wait_s: float = PEER_NAMING_WAIT_S) -> Optional[BaseException]:
    """A PeerDied naming the peer behind `error`, a collective that failed because a peer went away (TransportClosed
    when every peer gone closed its transport cleanly); None for any other error, or when the transport has not seen
    a peer go within `wait_s` (it may notice a moment after the collective failed). `failures`: (died, why) pairs,
    what the transports know (default: runtime.peer_failures)."""
    from megatron_app.transport import PeerDied, TransportClosed

    if isinstance(error, (PeerDied, TransportClosed)):
        return None
    text = str(error)
    if not any(sign in text for sign in COLLECTIVE_PEER_GONE):
        return None
    if failures is None:
        from .job import peer_failures as failures
    deadline = time.monotonic() + wait_s
    while True:
        known = failures()
        if known or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not known:
        return None
    lines = text.strip().splitlines()
    cause = lines[0] if lines else type(error).__name__
    kind = PeerDied if any(died for died, _ in known) else TransportClosed
    why = "; ".join(text for _, text in known)
    return kind(f"{why} (a collective failed first: {type(error).__name__}: {cause[:200]})")
