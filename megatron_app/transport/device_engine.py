"""The CUDA lines of the transport, behind the copy-engine interface of device_staging.py (the only CUDA code here).

Registration of the shared-memory slots with the CUDA runtime goes through torch's binding of it
(`torch.cuda.cudart().cudaHostRegister`), from Python: the compiled core links neither libtorch nor the CUDA
runtime, because CPU hosts build it without a CUDA toolkit (and one wheel of it serves every CUDA version torch
brings).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .device_staging import prepare

# cudaHostRegisterPortable: the registration counts for every CUDA context of this process, not only the current.
HOST_REGISTER_PORTABLE = 1
# Host-to-device copies of a received message go in chunks of this size through page-locked memory, so the host
# copy of chunk k+1 overlaps the device copy of chunk k.
RECEIVE_CHUNK_BYTES = 4 << 20


def host_view(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over `nbytes` at `address` (memory someone else owns and keeps alive)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


class CudaCopyEngine:
    """Device-to-host copies on one side stream per device, ordered after the producer's stream by an event;
    completion by events that block (no spinning) when waited on."""

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}

    @staticmethod
    def handles(tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def begin(self, tensor: torch.Tensor):
        """(the tensor to copy from, the event after which it may be read): on the caller's thread, no wait."""
        tensor = prepare(tensor)  # a contiguous() runs on the producer's stream, before the event
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        return tensor, ready

    def follow(self, source: torch.Tensor, ready) -> None:
        """The side stream waits (on the device, not the host) for the producer's event."""
        self._stream(source.device).wait_event(ready)

    def to_host(self, destination: torch.Tensor, source: torch.Tensor):
        stream = self._stream(source.device)
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
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
