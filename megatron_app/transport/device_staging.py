"""Device tensors through the shared-memory transport: copied straight into the peer's slots, off the caller's thread.

A send of a device tensor returns at once. A small one whose producer's work is done (and nothing queued before it)
is sent on the caller's thread (INLINE_SEND_BYTES: a hand-off costs two thread wake-ups); otherwise one thread per
transport (the stager) then, per message and in order:
waits for the producer's stream (an event recorded at send()), leases the peer's next slot from the core
(`reserve_slot`), has the copy engine copy that chunk device-to-host straight into the slot, and commits each
slot (`commit_slot`) as soon as its copy is done, while the next chunk's copy runs: the receiver copies chunk k out
while chunk k+1 crosses the bus. Links that lend no slots (tcp, rdma) get the tensor staged through pinned memory
by the same thread, then the core's ordinary send. On the receiving side a blocking recv(device=...) of a message
that has not arrived yet claims it (receive_through_slots): its chunks stay in this rank's registered slots and
are copied to the device straight from there, each slot given back once its copy is done; a message that arrived
before it was asked for has been copied into a page-locked arena by the core (transport.py) and goes to the device
from there. CUDA IPC (device_ipc.py) skips the host altogether.

Everything here but the copy engine is device-independent and runs on CPU in the tests (a fake engine); the CUDA
lines are CudaCopyEngine (device_engine.py), the one interface:

    engine.handles(tensor) -> bool        tensors that take this path
    engine.begin(tensor) -> (source, ready)  prepared tensor, event of the producer's stream (sender's thread)
    engine.ready_within(ready, seconds) -> bool   whether `ready` completed, polled for up to `seconds`
    engine.follow(source, ready)          the engine's copies of `source` wait for `ready` (stager's thread)
    engine.to_host(dst, src) -> token     copy src (a flat uint8 device view) into dst (a host uint8 view)
    engine.done(token) / engine.wait(token)
    engine.host_view(address, nbytes)     a uint8 host tensor over memory the core lent
    engine.pinned_like(flat)              page-locked host bytes for a link that lends no slots
    engine.register(address, nbytes) -> None or why not / engine.unregister(address)
    engine.to_device(host, device) -> tensor   (receive: host-to-device)
    engine.empty(shape, dtype, device) -> tensor   a receive's destination
    engine.from_host(dst, src) -> token   copy src (a host uint8 view of a slot) into dst (a flat uint8 device view)
    engine.order_after(tensor, token)     the caller's stream waits (on the device) for the copy `token`
    engine.mark(device) -> token          a timing mark on the device's copy stream (also a token to wait for)
    engine.seconds_between(start, end)    device seconds between two completed marks (a send's transfer_span)

Lifetime rule: as on CPU, the sent tensor must not be written until its handle is done (the stager reads it).
Order: messages to one peer leave in send() order, whichever path each takes (host tensors posted while a device
send to the same peer is queued wait in the same queue).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable, Optional

import torch

from ._core import core
from .sendable import prepare
from .dtypes import dtype_code, dtype_from_code

LOG = logging.getLogger(__name__)

# Chunks whose copies may be in flight at once per message (each holds one leased slot). 2 keeps the copy engine
# busy (chunk k+1 is queued behind chunk k) and never needs more than the 2 slots every ring has.
PIPELINE_DEPTH = 2
SHM_DIRECTORY = "/dev/shm"
# A device send of at most this many bytes to a link that lends slots runs on the caller's thread when the stager
# is idle and the producer's work is done (an IPC send, which never waits on the host, whatever its size): handing
# it to the stager costs two thread wake-ups (the stager's and, the caller still holding the GIL, the GIL's), which
# on the H200 host made a ~300-500 us floor per message; the copy itself takes ~20 us a MiB there. Larger sends,
# and sends whose producer is still running, go to the stager.
INLINE_SEND_BYTES = 1 << 20
# How long send() polls the producer's event before it leaves the send to the stager: a tensor just received
# (its host-to-device copy in flight) or just computed by a short kernel is usually ready within this; when it is
# not, the device is behind the host and the wait costs the device nothing.
READY_SPIN_S = 50e-6


class IpcUnavailable(RuntimeError):
    """CUDA IPC cannot serve a link (the stager falls back to the staged path and says why, once)."""


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, 0-d and empty included)."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def region_fits_shm(nbytes: int, directory: str = SHM_DIRECTORY) -> Optional[str]:
    """None if a region of `nbytes` can be lying in `directory`'s tmpfs, else why not (one line)."""
    try:
        stats = os.statvfs(directory)
    except OSError as error:
        return f"cannot stat {directory}: {error}"
    size = stats.f_blocks * stats.f_frsize
    if nbytes > size:
        return f"{nbytes} bytes of slots exceed {directory}'s {size} bytes"
    return None


def send_through_slots(core, engine, peer: int, tag: int, code: int, shape, source: torch.Tensor,
                       depth: int = PIPELINE_DEPTH, host_view: Optional[Callable] = None) -> int:
    """Sends the flat uint8 `source` (already ordered after its producer) to `peer` through leased slots: each
    chunk is copied by `engine` straight into its slot and committed, in order, once its copy is done, with up to
    `depth` copies in flight. Returns the number of chunks. Zero bytes still send one (empty) chunk."""
    nbytes = source.numel()
    view = host_view or engine.host_view
    in_flight: collections.deque = collections.deque()
    offset, chunks = 0, 0
    try:
        while True:
            # Never more leases than `depth`: the oldest copy finishes (and its slot is published) first.
            while len(in_flight) >= depth or (in_flight and engine.done(in_flight[0])):
                engine.wait(in_flight.popleft())
                core.commit_slot(peer)
            address, length = core.reserve_slot(peer, tag, code, list(shape), nbytes, offset)
            token = engine.to_host(view(address, length), source[offset:offset + length]) if length else None
            in_flight.append(token)
            chunks += 1
            offset += length
            if offset >= nbytes:
                break
        while in_flight:
            engine.wait(in_flight.popleft())
            core.commit_slot(peer)
    except BaseException:
        # Leased slots were never published; the peer sees at most part of this message (as after a failed
        # host send). Copies still in flight must finish before the caller may free `source` or the slots.
        for token in in_flight:
            try:
                engine.wait(token)
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
        raise
    return chunks


def receive_through_slots(core, engine, peer: int, device, timeout=None, depth: int = PIPELINE_DEPTH,
                          host_view: Optional[Callable] = None, device_bound: Optional[Callable] = None,
                          defer: Optional[Callable] = None):
    """Receives the message claimed from `peer` (core.claim_receive) straight out of this rank's slots: each chunk
    is copied by `engine` from its slot into the destination tensor on `device`, with up to `depth` copies in
    flight, so the sender's copy of chunk k+1 into its next slot overlaps ours of chunk k.

    Slot lifetime rule: a slot is released to the sender (core.release_claimed_chunk) only after the engine's copy
    out of it is done (engine.wait / engine.done on its token): the sender may overwrite a released slot at once.
    At most depth - 1 slots are held while the next chunk is awaited, so a ring of two slots never stalls.

    `timeout` bounds the wait for the first chunk (the claim is then withdrawn cleanly); later chunks wait up to
    the transport's timeout_s. Returns the tensor (its copies done), or, for a message that `device_bound(code)`
    says is not a device tensor's bytes (a CUDA IPC descriptor), the core's message tuple (code, shape, nbytes,
    host bytes) gathered on the host. Any failure withdraws the claim (core.cancel_claim; after a chunk was taken
    that closes the link) and raises.

    With `defer`, the copies still running when the last chunk was issued are not waited for on the host: the
    caller's stream is ordered after them (engine.order_after) and each token goes to defer(token), whose owner
    releases its slot once engine.wait(token) returned (the lifetime rule, later: SlotReleaser); until then the
    claim holds the ring, so the owner must do that before the next receive from `peer`, and soon."""
    view = host_view or engine.host_view
    in_flight: collections.deque = collections.deque()
    try:
        code, shape, nbytes, offset, length, address = core.next_claimed_chunk(peer, timeout)
        on_device = device_bound is None or device_bound(code)
        if on_device:
            target = engine.empty(tuple(shape), dtype_from_code(code), device)
            if target.numel() * target.element_size() != nbytes:
                raise ValueError(f"received a malformed message: shape {tuple(shape)} does not describe its "
                                 f"{nbytes} bytes")
            destination = flat_bytes(target)
        else:
            target = destination = torch.empty(nbytes, dtype=torch.uint8)
        received = 0
        while True:
            if offset != received:
                raise RuntimeError(f"the core handed out byte {offset} where byte {received} comes next")
            if length:
                part = view(address, length)
                if on_device:
                    in_flight.append(engine.from_host(destination[offset:offset + length], part))
                else:
                    destination[offset:offset + length].copy_(part)
                    in_flight.append(None)
            else:
                in_flight.append(None)
            received += length
            if received >= nbytes:
                break
            # Free what is done; never wait for the next chunk holding `depth` slots.
            while len(in_flight) >= depth or (in_flight and engine.done(in_flight[0])):
                engine.wait(in_flight.popleft())
                core.release_claimed_chunk(peer)
            # `timeout` bounded the wait for the message; once it is arriving, giving up would close the link
            # (a claimed message cannot be resumed): the rest waits as long as the transport's own timeout.
            code_k, _, nbytes_k, offset, length, address = core.next_claimed_chunk(peer, None)
            if (code_k, nbytes_k) != (code, nbytes):
                raise RuntimeError("the core handed out a chunk of another message")
        if on_device and defer is not None and any(token is not None for token in in_flight):
            engine.order_after(target, [token for token in in_flight if token is not None][-1])
            while in_flight:
                defer(in_flight.popleft())
        while in_flight:
            engine.wait(in_flight.popleft())
            core.release_claimed_chunk(peer)
    except BaseException:
        for token in in_flight:  # nothing may read a slot once the claim is gone
            try:
                engine.wait(token)
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
        try:
            core.cancel_claim(peer)
        except Exception:  # noqa: BLE001 - a closed transport: the original error says more
            pass
        raise
    if on_device:
        return target
    return code, tuple(shape), nbytes, target.numpy()  # a buffer, as the core's own message tuples carry


class SlotReleaser:
    """Gives back the slots of claimed receives' last chunks (receive_through_slots' `defer`) once their copies are
    done, on its own thread: a rank that stops calling the transport (computing, or in a collective with the peer)
    never keeps its peer's ring held (the peer's sends would stall, and a peer that waits for them in turn would never
    join the collective). The transport's receive calls settle() first as well, so the next receive from the peer
    finds its ring free. Releases go in copy order, one releaser at a time."""

    def __init__(self, core, engine):
        self._core = core
        self._engine = engine
        self._pending: collections.deque = collections.deque()  # (peer, copy token), oldest first
        self._settling = threading.Lock()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="megatron_app-slot-releaser", daemon=True)
        self._thread.start()

    def add(self, peer: int, token) -> None:
        with self._wake:
            self._pending.append((peer, token))
            self._wake.notify()

    def pending(self) -> bool:
        return bool(self._pending)

    def settle(self) -> None:
        """Waits for each pending copy and gives its slot back."""
        with self._settling:
            while self._pending:
                peer, token = self._pending[0]
                self._engine.wait(token)
                self._pending.popleft()
                self._core.release_claimed_chunk(peer)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._stopping)
                if self._stopping:
                    return
            try:
                self.settle()
            except Exception as error:  # noqa: BLE001 - a closed transport; the caller's next call says more
                LOG.debug("megatron_app.transport: releasing received slots failed: %s", error)
                with self._wake:
                    self._wake.wait_for(lambda: self._stopping)
                return

    def stop(self) -> None:
        """Stops the thread; copies still reading slots are waited for (their slots stay the receiver's). Idempotent."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with self._settling:
            while self._pending:
                self._engine.wait(self._pending.popleft()[1])


class ReceiveRegions:
    """This rank's slots of each peer's ring, registered with the device once (receive_through_slots copies out of
    them); unregistered by release(), before the core unmaps its segment."""

    def __init__(self, engine):
        self.engine = engine
        self._regions: dict[int, Optional[tuple[int, int]]] = {}
        self._views: dict[int, Callable] = {}
        self._said = False

    def view_for(self, core, peer: int) -> Callable:
        """A host_view for receive_through_slots over `peer`'s ring (registering it first)."""
        view = self._views.get(peer)
        if view is None:
            base, nbytes = core.receive_region(peer)
            problem = self.engine.register(base, nbytes)
            self._regions[peer] = (base, nbytes) if problem is None else None
            if problem is not None and not self._said:
                self._said = True
                LOG.warning("megatron_app.transport: receive slots from peer %d not registered with the device (%s): "
                            "device tensors from it are copied at pageable speed", peer, problem)
            whole = self.engine.host_view(base, nbytes)

            def view(address: int, length: int) -> torch.Tensor:
                start = address - base
                if not 0 <= start <= start + length <= nbytes:
                    raise RuntimeError(f"the core handed out a slot outside peer {peer}'s receive region")
                return whole[start:start + length]

            self._views[peer] = view
        return view

    def registered(self, peer: int) -> bool:
        return bool(self._regions.get(peer))

    def release(self, _core=None) -> None:
        """Unregisters every region (`_core`, unused, keeps the core mapped until this ran)."""
        regions, self._regions = self._regions, {}
        self._views.clear()
        for region in regions.values():
            if region is not None:
                self.engine.unregister(region[0])


def peer_gone_or(core_transport, peer: int, error: BaseException, doing: str) -> BaseException:
    """`error`, or PeerDied / TransportClosed in one line when `peer` is gone: what a peer lent (a CUDA IPC handle,
    an interprocess event) cannot be opened once its process died (CUDA says "invalid resource handle")."""
    if isinstance(error, (core.PeerDied, core.TransportClosed)):
        return error
    try:
        failure = core_transport.peer_failure(peer)
    except Exception:  # noqa: BLE001 - a closed transport: the original error says more
        return error
    if failure is None:
        return error
    died, text = failure
    lines = str(error).strip().splitlines()
    cause = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return (core.PeerDied if died else core.TransportClosed)(f"{text} ({doing} failed: {cause})")


def _peer_gone_or(core_transport, peer: int, error: BaseException) -> BaseException:
    return peer_gone_or(core_transport, peer, error, "a device send")


class DeviceSendHandle:
    """Completion of one send that went through the stager or ran on the caller's thread (SendHandle's interface).
    An IPC send on the caller's thread finishes with its device copy still pending (`_pending`, the engine's
    token; `_source` kept alive until it is done): done() asks the engine, wait() waits for it."""

    __slots__ = ("peer", "tag", "_event", "_error", "_reported", "_pending", "_source", "_engine", "_marks",
                 "_ended_at")

    def __init__(self, peer: int, tag: int):
        self.peer = peer
        self.tag = tag
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._reported = False
        self._pending = self._source = self._engine = None
        self._marks = self._ended_at = None

    completed_on_return = False

    def _finish(self, error: Optional[BaseException] = None, pending=None, source=None, engine=None,
                marks=None) -> None:
        """`marks`: (start, end) of the engine's timing marks around the send's device work (Stager._send)."""
        self._error, self._engine = error, engine
        if marks is not None and error is None:
            self._marks = marks
        if pending is not None:
            self._pending, self._source = pending, source
        else:
            self._ended_at = time.monotonic()
        self._event.set()

    def _copy_done(self, block: bool) -> bool:
        if self._pending is None:
            return True
        if block:
            self._engine.wait(self._pending)
        elif not self._engine.done(self._pending):
            return False
        self._pending = self._source = None
        self._ended_at = time.monotonic()   # an IPC copy's end as first seen
        return True

    def transfer_span(self) -> Optional[tuple]:
        """(start, end) in time.monotonic() seconds of the send's own transfer, for a done device send: from when
        its data was ready on the device (the producer's work done, the copy stream free) to the end of its copies
        (and, through a link that lends no slots, of the host send after them); the device's own timing, placed on
        the host clock by the end, which the host saw. None for a send without marks (host tensors, failures)."""
        if self._marks is None or self._ended_at is None:
            return None
        start, end = self._marks
        self._engine.wait(end)   # recorded right after the send's last copy, which is done: microseconds
        return self._ended_at - self._engine.seconds_between(start, end), self._ended_at

    def done(self) -> bool:
        return self._event.is_set() and self._copy_done(block=False)

    def wait(self, timeout: Optional[float] = None) -> None:
        if not self._event.wait(timeout):
            raise core.TransportTimeout(f"send to peer {self.peer} (tag {self.tag}) not done after {timeout} s")
        if timeout is None:
            self._copy_done(block=True)
        else:  # a device copy has no timed wait: poll it
            give_up_at = time.monotonic() + timeout
            while not self._copy_done(block=False):
                if time.monotonic() >= give_up_at:
                    raise core.TransportTimeout(f"send to peer {self.peer} (tag {self.tag}): its device copy not "
                                                f"done after {timeout} s")
                time.sleep(50e-6)
        if self._error is not None:
            self._reported = True
            raise self._error

    def __repr__(self) -> str:
        return f"DeviceSendHandle(peer={self.peer}, tag={self.tag}, {'done' if self.done() else 'pending'})"


class Stager:
    """The thread that carries device sends (and host sends queued behind them) of one transport, in order."""

    def __init__(self, core, engine, ipc: bool = False, ipc_known_off: Optional[dict] = None):
        """ipc_known_off: {peer: why} for peers IPC cannot serve, known before any send (the rendezvous saw
        another PID namespace): their links are staged, said once at the first device send."""
        self._core = core
        self.engine = engine
        self._ipc = None
        if ipc:
            from .device_ipc import IpcSender

            self._ipc = IpcSender(core, engine)
        self._ipc_off: dict[int, str] = {}  # peer -> why IPC does not serve it
        self._ipc_known_off = dict(ipc_known_off or {})
        self._queue: collections.deque = collections.deque()
        self._queued_per_peer: collections.Counter = collections.Counter()
        self._lock = threading.Condition()
        self._handles: collections.deque = collections.deque()  # DeviceSendHandle, oldest first (_remember)
        self._regions: dict[int, Optional[tuple[int, int]]] = {}  # peer -> registered (address, bytes) or None
        self._region_views: dict[int, tuple[int, int, torch.Tensor]] = {}
        self._fallback_said: set = set()
        self._paths: dict[int, dict[str, int]] = {}  # peer -> {path: messages}, in order of first use (path_of)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="megatron_app-stager", daemon=True)
        self._thread.start()

    # ---- the caller's side ----------------------------------------------------------------------------------
    def busy_with(self, peer: int) -> bool:
        with self._lock:
            return self._queued_per_peer[peer] > 0

    def submit(self, peer: int, tag: int, tensor: torch.Tensor, earlier: list, device_tensor: bool,
               lends_slots: bool) -> DeviceSendHandle:
        """Queues `tensor` for `peer`. `earlier`: handles of the core's sends to `peer` still in flight (they finish first).
        A device tensor is ordered after its producer's stream here, on the caller's thread."""
        handle = DeviceSendHandle(peer, tag)
        source, ready = self.engine.begin(tensor) if device_tensor else (prepare(tensor), None)
        if device_tensor and lends_slots and self._idle(earlier):
            nbytes = source.numel() * source.element_size()
            if self._ipc is not None and nbytes and peer not in self._ipc_off and \
                    self._ipc_inline(handle, peer, tag, source, ready):
                return handle
            if nbytes <= INLINE_SEND_BYTES and self.engine.ready_within(ready, READY_SPIN_S):
                return self._send_inline(handle, peer, tag, source, ready)
        with self._lock:
            if self._stopping:
                raise core.TransportClosed("the transport is closed")
            self._queue.append((handle, peer, tag, source, ready, list(earlier), device_tensor and lends_slots,
                                device_tensor))
            self._queued_per_peer[peer] += 1
            self._remember(handle)
            self._lock.notify_all()
        return handle

    def _idle(self, earlier: list) -> bool:
        """Whether a send may run on the caller's thread now without overtaking anything to its peer: nothing
        queued or in progress on the stager, and the core's earlier sends to the peer done."""
        with self._lock:
            if self._stopping or self._queue or self._working:
                return False
        return all(handle.done() for handle in earlier)

    def _ipc_inline(self, handle: DeviceSendHandle, peer: int, tag: int, source: torch.Tensor, ready) -> bool:
        """An IPC send of any size on the caller's thread: it never waits on the host (the copy waits for the
        producer and for the receiver's last read of the slot on the device; the handle waits for the copy). False,
        nothing sent, when IPC cannot take it now (every slot awaits the receiver, or IPC is off for the peer)."""
        error = pending = marks = None
        try:
            self.engine.follow(source, ready)
            start = self.engine.mark(source.device)
            sent, pending = self._send_by_ipc(peer, tag, dtype_code(source.dtype), tuple(source.shape),
                                              flat_bytes(source))
            marks = (start, self.engine.mark(source.device))
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the handle, as from the stager
            sent, error = True, _peer_gone_or(self._core, peer, exc)
        if not sent:
            return False
        with self._lock:
            self._remember(handle)
            handle._finish(error, pending, source, self.engine, marks)
        return True

    def _send_inline(self, handle: DeviceSendHandle, peer: int, tag: int, source: torch.Tensor, ready):
        """The stager's work for one message, done on the caller's thread (the handle is done on return)."""
        error = pending = marks = None
        try:
            pending, marks = self._send(peer, tag, source, ready, [], True, True)
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the handle, as from the stager
            error = _peer_gone_or(self._core, peer, exc)
        with self._lock:
            self._remember(handle)
            handle._finish(error, pending, source, self.engine, marks)
        return handle

    def _remember(self, handle: DeviceSendHandle) -> None:
        """Keeps `handle` for wait_idle (its error, its IPC copy), forgetting first the oldest ones that succeeded
        and whose copies are done (done() also drops the sent tensor an IPC copy kept alive). Every send prunes: a
        caller that never calls wait_sends (a ping-pong, a training loop between flushes) would otherwise keep every
        IPC-sent tensor alive, and the caching allocator would get fresh device memory for each message it receives
        (cudaMalloc: it synchronises the device). Caller holds the lock."""
        handles = self._handles
        while handles and handles[0]._error is None and handles[0].done():
            handles.popleft()
        if len(handles) >= 256:  # an old send still copying: forget what succeeded behind it
            self._handles = handles = collections.deque(h for h in handles if not h.done() or h._error is not None)
        handles.append(handle)

    def wait_idle(self, timeout: Optional[float] = None) -> None:
        """Waits until everything queued is done; raises the first error not reported by a handle yet."""
        with self._lock:
            if not self._lock.wait_for(lambda: not self._queue and not self._working, timeout):
                raise core.TransportTimeout(f"device sends still in flight after {timeout} s")
            handles, self._handles = self._handles, collections.deque()
        for handle in handles:
            handle._copy_done(block=True)  # IPC copies of sends made on the caller's thread
        for handle in handles:
            if handle._error is not None and not handle._reported:
                handle._reported = True
                raise handle._error

    def path_of(self, peer: int) -> Optional[str]:
        """The paths device sends to `peer` took, in order of first use ('cuda ipc + slots, registered' when
        some messages were staged while the receiver was behind), or None before the first."""
        with self._lock:
            paths = self._paths.get(peer)
            return None if not paths else " + ".join(paths)

    def _took(self, peer: int, path: str) -> None:
        with self._lock:
            paths = self._paths.setdefault(peer, {})
            paths[path] = paths.get(path, 0) + 1

    def stop(self, close_core: Optional[Callable[[], None]] = None) -> None:
        """Stops the thread after the message it is sending (`close_core`, called first, makes the core fail it
        fast), then unregisters every slot region. Queued sends fail with TransportClosed. Idempotent."""
        with self._lock:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            self._lock.notify_all()
        for entry in dropped:
            entry[0]._finish(core.TransportClosed("transport closed before this send started"))
        if close_core is not None:
            close_core()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self._ipc is not None:
            self._ipc.close()
        self.release_regions()

    def release_regions(self) -> None:
        """Unregisters the slot regions (before the core unmaps them)."""
        regions, self._regions = self._regions, {}
        self._region_views.clear()
        for region in regions.values():
            if region is not None:
                self.engine.unregister(region[0])

    # ---- the thread -------------------------------------------------------------------------------------------
    _working = False

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                handle, peer, tag, source, ready, earlier, through_slots, device_tensor = self._queue.popleft()
                self._working = True
            error = marks = None
            try:
                pending, marks = self._send(peer, tag, source, ready, earlier, through_slots, device_tensor)
                self.engine.wait(pending)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
                error = _peer_gone_or(self._core, peer, exc) if isinstance(exc, Exception) else exc
            finally:
                source = ready = None
            with self._lock:
                self._queued_per_peer[peer] -= 1
                self._working = False
                handle._finish(error, engine=self.engine, marks=marks)
                self._lock.notify_all()

    def _send(self, peer: int, tag: int, source: torch.Tensor, ready, earlier: list, through_slots: bool,
              device_tensor: bool) -> tuple:
        """Sends one message; returns (the token of a device copy still reading `source` (IPC), or None; the
        (start, end) timing marks of a device tensor's send, or None). The start mark follows the producer's work
        on the copy stream, the end mark the send's last copy there."""
        for handle in earlier:  # the core's sends to this peer posted before this one
            handle.wait()
        code = dtype_code(source.dtype)
        shape = tuple(source.shape)
        if not device_tensor:  # a host tensor queued behind device sends: the core's ordinary send
            self._core_send(peer, tag, code, shape, flat_bytes(source))
            return None, None
        self.engine.follow(source, ready)
        start = self.engine.mark(source.device)
        flat = flat_bytes(source)
        if through_slots and self._ipc is not None and flat.numel():
            sent, pending = self._send_by_ipc(peer, tag, code, shape, flat)
            if sent:
                return pending, (start, self.engine.mark(source.device))
        if through_slots:
            self._ensure_region(peer)
            self._took(peer, "slots, registered" if self._regions[peer] else "slots, not registered")
            send_through_slots(self._core, self.engine, peer, tag, code, shape, flat,
                               host_view=lambda address, length: self._slot_view(peer, address, length))
        else:
            self._took(peer, "pinned staging")
            host = self.engine.pinned_like(flat)
            if flat.numel():
                self.engine.wait(self.engine.to_host(host, flat))
            self._core_send(peer, tag, code, shape, host)
        return None, (start, self.engine.mark(source.device))

    def _send_by_ipc(self, peer: int, tag: int, code: int, shape, flat: torch.Tensor) -> tuple[bool, object]:
        """(True, the copy's token) once sent through CUDA IPC (device_ipc.py); (False, None): take the staged path
        (IPC cannot serve this peer, said once, or every IPC slot to it awaits the receiver)."""
        if peer not in self._ipc_off:
            reason = self._ipc_known_off.get(peer) or self.engine.ipc_unavailable_reason()
            if reason is None:
                try:
                    sent, pending = self._ipc.send(peer, tag, code, shape, flat)
                except IpcUnavailable as error:
                    reason = str(error)
                else:
                    if sent:
                        self._took(peer, "cuda ipc")
                    return sent, pending
            self._ipc_off[peer] = reason
            self._say_fallback(f"CUDA IPC to peer {peer} is off ({reason}): device tensors to it are staged "
                               "through shared memory")
        return False, None

    def _core_send(self, peer: int, tag: int, code: int, shape, host: torch.Tensor) -> None:
        """The core's ordinary send of the flat uint8 host tensor `host`, waited for."""
        nbytes = host.numel()
        request = self._core.send(peer, tag, code, list(shape), host.data_ptr() if nbytes else 0, nbytes)
        if request is not None:
            request.wait()

    def _ensure_region(self, peer: int) -> None:
        if peer in self._regions:
            return
        address, nbytes = self._core.slot_region(peer)
        problem = region_fits_shm(nbytes)
        registered = False
        if problem is None:
            problem = self.engine.register(address, nbytes)
            registered = problem is None
        if not registered:
            self._say_fallback(f"slots to peer {peer} not registered with the device ({problem}): device "
                               "tensors to it are copied at pageable speed")
        self._regions[peer] = (address, nbytes) if registered else None
        self._region_views[peer] = (address, nbytes, self.engine.host_view(address, nbytes))

    def _slot_view(self, peer: int, address: int, length: int) -> torch.Tensor:
        base, nbytes, whole = self._region_views[peer]
        start = address - base
        if not 0 <= start <= start + length <= nbytes:
            raise RuntimeError(f"the core lent a slot outside peer {peer}'s region")
        return whole[start:start + length]

    def _say_fallback(self, text: str) -> None:
        """One log line per kind of fallback (registration, IPC) and transport."""
        kind = text.split(" ", 1)[0]
        if kind not in self._fallback_said:
            self._fallback_said.add(kind)
            LOG.warning("megatron_app.transport: %s", text)
