"""Link-delay emulation: messages on a pipeline link, posted inside a window of each iteration, arrive late.

`--link-delay A-B:START_MS-END_MS:DELAY_MS` (the trainer's; several may be given): a message between pipeline ranks A and B (either direction) posted
START_MS..END_MS after the iteration began is handed to the transport DELAY_MS later; the link stays FIFO, so a
later message on it never overtakes a delayed one. The sender is not blocked: the send is deferred and posted by the
rank's own thread when due (while it waits for input, or inside an emulated compute wait), so no second thread
touches the transport. sim_replay.SlowLinkNetwork is the same rule for megatron_app.sim.
"""

from __future__ import annotations

import collections
import time
from typing import Deque, Dict, List, Optional, Sequence

from megatron_app.sim.network import SlowLink
from megatron_app.transport import TransportTimeout
from megatron_app.transport.protocol import PipelineTransport, TransportWrapper

from .wait import set_wait_function


class _Deferred:
    """A send waiting for its due time; behaves like the transport's SendHandle."""

    __slots__ = ("due", "peer", "tag", "tensor", "owner", "inner")

    def __init__(self, due: float, peer: int, tag: int, tensor, owner: "DelayedSendTransport"):
        self.due, self.peer, self.tag, self.tensor, self.owner = due, peer, tag, tensor, owner
        self.inner = None

    def done(self) -> bool:
        if self.inner is None:
            self.owner.post_due()
        return self.inner is not None and self.inner.done()

    def wait(self, timeout: Optional[float] = None) -> None:
        while self.inner is None:
            self.owner.wait(max(0.0, self.due - time.monotonic()))
        self.inner.wait(timeout)


class DelayWindows:
    """Several --link-delay windows as one rule: a message takes the longest delay of the windows it falls in."""

    def __init__(self, windows: Sequence[SlowLink]):
        self.windows = tuple(windows)

    def delay_at_us(self, src: int, dst: int, time_us: float) -> float:
        return max((window.delay_at_us(src, dst, time_us) for window in self.windows), default=0.0)

    def check_ranks(self, num_stages: int) -> None:
        for window in self.windows:
            window.check_ranks(num_stages)


class DelayedSendTransport(TransportWrapper):
    """Wraps the runtime's Transport; defers sends on the delayed links and posts them when due. `spec`: a SlowLink
    or a DelayWindows (anything with delay_at_us)."""

    def __init__(self, transport: PipelineTransport, spec, pp_global_ranks: List[int], pp_rank: int,
                 iteration_start: Optional[float] = None):
        super().__init__(transport)
        self.spec = spec
        self.pp_rank = pp_rank
        self._pp_of = {g: p for p, g in enumerate(pp_global_ranks)}
        self._queues: Dict[int, Deque[_Deferred]] = collections.defaultdict(collections.deque)   # per peer
        self._iteration_start = time.monotonic() if iteration_start is None else iteration_start

    def begin_iteration(self) -> None:
        self._iteration_start = time.monotonic()

    # ---- sending ------------------------------------------------------------------------------------------------
    def send(self, peer: int, tag: int, tensor):
        self.post_due()
        now = time.monotonic()
        peer_pp = self._pp_of.get(peer)
        queue = self._queues.get(peer)
        delay_s = 0.0 if peer_pp is None else \
            self.spec.delay_at_us(self.pp_rank, peer_pp, (now - self._iteration_start) * 1e6) / 1e6
        if delay_s <= 0 and not queue:
            return self.inner.send(peer, tag, tensor)
        due = max(now + delay_s, queue[-1].due if queue else now)
        deferred = _Deferred(due, peer, tag, tensor, self)
        self._queues[peer].append(deferred)
        return deferred

    def post_due(self, until: Optional[float] = None) -> None:
        """Hand every deferred send due by `until` (default now) to the transport, oldest first per link."""
        until = time.monotonic() if until is None else until
        for queue in self._queues.values():
            while queue and queue[0].due <= until:
                item = queue.popleft()
                item.inner = self.inner.send(item.peer, item.tag, item.tensor)
                item.tensor = None

    def next_due(self) -> Optional[float]:
        dues = [queue[0].due for queue in self._queues.values() if queue]
        return min(dues) if dues else None

    def wait(self, seconds: float) -> None:
        """Sleep `seconds` (emulated compute), posting deferred sends as they fall due."""
        end = time.monotonic() + seconds
        while True:
            due = self.next_due()
            now = time.monotonic()
            if due is None or due >= end:
                if end > now:
                    time.sleep(end - now)
                self.post_due()
                return
            if due > now:
                time.sleep(due - now)
            self.post_due()

    def wait_sends(self, timeout: Optional[float] = None) -> None:
        due = self.next_due()
        while due is not None:
            self.wait(max(0.0, due - time.monotonic()))
            due = self.next_due()
        self.inner.wait_sends(timeout)

    # ---- receiving ----------------------------------------------------------------------------------------------
    def poll(self):
        self.post_due()
        return self.inner.poll()

    def wait_any(self, keys, timeout: Optional[float] = None):
        """Like Transport.wait_any, waking up whenever a deferred send falls due to post it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.post_due()
            due = self.next_due()
            if due is None:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self.inner.wait_any(keys, timeout=remaining)
            slice_s = max(0.0, due - time.monotonic())
            if deadline is not None:
                slice_s = min(slice_s, max(0.0, deadline - time.monotonic()))
            try:
                return self.inner.wait_any(keys, timeout=slice_s)
            except TransportTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def close(self) -> None:
        try:
            if not self.inner.closed:
                self.wait_sends()
        finally:
            self.inner.close()


class LinkDelay:
    """The --link-delay rule of this process: `wrap` (a runtime transport wrapper) puts a DelayedSendTransport around
    the runtime's transport and routes emulated compute waits through it; begin_iteration restarts the windows."""

    def __init__(self, windows: Sequence[SlowLink]):
        self.spec = DelayWindows(windows)
        self.transport: Optional[DelayedSendTransport] = None
        self._iteration_start = time.monotonic()

    def wrap(self, transport: PipelineTransport, pp_global_ranks: List[int]) -> DelayedSendTransport:
        self.transport = DelayedSendTransport(transport, self.spec, pp_global_ranks,
                                              pp_global_ranks.index(transport.rank), self._iteration_start)
        set_wait_function(self.transport.wait)
        return self.transport

    def begin_iteration(self) -> None:
        self._iteration_start = time.monotonic()
        if self.transport is not None:
            self.transport.begin_iteration()

    def close(self) -> None:
        set_wait_function(None)
        self.transport = None
