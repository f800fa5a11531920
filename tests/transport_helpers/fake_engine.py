"""A copy engine for CPU tests of the device path (megatron_app/transport/device_staging.py): host tensors take the
path CUDA tensors take, with copies that complete late, so a slot committed before its copy finished would carry
stale bytes and fail the bit-exact checks."""

from __future__ import annotations

import threading
import time
import weakref

import numpy
import torch

from megatron_app.transport.device_engine import host_view
from megatron_app.transport.device_staging import prepare


class FakeCopy:
    __slots__ = ("destination", "source", "polls_left", "performed")

    def __init__(self, destination, source, polls_left):
        self.destination = destination
        self.source = source
        self.polls_left = polls_left
        self.performed = False


class FakeMark:
    """A timing mark: complete when made (the fake's copies are ordered by its own done()/wait())."""
    __slots__ = ("at",)
    performed = True

    def __init__(self, at: float):
        self.at = at


class FakeCopyEngine:
    def __init__(self, lag: int = 1, register_problem: str | None = None):
        self.lag = lag                       # done() answers False this many times before the copy happens
        self.register_problem = register_problem
        self.in_flight = 0
        self.max_in_flight = 0
        self.copies = 0
        self.copy_threads: list[str] = []  # the thread that started each copy
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.followed = 0
        self.async_receives = 0
        self.chunked_receives = 0
        self.slot_receives = 0             # copies out of a receive slot (from_host)
        self.ordered_after = 0             # receives that left their last copies to the caller's stream
        self._receive_copies: list[FakeCopy] = []
        self.arena = None

    @staticmethod
    def handles(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    @staticmethod
    def begin(tensor: torch.Tensor):
        return prepare(tensor), "ready"

    ready = True  # what ready_within answers: False stands for a producer still running (the stager sends)

    def ready_within(self, ready, seconds) -> bool:
        assert ready == "ready"
        return self.ready

    def follow(self, source, ready) -> None:
        assert ready == "ready"
        self.followed += 1

    def to_host(self, destination: torch.Tensor, source: torch.Tensor) -> FakeCopy:
        assert destination.numel() == source.numel() and destination.dtype == source.dtype == torch.uint8
        self.in_flight += 1
        self.copies += 1
        self.copy_threads.append(threading.current_thread().name)
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return FakeCopy(destination, source, self.lag)

    marks = 0

    def mark(self, device) -> "FakeMark":
        self.marks += 1
        return FakeMark(time.monotonic())

    @staticmethod
    def seconds_between(start: "FakeMark", end: "FakeMark") -> float:
        return end.at - start.at

    def _perform(self, token: FakeCopy) -> None:
        if not token.performed:
            token.destination.copy_(token.source)
            token.performed = True
            self.in_flight -= 1

    def done(self, token) -> bool:
        if token is None or token.performed:
            return True
        if token.polls_left > 0:
            token.polls_left -= 1
            return False
        self._perform(token)
        return True

    def wait(self, token) -> None:
        if token is not None:
            self._perform(token)

    host_view = staticmethod(host_view)

    @staticmethod
    def pinned_like(flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(flat.shape, dtype=torch.uint8)

    # receives: device="cpu" stands for the device; the arena is host memory, page-aligned like pinned memory
    receive_device = "cpu"

    def receives_onto(self, device) -> bool:
        return device == self.receive_device

    def receive_arena(self, nbytes: int) -> torch.Tensor:
        raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
        start = -raw.data_ptr() % 4096
        self.arena = raw[start:start + nbytes]
        return self.arena

    def to_device_async(self, host: torch.Tensor, device):
        self.async_receives += 1
        self.in_flight += 1
        return host.clone(), FakeCopy(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8), self.lag)

    def to_device(self, host: torch.Tensor, device):
        self.chunked_receives += 1
        return host.clone()

    @staticmethod
    def empty(shape, dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def from_host(self, destination: torch.Tensor, source: torch.Tensor) -> FakeCopy:
        """A copy out of a receive slot that happens only when done()/wait() complete it: a slot given back to the
        sender before that would be read after the sender overwrote it."""
        assert destination.numel() == source.numel() and destination.dtype == source.dtype == torch.uint8
        self.slot_receives += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        token = FakeCopy(destination, source, self.lag)
        self._receive_copies.append(token)
        return token

    def order_after(self, tensor: torch.Tensor, token: FakeCopy) -> None:
        """On a device the caller's stream would wait for the copy; here the host has the data only once it ran."""
        self.ordered_after += 1
        while self._receive_copies:  # copies on one stream complete in order: this one's event covers those before
            earlier = self._receive_copies.pop(0)
            self.wait(earlier)
            if earlier is token:
                break

    def register(self, address: int, nbytes: int):
        if self.register_problem is None:
            self.registered[address] = nbytes
        return self.register_problem

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


_EXPORTS: dict[bytes, object] = {}  # "IPC handles" of this process: a fake export is a key into this table


class FakeEvent:
    records = 0

    def record(self, stream=None):
        self.records += 1


class _HostLease:
    """An owner of a host slot's bytes, through the array interface (numpy keeps it as the array's base)."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.__array_interface__ = {"shape": (buffer.numel(),), "typestr": "|u1", "data": (buffer.data_ptr(), False),
                                    "version": 3}


class FakeIpcEngine(FakeCopyEngine):
    """FakeCopyEngine with the IPC half (device_ipc.py): slots are host tensors shared through _EXPORTS, so two
    transports of one process exercise the descriptor, acknowledgement and fallback logic."""

    def __init__(self, ipc_problem: str | None = None, export_problem: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.ipc_problem = ipc_problem
        self.export_problem = export_problem
        self.buffers_made = 0
        self.takes = 0
        self.lends = 0

    def ipc_unavailable_reason(self):
        return self.ipc_problem

    def ipc_buffer(self, nbytes, device):
        self.buffers_made += 1
        return torch.zeros(nbytes, dtype=torch.uint8)

    def export_buffer(self, buffer):
        if self.export_problem:
            from megatron_app.transport.device_staging import IpcUnavailable
            raise IpcUnavailable(self.export_problem)
        key = f"buffer{id(buffer)}".encode()
        _EXPORTS[key] = buffer
        return key

    @staticmethod
    def open_buffer(blob):
        return _EXPORTS[blob]

    @staticmethod
    def ipc_event(device):
        return FakeEvent()

    @staticmethod
    def export_event(event):
        key = f"event{id(event)}".encode()
        _EXPORTS[key] = event
        return key

    @staticmethod
    def open_event(blob, device):
        return _EXPORTS[blob]

    @staticmethod
    def forget_export(blob):
        _EXPORTS.pop(blob)   # KeyError: forgotten twice, or never exported

    def ipc_fill(self, destination, source, filled, consumed):
        destination.copy_(source)
        filled.record()
        return None

    def ipc_lend(self, buffer, filled, dtype, shape, device, on_release):
        """The slot itself as the received tensor, alive (with its owner) as long as any view of it, as torch keeps
        a __cuda_array_interface__ owner alive; None for another device."""
        if device != self.receive_device:
            return None
        lease = _HostLease(buffer)
        flat = torch.from_numpy(numpy.asarray(lease))  # the array's base is the lease
        weakref.finalize(lease, on_release).atexit = False
        self.lends += 1
        return flat.view(dtype).reshape(shape)

    @staticmethod
    def ipc_release(consumed, device):
        consumed.record()

    def ipc_take(self, view, filled, consumed, dtype, shape, device):
        self.takes += 1
        out = torch.empty(shape, dtype=dtype) if view is None else view.clone()
        consumed.record()
        return out


class FakeCore:
    """The core's slot-lease calls over a ring of `slots` slots of `slot_bytes`: every leased slot is filled with a
    sentinel, and what a commit publishes is appended to `published` (so a commit before its copy shows)."""

    SENTINEL = 0xA5

    def __init__(self, slots: int = 2, slot_bytes: int = 4096):
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.memory = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
        self.head = 0
        self.leased: list[tuple[int, int]] = []   # (slot, length), oldest first
        self.published = bytearray()
        self.events: list[str] = []

    def reserve_slot(self, peer, tag, code, shape, nbytes, offset):
        assert len(self.leased) < self.slots, "a lease on a ring whose every slot is leased would wait forever"
        slot = (self.head + len(self.leased)) % self.slots
        length = min(self.slot_bytes, nbytes - offset)
        self.memory[slot * self.slot_bytes:(slot + 1) * self.slot_bytes] = self.SENTINEL
        self.leased.append((slot, length))
        self.events.append(f"reserve {offset}")
        return self.memory[slot * self.slot_bytes:].data_ptr(), length

    def commit_slot(self, peer):
        slot, length = self.leased.pop(0)
        start = slot * self.slot_bytes
        self.published += bytes(self.memory[start:start + length].tolist())
        self.head += 1
        self.events.append("commit")
