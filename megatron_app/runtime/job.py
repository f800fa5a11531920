"""The per-job context: everything one training job's runtime needs, handed down explicitly from here.

An AppJob holds the settings, the hand-off of the loop's next call (next_call.py), the keyed randomness, the
transport wrappers, what install() changed in Megatron (Installation) and the session (transport, tracer, policies,
learnt costs; opened by the first forward_backward call, closed by shutdown()). forward_backward_app resolves the
job once per call and passes it down; nothing below reads module state.

The public functions (install, set_microbatch_lengths, set_iteration, shutdown, ...) take no job argument, so they
act on the one current job of the process, made by install() or by the first call that needs it.
"""

from __future__ import annotations

import atexit
from typing import Callable, Dict, List, Optional, Tuple

from megatron_app.trace.schema import FIRST_ITERATION

from .exit_grace import let_collective_threads_finish_at_exit
from .next_call import NextCall
from .session import RuntimeSession, TransportWrapperFactory
from .settings import AppSettings


class Installation:
    """What this job replaced in Megatron's modules, with the originals to put back (None: not replaced)."""

    def __init__(self):
        self.schedule_functions: Optional[Dict[str, Callable]] = None   # megatron's forward_backward functions
        self.linear_backward: Optional[Callable] = None                 # the local linear node's backward


class AppJob:
    def __init__(self, settings: Optional[AppSettings] = None):
        self.settings = settings or AppSettings()
        self.next_call = NextCall()
        self.keyed_randomness = None            # keyed_randomness.KeyedRandomness once enabled
        self.installation = Installation()
        # wrapper(transport, pipeline global ranks) -> transport, applied in the order added (session.py)
        self.transport_wrappers: List[TransportWrapperFactory] = []
        self._session: Optional[RuntimeSession] = None
        # A training call's trace iteration = the session's training calls before it + this offset: FIRST_ITERATION
        # (counted from 1) until the loop tells its own number (set_iteration: a resumed run continues).
        self._iteration_offset = FIRST_ITERATION

    def tell_iteration(self, iteration: int) -> None:
        """The next training call is the loop's iteration `iteration`; the calls after it count on from there."""
        calls = self._session.training_calls if self._session is not None else 0
        self._iteration_offset = iteration - calls

    def trace_iteration(self, training_calls: int) -> int:
        """The trace iteration of the training call that follows `training_calls` earlier ones."""
        return training_calls + self._iteration_offset

    def use_settings(self, settings: AppSettings) -> None:
        self.settings = settings
        if self._session is not None:
            self._session.settings = settings

    @property
    def session(self) -> RuntimeSession:
        """The open session, opened now if none is (every rank reaches its first call together)."""
        if self._session is None:
            self._session = RuntimeSession(self.settings, self.transport_wrappers)
            let_collective_threads_finish_at_exit()    # runs after the close below: atexit is last in, first out
            atexit.register(self._session.close)
        return self._session

    @property
    def open_session(self) -> Optional[RuntimeSession]:
        return self._session

    def close_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


# The one reference the argument-less public API needs; everything else gets the job handed down.
_current: Optional[AppJob] = None


def current_job() -> AppJob:
    global _current
    if _current is None:
        _current = AppJob()
    return _current


def current_session() -> RuntimeSession:
    """The current job's session (opened now if none is)."""
    return current_job().session


def shutdown() -> None:
    """Close the transport and flush the trace; the next call starts a new session."""
    if _current is not None:
        _current.close_session()


def current_tracer():
    """The tracer of this process (None before the first call), for the trainer's optimizer events."""
    session = None if _current is None else _current.open_session
    return None if session is None else session.tracer


def peer_failures() -> List[Tuple[bool, str]]:
    """(died, why) for each peer of this process's open transports that died or closed its transport, as the
    transport words it (empty: none known). A rank whose collective (gloo, NCCL) failed asks this to name the peer
    behind the failure."""
    session = None if _current is None else _current.open_session
    found: List[Tuple[bool, str]] = []
    for transport in session.transports if session is not None else []:
        for peer in transport.peers:
            try:
                failure = transport.peer_failure(peer)
            except Exception:  # noqa: BLE001 - a transport closed under us knows nothing more
                failure = None
            entry = None if failure is None else (bool(failure[0]), str(failure[1]))
            if entry is not None and entry not in found:
                found.append(entry)
    return found


def add_transport_wrapper(wrapper: TransportWrapperFactory) -> None:
    """Wrap every transport the runtime opens from now on in this job (see TransportWrapper)."""
    current_job().transport_wrappers.append(wrapper)


def remove_transport_wrapper(wrapper: TransportWrapperFactory) -> None:
    wrappers = current_job().transport_wrappers
    if wrapper in wrappers:
        wrappers.remove(wrapper)
