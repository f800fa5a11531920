"""Transport: send and receive tensors between the ranks of a job (shared memory within a node).

    with Transport(rank, world_size, job_id) as t:
        h = t.send(peer, make_tag(Direction.FORWARD, vmb), tensor)    # returns at once
        x = t.recv(peer, make_tag(Direction.FORWARD, vmb))            # blocks, ~0% CPU
"""

from __future__ import annotations

import collections
import logging
import math
import os
import weakref
from collections.abc import Iterable, Mapping

import torch

from . import codec
from ._core import core
from .backends import SHM
from .device_ipc import IpcReceiver, ipc_requested, is_descriptor, payload_bytes, IPC_FLAG
from .device_staging import ReceiveRegions, SlotReleaser, Stager, peer_gone_or, receive_through_slots
from .dtypes import dtype_from_code
from .protocol import ClosesOnExit
from .slot_geometry import default_slot_geometry
from .tags import MAX_TAG, describe_tag, validate_tag

LOG = logging.getLogger(__name__)
# Page-locked memory a transport receives device-bound messages into (0: none; messages then take the chunked path).
ARENA_ENV = "MEGATRON_APP_CUDA_RECEIVE_ARENA_MIB"
DEFAULT_ARENA_MIB = 256
# How long a blocked receive of a transport that carries device tensors polls before it sleeps (the core's default,
# for host tensors, is 50 us): a device message's turnaround (CUDA calls and a device copy on each side) outlasts
# 50 us, and a thread woken from sleep on the H200 host cost ~300 us. The spin yields, and gives up at the first
# sign of CPU contention (csrc/shm_tensor_rdma/core/doorbell.cpp), so a rank that waits long still sleeps.
DEVICE_WAIT_SPIN_US = 200
DEVICE_WAIT_SPIN_ENV = "MEGATRON_APP_DEVICE_WAIT_SPIN_US"  # overrides it (a GPU host's A/B: 50 is the core's own)
# A blocking recv(device=...) of a message not arrived yet takes it straight from this rank's registered slots
# (device_staging.receive_through_slots); "0" turns that off (every device-bound message through the arena).
SLOT_RECEIVE_ENV = "MEGATRON_APP_CUDA_RECEIVE_FROM_SLOTS"


TransportTimeout = core.TransportTimeout
PeerDied = core.PeerDied
TransportClosed = core.TransportClosed


def _int_arg(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _timeout_arg(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not timeout >= 0 or math.isnan(timeout):
        raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
    return float(timeout)


def _key_arg(key) -> tuple[int, int]:
    try:
        peer, tag = key
    except (TypeError, ValueError):
        raise TypeError(f"keys must be (peer, tag) pairs, got {key!r}") from None
    return _int_arg(peer, "peer"), validate_tag(tag)


class SendHandle:
    """Completion of one send. Holds the sent tensor until the copy into shared memory is done."""

    __slots__ = ("_request", "_tensor", "peer", "tag")

    def __init__(self, request, tensor: torch.Tensor | None, peer: int, tag: int):
        # request is None for a send that completed inside Transport.send().
        self._request = request
        self._tensor = tensor
        self.peer = peer
        self.tag = tag

    @property
    def completed_on_return(self) -> bool:
        """Whether send() finished the whole send on the caller's thread (no worker involved)."""
        return self._request is None

    def done(self) -> bool:
        if self._request is None:
            return True
        finished = self._request.done()
        if finished:
            self._tensor = None
        return finished

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the send completed; raises its error, or TransportTimeout after `timeout` seconds."""
        if self._request is not None:
            self._request.wait(_timeout_arg(timeout))
            self._tensor = None

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SendHandle(peer={self.peer}, {describe_tag(self.tag)}, {state})"


class Transport(ClosesOnExit):
    """One rank's endpoint. See the package docstring for the semantics of each call."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        job_id: str,
        *,
        slot_bytes: int | None = None,
        num_slots: int | None = None,
        max_message_bytes: int = 1 << 30,
        send_workers: int = 2,
        peers: Iterable[int] | None = None,
        timeout_s: float = 300.0,
        backends: Mapping[int, str] | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        admission_secret: bytes = b"",
        copy_engine=None,
        cuda_ipc: bool | None = None,
        receive_from_slots: bool | None = None,
        ipc_off: Mapping[int, str] | None = None,
    ):
        if not isinstance(job_id, str):
            raise TypeError(f"job_id must be a str, got {type(job_id).__name__}")
        if slot_bytes is None or num_slots is None:
            default_bytes, default_slots = default_slot_geometry()
            slot_bytes = default_bytes if slot_bytes is None else slot_bytes
            num_slots = default_slots if num_slots is None else num_slots
        sizes = {"slot_bytes": slot_bytes, "num_slots": num_slots, "max_message_bytes": max_message_bytes}
        for name, value in sizes.items():
            if _int_arg(value, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_slots >= 1 << 32:
            raise ValueError(f"num_slots must be between 2 and 2**20, got {num_slots}")
        if peers is not None:
            peers = [_int_arg(peer, "peer") for peer in peers]
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
        backends = {_int_arg(peer, "peer"): str(kind) for peer, kind in (backends or {}).items()}
        if not isinstance(admission_secret, bytes):
            raise TypeError(f"admission_secret must be bytes, got {type(admission_secret).__name__}")
        if not isinstance(listen_host, str):
            raise TypeError(f"listen_host must be a str, got {type(listen_host).__name__}")
        self._core = core.Transport(
            rank=_int_arg(rank, "rank"),
            world_size=_int_arg(world_size, "world_size"),
            job_id=job_id,
            slot_bytes=slot_bytes,
            num_slots=num_slots,
            max_message_bytes=max_message_bytes,
            send_workers=_int_arg(send_workers, "send_workers"),
            peers=peers,
            timeout_s=float(timeout_s),
            backends=backends,
            listen_host=listen_host,
            listen_port=_int_arg(listen_port, "listen_port"),
            admission_secret=admission_secret,
        )
        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id
        self.peers = tuple(self._core.peers)
        self._max_message_bytes = max_message_bytes
        self._pending: dict[int, collections.deque] = {}  # per peer: handles keeping unfinished sends' tensors
        # Device tensors go through the stager (device_staging.py): `copy_engine` is its copy engine (None: CUDA's,
        # made at the first CUDA send; tests give a fake one that takes host tensors down the same path).
        self._copy_engine = copy_engine
        self._cuda_ipc = ipc_requested(cuda_ipc)  # device_ipc.py: device buffers between ranks of this host
        self._ipc_off = {_int_arg(peer, "peer"): str(why) for peer, why in (ipc_off or {}).items()}  # known to fail
        self._ipc_receiver = None
        self._stager: Stager | None = None
        self._stager_finalizer = None
        self._arena = None  # page-locked receive buffers (None: not tried yet; False: none)
        self._arena_finalizer = None
        self._keepalive: collections.deque = collections.deque()  # (copy token, host buffer) still being copied
        self._device_traffic = False  # set at the first device send or receive (DEVICE_WAIT_SPIN_US)
        self._receive_regions: ReceiveRegions | None = None  # registered receive slots (receive_through_slots)
        # Gives back the slots of claimed receives' last chunks, whose copies the caller's stream was ordered after
        # instead of the host waiting: each once its copy is done (its own thread; receive calls settle it first).
        self._releaser: SlotReleaser | None = None
        self._receive_finalizer = None
        self._loss_attached = False
        # A blocking device receive takes a message not arrived yet straight from the slots (None: SLOT_RECEIVE_ENV).
        self._slot_receives = (os.environ.get(SLOT_RECEIVE_ENV, "1") != "0" if receive_from_slots is None
                               else bool(receive_from_slots))

    # -- links to other hosts ------------------------------------------------------------------------------------
    @property
    def strangers_dropped(self) -> int:
        """Connections to this rank's listeners dropped before admission (no proof of the job's secret)."""
        return self._core.strangers_dropped

    def backend_of(self, peer: int) -> str:
        """'shm', 'tcp' or 'rdma': how this rank reaches `peer`."""
        return self._core.backend_of(_int_arg(peer, "peer"))

    def peer_failure(self, peer: int) -> tuple[bool, str] | None:
        """(died, why) once `peer` can no longer send to this rank (died: its process or connection is gone, else it
        closed its transport cleanly); None while the link is fine."""
        return self._core.peer_failure(_int_arg(peer, "peer"))

    def local_address(self, backend: str = "tcp") -> str:
        """'host:port' where peers reach this rank over `backend` (ValueError if no peer uses it)."""
        return self._core.local_address(backend)

    def set_peer_addresses(self, addresses: Mapping[int, str]) -> None:
        """Tells the remote backends where each peer listens ({peer: 'host:port'}); sends wait until then."""
        for peer, address in addresses.items():
            if not isinstance(address, str):
                raise TypeError(f"address of peer {peer} must be a 'host:port' str, got {type(address).__name__}")
            self._core.set_peer_address(_int_arg(peer, "peer"), address)

    # -- loss emulation ------------------------------------------------------------------------------------------
    def attach_loss_injector(self, injector) -> None:
        """Run `injector` (a loss_injection.LossInjector) on every message this rank receives; None detaches."""
        core.attach_loss_injector(self._core, injector)
        self._loss_attached = injector is not None  # claimed receives bypass the arrival hook: not while it runs

    # -- sending -----------------------------------------------------------------------------------------------
    def send(self, peer: int, tag: int, tensor: torch.Tensor) -> SendHandle:
        """Posts `tensor` to `peer` under `tag` and returns at once; background workers do the copy."""
        if type(peer) is not int:
            peer = _int_arg(peer, "peer")
        if type(tag) is not int or not 0 <= tag <= MAX_TAG:
            tag = validate_tag(tag)
        if self._ipc_receiver is not None and self._ipc_receiver.released:
            self._flush_ipc_acks()
        if isinstance(tensor, torch.Tensor):
            if tensor.is_cuda if self._copy_engine is None else self._copy_engine.handles(tensor):
                return self._send_staged(peer, tag, tensor, device_tensor=True)
        return self._send_host(peer, tag, tensor)

    def _send_host(self, peer: int, tag: int, tensor) -> SendHandle:
        """The core's send of a host tensor (through the stager while it carries earlier sends to `peer`)."""
        if self._stager is not None and isinstance(tensor, torch.Tensor) and self._stager.busy_with(peer):
            return self._send_staged(peer, tag, tensor, device_tensor=False)  # keeps the order to `peer`
        code, shape, data_ptr, nbytes, host_tensor = codec.encode(tensor)
        request = self._core.send(peer, tag, code, shape, data_ptr, nbytes)
        if request is None:  # already copied into the peer's ring
            return SendHandle(None, None, peer, tag)
        handle = SendHandle(request, host_tensor, peer, tag)
        self._forget_finished_sends()
        self._pending.setdefault(peer, collections.deque()).append(handle)
        return handle

    def _send_staged(self, peer: int, tag: int, tensor: torch.Tensor, device_tensor: bool):
        """Hands the send to the stager's thread (after this peer's sends still in flight in the core)."""
        backend = self._core.backend_of(peer)  # ValueError for a rank that is not a peer
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self._max_message_bytes:  # refused here, as the core refuses a host tensor
            raise ValueError(f"message of {nbytes} bytes exceeds max_message_bytes={self._max_message_bytes}")
        stager = self._stager or self._start_stager()
        self._forget_finished_sends()
        earlier = list(self._pending.pop(peer, ()))  # their handles keep their tensors alive until they are done
        return stager.submit(peer, tag, tensor, earlier, device_tensor, lends_slots=backend == SHM)

    def _engine(self):
        if self._copy_engine is None:
            from .device_engine import CudaCopyEngine  # the CUDA lines, imported where CUDA tensors are sent
            self._copy_engine = CudaCopyEngine()
        if not self._device_traffic:
            self._device_traffic = True  # the first device send or receive: wait as device messages need
            self._core.set_wait_spin_us(device_wait_spin_us())
        return self._copy_engine

    def _start_stager(self) -> Stager:
        self._stager = Stager(self._core, self._engine(), ipc=self._cuda_ipc, ipc_known_off=self._ipc_off)
        # Registered slots are unregistered before the core unmaps them, also when nobody calls close().
        self._stager_finalizer = weakref.finalize(self, self._stager.stop, self._core.close)
        return self._stager

    def device_path_of(self, peer: int) -> str | None:
        """How device tensors have gone to `peer` so far: 'slots, registered', 'slots, not registered',
        'pinned staging' (a link that lends no slots), or None before the first device send to it."""
        return None if self._stager is None else self._stager.path_of(peer)

    def _forget_finished_sends(self) -> None:
        """Drops the transport's references to tensors whose sends completed. Sends to one peer complete in
        order, so only the oldest pending send per peer needs checking (amortised O(1) per send)."""
        for queue in self._pending.values():
            while queue and queue[0].done():
                queue.popleft()

    def wait_sends(self, timeout: float | None = None) -> None:
        """Blocks until every send posted so far completed; raises the first failure not reported yet."""
        if self._stager is not None:
            self._stager.wait_idle(_timeout_arg(timeout))
        self._core.wait_sends(_timeout_arg(timeout))
        self._forget_finished_sends()

    # -- receiving ---------------------------------------------------------------------------------------------
    def poll(self) -> list[tuple[int, int]]:
        """(peer, tag) of every message fully arrived and not yet taken, oldest first. Never blocks."""
        if self._ipc_receiver is not None and self._ipc_receiver.released:
            self._flush_ipc_acks()
        if self._releaser is not None and self._releaser.pending():
            self._releaser.settle()
        return self._core.poll()

    def try_recv(self, peer: int, tag: int, dtype: torch.dtype | None = None, device=None):
        """Takes the message (peer, tag) if it has arrived, else returns None. Never blocks."""
        peer, tag = _key_arg((peer, tag))
        if self._ipc_receiver is not None and self._ipc_receiver.released:
            self._flush_ipc_acks()
        if self._releaser is not None and self._releaser.pending():
            self._releaser.settle()
        if dtype is not None and not self._has_dtype(peer, tag, dtype):
            return None
        message = self._core.try_take(peer, tag)
        return None if message is None else self._decode(peer, message, device)

    def recv(self, peer: int, tag: int, timeout: float | None = None, dtype: torch.dtype | None = None,
             device=None) -> torch.Tensor:
        """Blocks until (peer, tag) arrives and takes it. timeout=None waits up to the transport's timeout_s."""
        if type(peer) is not int or type(tag) is not int or not 0 <= tag <= MAX_TAG:
            peer, tag = _key_arg((peer, tag))
        if timeout is not None:
            timeout = _timeout_arg(timeout)
        if self._keepalive:
            self._release_arena_copies()
        if self._ipc_receiver is not None and self._ipc_receiver.released:
            self._flush_ipc_acks()
        if self._releaser is not None and self._releaser.pending():
            self._releaser.settle()
        if dtype is None:
            if device is not None and self._slot_receives and not self._loss_attached:
                received = self._recv_from_slots(peer, tag, timeout, device)
                if received is not None:
                    return received
            return self._decode(peer, self._core.recv(peer, tag, timeout), device)
        while True:
            self._core.wait_any([(peer, tag)], timeout)
            if self._has_dtype(peer, tag, dtype):
                message = self._core.try_take(peer, tag)
                if message is not None:
                    return self._decode(peer, message, device)

    def wait_any(self, keys: Iterable[tuple[int, int]], timeout: float | None = None) -> tuple[int, int]:
        """Blocks until one of `keys` has arrived and returns that key (without taking the message)."""
        if timeout is not None:
            timeout = _timeout_arg(timeout)
        keys = keys if isinstance(keys, list) else list(keys)
        if self._keepalive:
            self._release_arena_copies()
        if self._ipc_receiver is not None and self._ipc_receiver.released:
            self._flush_ipc_acks()
        if self._releaser is not None and self._releaser.pending():
            self._releaser.settle()
        try:  # the core converts and range-checks the keys itself: no per-key Python work on the hot path
            return self._core.wait_any(keys, timeout)
        except TypeError:
            return self._core.wait_any([_key_arg(key) for key in keys], timeout)  # raises a clear error

    def _decode(self, peer: int, message, device):
        """The tensor of a message the core handed over: its bytes, or (IPC) the slot its descriptor names."""
        if not is_descriptor(message[0]):
            if device is None and self._arena is None:
                return codec.decode(*message)
            host = codec.decode(*message)
            if device is not None and self._receives_onto(device):
                return self._onto_device(host, device)
            if self._in_arena(host):
                host = host.clone()  # what this call hands out must not outlive the arena
            return host if device is None else codec.to_device(host, device)
        if self._ipc_receiver is None:
            self._ipc_receiver = IpcReceiver(self._engine())
        try:
            tensor, ack_tag, ack = self._ipc_receiver.take(peer, *message, device=device)
        except Exception as error:  # noqa: BLE001 - an exporter that died leaves handles nobody can open
            raise peer_gone_or(self._core, peer, error, "opening the CUDA IPC memory it exported") from error
        if ack_tag is not None:  # copied: the slot is the sender's again (lent: once the tensor dies)
            self._send_host(peer, ack_tag, payload_bytes(ack))
        return tensor

    def _flush_ipc_acks(self) -> None:
        """Acknowledges the CUDA IPC slots whose lent tensors died since the last call (device_ipc.py)."""
        released = self._ipc_receiver.released
        while released:
            peer, tag, ack = released.popleft()
            try:
                self._send_host(peer, tag, payload_bytes(ack))
            except (PeerDied, TransportClosed):
                pass  # a sender that is gone waits for nothing

    # -- device receives: straight from the slots, or through the arena -------------------------------------------
    def _recv_from_slots(self, peer: int, tag: int, timeout, device):
        """The message (peer, tag) on `device`, copied straight out of this rank's registered slots as its chunks
        arrive (device_staging.receive_through_slots); None when it cannot go that way (not a device receive over
        shared memory, or the message arrived already: the core then hands it over from its buffer)."""
        if not self._receives_onto(device) or self._core.backend_of(peer) != SHM:
            return None
        engine = self._engine()
        if self._receive_regions is None:
            self._receive_regions = ReceiveRegions(engine)
            self._releaser = SlotReleaser(self._core, engine)
            # One finalizer, in this order, also when nobody calls close(): the copies still reading slots finish,
            # then the slots are unregistered, before the core unmaps the segment (the finalizer holds the core).
            self._receive_finalizer = weakref.finalize(self, _stop_receiving, self._releaser, self._receive_regions,
                                                       self._core)
        view = self._receive_regions.view_for(self._core, peer)
        if not self._core.claim_receive(peer, tag):
            return None
        releaser = self._releaser
        try:
            received = receive_through_slots(self._core, engine, peer, device, timeout, host_view=view,
                                             device_bound=lambda code: not is_descriptor(code),
                                             defer=lambda token: releaser.add(peer, token))
        except Exception as error:  # noqa: BLE001 - a dead sender in one line
            raised = peer_gone_or(self._core, peer, error, "a receive straight from the slots")
            if raised is error:
                raise
            raise raised from None
        if isinstance(received, torch.Tensor):
            return received
        return self._decode(peer, received, device)  # a CUDA IPC descriptor, gathered on the host

    # -- device receives: the arena --------------------------------------------------------------------------------
    def _receives_onto(self, device) -> bool:
        if self._copy_engine is None:
            return torch.device(device).type == "cuda"
        return self._copy_engine.receives_onto(device)

    def _in_arena(self, host: torch.Tensor) -> bool:
        if self._arena is None or self._arena is False or not host.numel():
            return False
        base = self._arena.data_ptr()
        return base <= host.data_ptr() < base + self._arena.numel()

    def _onto_device(self, host: torch.Tensor, device) -> torch.Tensor:
        """A received host tensor on `device`. Receive buffers come from a page-locked arena (made at the first
        such receive, ARENA_ENV MiB, then handed to the core): from there the copy to the device runs at once and
        asynchronously, the host buffer kept until the copy is done. Elsewhere (the arena full, or none): through
        page-locked chunks."""
        engine = self._engine()
        self._release_arena_copies()
        if self._arena is None:
            self._start_arena(engine)
        if self._in_arena(host):
            tensor, token = engine.to_device_async(host, device)
            self._keepalive.append((token, host))
            return tensor
        return engine.to_device(host, device)

    def _release_arena_copies(self) -> None:
        """Gives the arena back the buffers whose copies to the device are done. Also called before a blocking
        receive: the core takes the next message's buffer when its first chunk arrives, before recv returns, so a
        buffer released only then (as before) left a message as large as the arena outside it, every other time
        (the 256 MiB row of the H200 bench: 5.6 GB/s, through pageable memory and page-locked chunks)."""
        engine = self._copy_engine
        while self._keepalive and engine.done(self._keepalive[0][0]):
            self._keepalive.popleft()

    def _start_arena(self, engine) -> None:
        nbytes = receive_arena_bytes()
        self._arena = False  # tried, whatever happens below
        if nbytes == 0:
            return
        try:
            arena = engine.receive_arena(nbytes)
            self._core.set_receive_arena(arena.data_ptr(), arena.numel())
        except (RuntimeError, ValueError) as error:
            LOG.warning("megatron_app.transport: no page-locked receive arena (%s): device tensors are received "
                        "through page-locked chunks", error)
            return
        self._arena = arena
        # The core may write into the arena until it is closed: closing it comes before the arena can go, also
        # when nobody calls close().
        self._arena_finalizer = weakref.finalize(self, _close_keeping, self._core.close, arena)

    def _has_dtype(self, peer: int, tag: int, dtype: torch.dtype) -> bool:
        """False if the message has not arrived; ValueError (message kept) if it carries another dtype."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        header = self._core.peek(peer, tag)
        if header is None:
            return False
        carried = dtype_from_code(header[0] & ~IPC_FLAG)
        if carried != dtype:
            raise ValueError(
                f"requested dtype {dtype} but the message from peer rank {peer} ({describe_tag(tag)}) "
                f"carries {carried}"
            )
        return True

    # -- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._core.closed

    def close(self) -> None:
        """Stops the transport. Sends not completed yet fail with TransportClosed: call wait_sends() first to
        flush them. Idempotent."""
        if self._stager_finalizer is not None:
            self._stager_finalizer()  # stager.stop(core.close): fails queued sends, unregisters the slots
        self._core.close()
        if self._receive_finalizer is not None:
            self._receive_finalizer()  # the core keeps its mapping until it is destroyed
        if self._ipc_receiver is not None:
            self._ipc_receiver.close()
        self._pending.clear()
        while self._keepalive:  # copies out of the arena still running
            token, _ = self._keepalive.popleft()
            self._copy_engine.wait(token)
        if self._arena_finalizer is not None:
            self._arena_finalizer()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Transport(rank={self.rank}, world_size={self.world_size}, job_id={self.job_id!r}, {state})"


def _stop_receiving(releaser, regions, _core) -> None:
    """Stops the slot releaser (waiting for copies still reading slots), then unregisters the receive slots;
    `_core`, unused, keeps the segment mapped until then."""
    releaser.stop()
    regions.release()


def _close_keeping(close, arena) -> None:
    """Closes the core while `arena` (held by the caller's reference) is still alive."""
    close()


def device_wait_spin_us() -> int:
    """Microseconds a blocked receive of a transport with device traffic polls before it sleeps (DEVICE_WAIT_SPIN_ENV,
    else DEVICE_WAIT_SPIN_US)."""
    text = os.environ.get(DEVICE_WAIT_SPIN_ENV, str(DEVICE_WAIT_SPIN_US))
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{DEVICE_WAIT_SPIN_ENV} must be a whole number of microseconds, got {text!r}") from None
    if not 0 <= value <= 10000:
        raise ValueError(f"{DEVICE_WAIT_SPIN_ENV} must be 0..10000 us, got {value}")
    return value


def receive_arena_bytes() -> int:
    """Bytes of the page-locked receive arena of a transport that receives device tensors (ARENA_ENV, in MiB)."""
    text = os.environ.get(ARENA_ENV, str(DEFAULT_ARENA_MIB))
    try:
        mib = int(text)
    except ValueError:
        raise ValueError(f"{ARENA_ENV} must be a whole number of MiB, got {text!r}") from None
    if mib < 0:
        raise ValueError(f"{ARENA_ENV} must be >= 0 MiB, got {mib}")
    return mib << 20


def cleanup_job(job_id: str) -> list[str]:
    """Removes shared-memory segments of `job_id` whose owner process has exited; returns their names.
    Segments of live processes and of other jobs are never touched."""
    if not isinstance(job_id, str):
        raise TypeError(f"job_id must be a str, got {type(job_id).__name__}")
    return core.cleanup_job(job_id)


def rdma_status() -> tuple[bool, bool, str]:
    """(built, usable, detail): whether the RDMA backend was compiled in and a device with an active port exists."""
    return tuple(core.rdma_status())
