"""Slow-link emulation: messages on one pipeline link, posted inside a window of each iteration, arrive late.

`--slow-link A-B:START_MS-END_MS:DELAY_MS`: a message between pipeline ranks A and B (either direction) posted
START_MS..END_MS after the iteration began is handed to the transport DELAY_MS later; the link stays FIFO, so a
later message on it never overtakes a delayed one. The sender is not blocked: the send is deferred and posted by the
rank's own thread when due (while it waits for input, or inside an emulated compute wait), so no second thread
touches the transport. SlowLinkNetwork is the same rule for megatron_app.sim.
"""

from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

from megatron_app.schedule import ScheduleConfigError

_SPEC_RE = re.compile(r"^(\d+)-(\d+):([0-9.eE+]+)-([0-9.eE+]+):([0-9.eE+]+)$")


@dataclass(frozen=True)
class SlowLinkSpec:
    rank_a: int
    rank_b: int
    start_ms: float
    end_ms: float
    delay_ms: float

    @classmethod
    def parse(cls, text: str) -> "SlowLinkSpec":
        match = _SPEC_RE.match(str(text).strip())
        if match is None:
            raise ScheduleConfigError(f"--slow-link {text!r} is not A-B:START_MS-END_MS:DELAY_MS (e.g. 1-2:0-300:12)")
        a, b, start, end, delay = match.groups()
        try:
            start_ms, end_ms, delay_ms = float(start), float(end), float(delay)
        except ValueError:
            raise ScheduleConfigError(f"--slow-link {text!r} has a malformed number") from None
        if int(a) == int(b):
            raise ScheduleConfigError(f"--slow-link {text!r} joins a rank to itself")
        if not end_ms > start_ms:
            raise ScheduleConfigError(f"--slow-link {text!r}: the window must end after it starts")
        return cls(int(a), int(b), start_ms, end_ms, delay_ms)

    def check_ranks(self, pipeline_parallel: int) -> None:
        for rank in (self.rank_a, self.rank_b):
            if rank >= pipeline_parallel:
                raise ScheduleConfigError(f"--slow-link rank {rank} is outside 0..{pipeline_parallel - 1}")

    def joins(self, src: int, dst: int) -> bool:
        return {src, dst} == {self.rank_a, self.rank_b}

    def extra_ms(self, src: int, dst: int, since_iteration_ms: float) -> float:
        """Delay of a message src -> dst (pipeline ranks) posted `since_iteration_ms` after the iteration began."""
        if self.joins(src, dst) and self.start_ms <= since_iteration_ms < self.end_ms:
            return self.delay_ms
        return 0.0

    def __str__(self) -> str:
        return f"{self.rank_a}-{self.rank_b}:{self.start_ms:g}-{self.end_ms:g}:{self.delay_ms:g}"


class SlowLinkNetwork:
    """megatron_app.sim's Network interface under the slow-link rule plus a fixed latency on every message."""

    def __init__(self, spec: Optional[SlowLinkSpec], latency_us: float = 0.0):
        self.spec = spec
        self.latency_us = latency_us
        self.iteration_start_us = 0.0
        self._last_arrival: Dict[Tuple[int, int], float] = {}

    def begin_iteration(self, start_us: float) -> None:
        self.iteration_start_us = start_us

    @property
    def min_transfer_us(self) -> float:
        return self.latency_us

    def send(self, src: int, dst: int, posted_us: float) -> Tuple[float, float]:
        if src == dst:
            return posted_us, posted_us
        arrival = posted_us + self.latency_us
        if self.spec is not None and self.spec.joins(src, dst):
            since_ms = (posted_us - self.iteration_start_us) / 1000.0
            arrival += self.spec.extra_ms(src, dst, since_ms) * 1000.0
            arrival = max(arrival, self._last_arrival.get((src, dst), arrival))   # FIFO link
            self._last_arrival[(src, dst)] = arrival
        return posted_us, arrival


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


class DelayedSendTransport:
    """Wraps the runtime's Transport; defers sends on the slow link and posts them when due."""

    def __init__(self, transport, spec: SlowLinkSpec, pp_global_ranks: List[int], pp_rank: int):
        from megatron_app.transport import TransportTimeout

        self._inner = transport
        self._timeout_error = TransportTimeout
        self.spec = spec
        self.pp_rank = pp_rank
        self._pp_of = {g: p for p, g in enumerate(pp_global_ranks)}
        self._queues: Dict[int, Deque[_Deferred]] = collections.defaultdict(collections.deque)   # per peer
        self._iteration_start = time.monotonic()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def begin_iteration(self) -> None:
        self._iteration_start = time.monotonic()

    # ---- sending ------------------------------------------------------------------------------------------------
    def send(self, peer: int, tag: int, tensor):
        self.post_due()
        now = time.monotonic()
        peer_pp = self._pp_of.get(peer)
        queue = self._queues.get(peer)
        delay_s = 0.0 if peer_pp is None else \
            self.spec.extra_ms(self.pp_rank, peer_pp, (now - self._iteration_start) * 1e3) / 1e3
        if delay_s <= 0 and not queue:
            return self._inner.send(peer, tag, tensor)
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
                item.inner = self._inner.send(item.peer, item.tag, item.tensor)
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
        self._inner.wait_sends(timeout)

    # ---- receiving ----------------------------------------------------------------------------------------------
    def poll(self):
        self.post_due()
        return self._inner.poll()

    def wait_any(self, keys, timeout: Optional[float] = None):
        """Like Transport.wait_any, waking up whenever a deferred send falls due to post it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.post_due()
            due = self.next_due()
            if due is None:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self._inner.wait_any(keys, timeout=remaining)
            slice_s = max(0.0, due - time.monotonic())
            if deadline is not None:
                slice_s = min(slice_s, max(0.0, deadline - time.monotonic()))
            try:
                return self._inner.wait_any(keys, timeout=slice_s)
            except self._timeout_error:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def close(self) -> None:
        try:
            if not self._inner.closed:
                self.wait_sends()
        finally:
            self._inner.close()


class LinkDelay:
    """Puts DelayedSendTransport under the runtime session of this process and routes compute waits through it."""

    def __init__(self, spec: SlowLinkSpec):
        self.spec = spec
        self.transport: Optional[DelayedSendTransport] = None

    def begin_iteration(self) -> None:
        if self.transport is None:
            self._install()
        self.transport.begin_iteration()

    def _install(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_app.runtime.session import current_session

        from .emulation import set_wait_function

        group = parallel_state.get_pipeline_model_parallel_group()
        pp_global = dist.get_process_group_ranks(group)
        session = current_session()
        real = session.ensure_transport(pp_global)   # collective on first use: every rank is here together
        self.transport = DelayedSendTransport(real, self.spec, pp_global, dist.get_rank(group))
        session.transport = self.transport
        set_wait_function(self.transport.wait)

    def close(self) -> None:
        from .emulation import set_wait_function

        set_wait_function(None)
        self.transport = None
