"""The CUDA lines of the transport, behind the copy-engine interface of device_staging.py (the only CUDA code here).

Registration of the shared-memory slots with the CUDA runtime goes through torch's binding of it
(`torch.cuda.cudart().cudaHostRegister`), from Python: the compiled core links neither libtorch nor the CUDA
runtime, because CPU hosts build it without a CUDA toolkit (and one wheel of it serves every CUDA version torch
brings).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref
import time
from typing import Optional

import torch

from .device_staging import IpcUnavailable, prepare

# cudaHostRegisterPortable: the registration counts for every CUDA context of this process, not only the current.
HOST_REGISTER_PORTABLE = 1
# Host-to-device copies of a received message go in chunks of this size through page-locked memory, so the host
# copy of chunk k+1 overlaps the device copy of chunk k.
RECEIVE_CHUNK_BYTES = 4 << 20
# How the host waits for a copy's event: "spin" (plain events: synchronize() polls, a core busy meanwhile, no
# wake-up) or "block" (cudaEventBlockingSync: the thread sleeps until the device signals it). Spin is the default:
# small sends wait for their copy on the caller's thread, where a wake-up could cost more than the copy. The bench
# (tools/bench_transport.py --device cuda) measures both on each size.
EVENT_WAIT_ENV = "MEGATRON_APP_CUDA_EVENT_WAIT"
EVENT_WAIT_MODES = ("spin", "block")


def event_wait_mode(value: Optional[str] = None) -> str:
    """The wait mode `value` names, else EVENT_WAIT_ENV's, else "spin"; ValueError in one line for another word."""
    mode = value if value is not None else os.environ.get(EVENT_WAIT_ENV, "spin")
    if mode not in EVENT_WAIT_MODES:
        raise ValueError(f"{EVENT_WAIT_ENV} must be one of {', '.join(EVENT_WAIT_MODES)}, got {mode!r}")
    return mode


def host_view(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over `nbytes` at `address` (memory someone else owns and keeps alive)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


# ---- CUDA IPC (device_ipc.py) -----------------------------------------------------------------------------------
# The fields of torch's own CUDA sharing (torch.multiprocessing.reductions.reduce_tensor / rebuild_cuda_tensor) that
# cross to the peer, encoded field by field (never pickled: the bytes come from another process).
_EXPORTED = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset",
             "event_handle", "event_sync_required")
_ARG_INDEX = {"device": 6, "handle": 7, "size_bytes": 8, "offset_bytes": 9, "ref_counter_handle": 11,
              "ref_counter_offset": 12, "event_handle": 13, "event_sync_required": 14}


def _pack_fields(values) -> bytes:
    out = bytearray()
    for value in values:
        if isinstance(value, (bytes, bytearray)):
            out += b"b" + len(value).to_bytes(4, "little") + bytes(value)
        elif value is None:
            out += b"n"
        else:
            out += b"i" + int(value).to_bytes(8, "little", signed=True)
    return bytes(out)


def _unpack_fields(data: bytes, count: int) -> list:
    values, at = [], 0
    for _ in range(count):
        kind = data[at:at + 1]
        at += 1
        if kind == b"b":
            length = int.from_bytes(data[at:at + 4], "little")
            if at + 4 + length > len(data):
                raise ValueError("a truncated IPC export")
            values.append(data[at + 4:at + 4 + length])
            at += 4 + length
        elif kind == b"n":
            values.append(None)
        elif kind == b"i":
            if at + 8 > len(data):
                raise ValueError("a truncated IPC export")
            values.append(int.from_bytes(data[at:at + 8], "little", signed=True))
            at += 8
        else:
            raise ValueError("a malformed IPC export")
    if at != len(data):
        raise ValueError("an IPC export with trailing bytes")
    return values


def _ipc_unavailable_reason() -> Optional[str]:
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in os.environ.get(name, "").replace(" ", "").lower():
            return f"{name} turns on expandable segments, whose memory cudaIpcGetMemHandle cannot export"
    return None


# What this process exported, by export blob: a receiver in the exporting process itself (two transports of one
# process: tests, a single-process emulation) cannot open its own handles (CUDA: "invalid device context") and takes
# the object instead. Held strongly, and forgotten by the exporter (device_ipc.py: a ring slot that grows, a
# transport that closes): a weak registry of CUDA events and tensors crashed the interpreter on an H100 (a
# segmentation fault inside its own store, 2026-11-26), and with an explicit owner every lifetime is stated.
_EXPORTED_HERE: dict = {}


def _export_buffer(buffer: torch.Tensor) -> bytes:
    blob = _export_buffer_blob(buffer)
    _EXPORTED_HERE[blob] = buffer
    return blob


def _forget_export(blob: bytes) -> None:
    """This process stops answering `blob` locally (its exporter dropped the object; receivers elsewhere hold
    their own handles)."""
    _EXPORTED_HERE.pop(blob, None)


def _export_buffer_blob(buffer: torch.Tensor) -> bytes:
    from torch.multiprocessing.reductions import reduce_tensor

    try:
        _, args = reduce_tensor(buffer)
    except Exception as error:  # noqa: BLE001 - any failure to export means: no IPC on this link
        raise IpcUnavailable(f"exporting a device buffer failed: {error}") from error
    fields = [args[_ARG_INDEX[name]] for name in _EXPORTED]
    fields[0] = fields[0] if isinstance(fields[0], int) else torch.device(fields[0]).index
    fields[-1] = int(bool(fields[-1]))
    return _pack_fields(fields)


def _open_buffer(blob: bytes) -> torch.Tensor:
    local = _EXPORTED_HERE.get(blob)
    if local is not None:
        return local
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device, handle, size, offset, ref_handle, ref_offset, event_handle, sync = _unpack_fields(blob, len(_EXPORTED))
    if not isinstance(handle, bytes) or not isinstance(size, int) or size < 0:
        raise ValueError("a malformed IPC export")
    return rebuild_cuda_tensor(torch.Tensor, (size,), (1,), 0, torch.UntypedStorage, torch.uint8, device, handle,
                               size, offset, False, ref_handle, ref_offset, event_handle, bool(sync))


def _ipc_event(device) -> "torch.cuda.Event":
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)
        event.record()  # created on this device (an ipc_handle needs the event to exist)
    return event


def _export_event(event) -> bytes:
    blob = bytes(event.ipc_handle())
    _EXPORTED_HERE[blob] = event
    return blob


def _open_event(blob: bytes, device) -> "torch.cuda.Event":
    local = _EXPORTED_HERE.get(blob)
    return local if local is not None else torch.cuda.Event.from_ipc_handle(device, blob)


def _ipc_take(view, filled, consumed, dtype, shape, device) -> torch.Tensor:
    """The slot's tensor copied into the receiver's own, on its current stream after the sender's `filled` event;
    `consumed` recorded after the copy (the sender's next write into the slot waits for it)."""
    slot_device = view.device if view is not None else torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(slot_device)
    stream.wait_event(filled)
    with torch.cuda.device(slot_device):
        out = torch.empty(shape, dtype=dtype, device=slot_device)
        if view is not None:
            out.copy_(view)
        consumed.record(stream)
    return out.to(device)


class _LentSlot:
    """The owner torch sees behind a lent IPC slot's tensor (torch.as_tensor over __cuda_array_interface__ keeps it
    alive from the tensor's storage): it dies with the last view of the tensor, and its finalizer gives the slot
    back (device_ipc.py)."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.__cuda_array_interface__ = {"shape": (buffer.numel(),), "typestr": "|u1",
                                         "data": (buffer.data_ptr(), False), "version": 2}


def _ipc_lend(buffer, filled, dtype, shape, device, on_release) -> Optional[torch.Tensor]:
    """The slot `buffer` (flat uint8) as the received tensor, ordered after the sender's `filled` event on the
    current stream; `on_release` runs when its last view dies. None (nothing lent) where the receive wants another
    device (the receiver's kernels would read the slot across the link: it copies instead) or this torch does not
    keep the owner of an array-interface tensor alive."""
    target = torch.device(device)
    if target.type != "cuda":
        return None
    if (target.index if target.index is not None else torch.cuda.current_device()) != buffer.device.index:
        return None
    torch.cuda.current_stream(buffer.device).wait_event(filled)
    lease = _LentSlot(buffer)
    references = sys.getrefcount(lease)
    with torch.cuda.device(buffer.device):
        flat = torch.as_tensor(lease, device=buffer.device)
    if sys.getrefcount(lease) <= references or flat.data_ptr() != buffer.data_ptr():
        return None
    weakref.finalize(lease, on_release).atexit = False  # no CUDA calls while the interpreter shuts down
    return flat.view(dtype).reshape(shape)


def _ipc_release(consumed, device) -> None:
    """A lent slot's tensor died: `consumed` recorded on the stream current now (what was queued there reading it)."""
    with torch.cuda.device(device):
        consumed.record(torch.cuda.current_stream(device))


def _side_stream(streams: dict, device: torch.device) -> "torch.cuda.Stream":
    """The stream of `streams` (one per device index, made at first use) for `device`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(device=index)
    return stream


class CudaCopyEngine:
    """Device-to-host copies on one side stream per device, ordered after the producer's stream by an event;
    host-to-device copies of a receive on another side stream. Completion by events, waited for as `event_wait`
    says (event_wait_mode: spinning by default; small sends wait for their copy on the caller's thread, where a
    blocking event's wake-up could cost more than the copy. On an H200 blocking and spinning events left the same
    340-560 us floor per message, measured before sends of up to 1 MiB left the stager's thread.)"""

    def __init__(self, event_wait: Optional[str] = None):
        self.event_wait = event_wait_mode(event_wait)
        self._blocking = self.event_wait == "block"
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._receive_streams: dict[int, torch.cuda.Stream] = {}

    def _event(self) -> "torch.cuda.Event":
        return torch.cuda.Event(blocking=self._blocking)

    @staticmethod
    def handles(tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        return _side_stream(self._streams, device)

    def begin(self, tensor: torch.Tensor):
        """(the tensor to copy from, the event after which it may be read): on the caller's thread, no wait."""
        tensor = prepare(tensor)  # a contiguous() runs on the producer's stream, before the event
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        return tensor, ready

    @staticmethod
    def ready_within(ready, seconds: float) -> bool:
        """Whether the producer's event completed, polled (no sleep) for up to `seconds`."""
        if ready.query():
            return True
        give_up_at = time.perf_counter() + seconds
        while time.perf_counter() < give_up_at:
            if ready.query():
                return True
        return False

    def follow(self, source: torch.Tensor, ready) -> None:
        """The side stream waits (on the device, not the host) for the producer's event."""
        self._stream(source.device).wait_event(ready)

    def to_host(self, destination: torch.Tensor, source: torch.Tensor):
        stream = self._stream(source.device)
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)
            done = self._event()
            done.record(stream)
        return done

    def mark(self, device) -> "torch.cuda.Event":
        """A timing event recorded on `device`'s copy stream: it completes when the stream reaches it (after the
        producer's event the stream follows, and after the copies queued before it)."""
        mark = torch.cuda.Event(enable_timing=True, blocking=self._blocking)
        mark.record(self._stream(torch.device(device)))
        return mark

    @staticmethod
    def seconds_between(start, end) -> float:
        return start.elapsed_time(end) / 1e3   # both completed: the caller waited for `end`, recorded after `start`

    # ---- receives straight from the slots (device_staging.receive_through_slots) ----
    def _receive_stream(self, device: torch.device) -> "torch.cuda.Stream":
        return _side_stream(self._receive_streams, device)

    def empty(self, shape, dtype, device) -> torch.Tensor:
        """A receive's destination: allocated on the receive stream (its memory free of the caller's queued work
        there), then marked as used by the caller's stream (record_stream), which owns it from then on."""
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.stream(self._receive_stream(device)):
            target = torch.empty(shape, dtype=dtype, device=device)
        if target.numel():
            target.record_stream(torch.cuda.current_stream(device))
        return target

    @staticmethod
    def order_after(tensor: torch.Tensor, token) -> None:
        """The current stream of `tensor`'s device waits for the receive copy `token` (copies on the receive stream
        complete in order: the last one's event covers them all)."""
        torch.cuda.current_stream(tensor.device).wait_event(token)

    def from_host(self, destination: torch.Tensor, source: torch.Tensor):
        """Copies `source` (a host view of a registered slot) into the device view `destination` on the receive
        stream; the returned event completes with the copy (only then may the slot be given back)."""
        stream = self._receive_stream(destination.device)
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)
            done = self._event()
            done.record(stream)
        return done

    @staticmethod
    def done(token) -> bool:
        return token is None or token.query()

    @staticmethod
    def wait(token) -> None:
        if token is not None:
            token.synchronize()

    host_view = staticmethod(host_view)

    @staticmethod
    def pinned_like(flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)

    @staticmethod
    def register(address: int, nbytes: int) -> Optional[str]:
        """None once `nbytes` at `address` are registered (page-locked, device-visible), else why not."""
        cudart = torch.cuda.cudart()
        result = cudart.cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE)
        if int(result) == 0:
            return None
        return f"cudaHostRegister: {cudart.cudaGetErrorString(result)}"

    @staticmethod
    def unregister(address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)

    @staticmethod
    def to_device(host: torch.Tensor, device) -> torch.Tensor:
        """A received host tensor on `device`: copied in chunks through page-locked memory on the current stream
        (the caller's later work is ordered after it; the host buffer is free when this returns)."""
        target = torch.empty(host.shape, dtype=host.dtype, device=device)
        nbytes = host.numel() * host.element_size()
        if nbytes == 0:
            return target
        source = host.reshape(-1).view(torch.uint8) if host.dtype != torch.uint8 else host.reshape(-1)
        destination = target.view(-1).view(torch.uint8) if target.dtype != torch.uint8 else target.view(-1)
        staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # cached by torch's host allocator
        for start in range(0, nbytes, RECEIVE_CHUNK_BYTES):
            end = min(nbytes, start + RECEIVE_CHUNK_BYTES)
            staging[start:end].copy_(source[start:end])
            destination[start:end].copy_(staging[start:end], non_blocking=True)
        return target

    # ---- receives (transport.py's arena) ----
    @staticmethod
    def receives_onto(device) -> bool:
        return torch.device(device).type == "cuda"

    @staticmethod
    def receive_arena(nbytes: int) -> torch.Tensor:
        """Page-locked host bytes starting on a page (torch's host allocator aligns small blocks to less: a 1 MiB
        arena was refused on an H200 host)."""
        page = mmap.PAGESIZE
        raw = torch.empty(nbytes + page, dtype=torch.uint8, pin_memory=True)
        start = -raw.data_ptr() % page
        return raw[start:start + nbytes]   # a view: keeps the whole allocation alive

    def to_device_async(self, host: torch.Tensor, device):
        """(host's tensor on `device`, event of the copy): page-locked `host` copied on the current stream; `host`
        must live until the event is done."""
        target = torch.empty(host.shape, dtype=host.dtype, device=device)
        target.copy_(host, non_blocking=True)
        done = self._event()
        done.record(torch.cuda.current_stream(target.device))
        return target, done

    # ---- CUDA IPC (device_ipc.py) ----
    ipc_unavailable_reason = staticmethod(_ipc_unavailable_reason)
    export_buffer = staticmethod(_export_buffer)
    open_buffer = staticmethod(_open_buffer)
    ipc_event = staticmethod(_ipc_event)
    export_event = staticmethod(_export_event)
    open_event = staticmethod(_open_event)
    forget_export = staticmethod(_forget_export)
    ipc_take = staticmethod(_ipc_take)
    ipc_lend = staticmethod(_ipc_lend)
    ipc_release = staticmethod(_ipc_release)

    @staticmethod
    def ipc_buffer(nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def ipc_fill(self, destination, source, filled, consumed):
        """Copies `source` into a slot on the side stream, after the receiver's last read of it (`consumed`),
        then records the slot's `filled` event; the returned token completes with the copy."""
        stream = self._stream(source.device)
        with torch.cuda.stream(stream):
            if consumed is not None:
                stream.wait_event(consumed)
            destination.copy_(source, non_blocking=True)
            filled.record(stream)
            done = self._event()
            done.record(stream)
        return done
