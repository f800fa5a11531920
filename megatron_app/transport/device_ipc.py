"""Device tensors between ranks of one host through device memory (CUDA IPC), behind the copy engine.

Per peer the sender owns a ring of IPC_SLOTS device buffers, each allocated and exported once (again only when a
larger message needs it to grow), and one interprocess event per slot. A message is: the engine copies the tensor
into a free slot on its side stream (after the producer's event and after the receiver's last read of that slot),
records the slot's event, and the core carries a small descriptor (slot, generation, and the export handles the
first time) on the message's own (peer, tag), its dtype code marked with IPC_FLAG. The receiver waits for the event
on its current stream (no host wait), copies the slot into a tensor of its own (lifetime rule: what recv returns is
the receiver's; the slot is the sender's again once the receiver's copy is done), records its own interprocess
"consumed" event for the slot and acknowledges on ack_tag(slot) (exporting that event with the first ack).

Lending (the default; MEGATRON_APP_CUDA_IPC_LEND=0 copies instead): where the receive asks for the slot's own
device, the receiver copies nothing: recv returns a tensor over the slot itself (the message crosses in one device
copy, the sender's), ordered after the sender's `filled` event on the receiver's current stream. Lifetime rule: the
slot is the receiver's for as long as that tensor (or any view of it) lives; when the last reference dies, the
receiver records `consumed` on the stream current at that moment and the acknowledgement goes out with the
transport's next call (send, recv, try_recv, poll, wait_any). Work on other streams that reads the tensor must be
ordered before it is dropped (as with record_stream). A receiver that holds IPC_SLOTS tensors from one peer makes
that peer's further messages take the staged path until it lets one go; the tensor stays valid while the sender's
process lives.

The sender never waits for the receiver's process: when every slot still awaits its acknowledgement (the receiver
is behind), the message takes the staged path (shared-memory slots) instead, so a rank whose receiver is busy
elsewhere never blocks other traffic. Both paths share the core's link, so messages stay in order.

On by `cuda_ipc=True` (or MEGATRON_APP_CUDA_IPC=1); where IPC cannot work the link falls back to the staged path
and says so once: the engine says why (expandable segments, an export that fails), or the rendezvous saw the peer in
another PID namespace or on a GPU without peer access to ours (backend_choice.ipc_impossible), or its probe found
that the peer cannot read our device memory (ipc_probe.py: a GPU hidden from it, a driver that refuses). A receiver
that still cannot open a peer's export (a transport opened without the rendezvous) ends the run with one line.
"""

from __future__ import annotations

import collections
import math
import os
import struct
from typing import Optional

import torch

from ._core import core
from .dtypes import dtype_from_code

IPC_ENV = "MEGATRON_APP_CUDA_IPC"
LEND_ENV = "MEGATRON_APP_CUDA_IPC_LEND"
IPC_SLOTS = 4
IPC_FLAG = 1 << 15                 # on a message's dtype code: the payload is a descriptor, the data in a slot
MIN_SLOT_BYTES = 1 << 20
_ACK_BASE = (0xF << 60) | (0x1FC << 32)   # a direction field no make_tag tag has: never a runtime tag
_DESCRIPTOR = struct.Struct("<IHHIQII")   # magic, version, slot, generation, nbytes, buffer blob, event blob
_ACK = struct.Struct("<IHHII")            # magic, version, slot, generation, event blob
_MAGIC, _VERSION = 0x4350494D, 1          # "MIPC"


def ipc_requested(value: Optional[bool]) -> bool:
    return value if value is not None else os.environ.get(IPC_ENV, "0") == "1"


def lend_requested() -> bool:
    return os.environ.get(LEND_ENV, "1") != "0"


def ack_tag(slot: int) -> int:
    return _ACK_BASE | slot


def is_descriptor(code: int) -> bool:
    return bool(code & IPC_FLAG)


def payload_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class _SendSlot:
    __slots__ = ("buffer", "generation", "filled", "consumed", "awaiting", "exports")

    def __init__(self):
        self.exports = {}         # what of this slot the engine exported: {"buffer"|"filled": blob} (forgotten later)
        self.buffer = None        # flat uint8 device tensor, exported
        self.generation = 0       # bumped each time the buffer is (re)allocated
        self.filled = None        # our interprocess event, recorded after each copy into the slot
        self.consumed = None      # the receiver's interprocess event (opened from its first acknowledgement)
        self.awaiting = False     # a message sits in the slot and its acknowledgement has not been taken


class IpcSender:
    """The sending half, run on the stager's thread."""

    def __init__(self, core, engine):
        self._core = core
        self.engine = engine
        self._rings: dict[int, list[_SendSlot]] = {}
        self.staged_because_behind = 0

    def _free_slot(self, peer: int) -> Optional[tuple[int, _SendSlot]]:
        ring = self._rings.setdefault(peer, [_SendSlot() for _ in range(IPC_SLOTS)])
        for attempt in range(2):
            for index, slot in enumerate(ring):
                if not slot.awaiting or self._take_ack(peer, index, slot):
                    return index, slot
            if attempt == 0:
                # try_take does not wait for a receiver thread busy copying out: collect once with the lock held
                # (a zero timeout never sleeps), so an acknowledgement already in the ring is found.
                try:
                    self._core.wait_any([(peer, ack_tag(index)) for index in range(IPC_SLOTS)], 0.0)
                except core.TransportTimeout:
                    return None
        return None

    def _take_ack(self, peer: int, index: int, slot: _SendSlot) -> bool:
        message = self._core.try_take(peer, ack_tag(index))
        if message is None:
            return False
        payload = bytes(memoryview(message[3])) if message[2] else b""
        if len(payload) < _ACK.size:
            raise RuntimeError(f"peer {peer} acknowledged IPC slot {index} with {len(payload)} bytes")
        magic, version, acked, generation, event_bytes = _ACK.unpack_from(payload)
        if (magic, version, acked) != (_MAGIC, _VERSION, index) or _ACK.size + event_bytes != len(payload):
            raise RuntimeError(f"peer {peer} sent a malformed acknowledgement of IPC slot {index}")
        if event_bytes and slot.consumed is None:
            slot.consumed = self.engine.open_event(payload[_ACK.size:], slot.buffer.device)
        slot.awaiting = False
        return True

    def send(self, peer: int, tag: int, code: int, shape, flat: torch.Tensor) -> tuple[bool, object]:
        """Sends through a slot: (True, the copy's token: `flat` may be written once it is done), or (False, None),
        nothing sent, when every slot awaits its acknowledgement. Never waits for the copy: it runs after the
        receiver's last read of the slot, which its device may reach only much later."""
        found = self._free_slot(peer)
        if found is None:
            self.staged_because_behind += 1
            return False, None
        index, slot = found
        nbytes = flat.numel()
        buffer_blob = event_blob = b""
        if slot.buffer is None or slot.buffer.numel() < nbytes:
            capacity = max(MIN_SLOT_BYTES, 1 << (nbytes - 1).bit_length())
            slot.buffer = self.engine.ipc_buffer(capacity, flat.device)
            slot.generation += 1
            if "buffer" in slot.exports:   # the receiver opened the old one before acknowledging it: ours is done
                self.engine.forget_export(slot.exports.pop("buffer"))
            buffer_blob = slot.exports["buffer"] = self.engine.export_buffer(slot.buffer)
        if slot.filled is None:
            slot.filled = self.engine.ipc_event(flat.device)
            event_blob = slot.exports["filled"] = self.engine.export_event(slot.filled)
        token = self.engine.ipc_fill(slot.buffer[:nbytes], flat, slot.filled, slot.consumed)
        descriptor = _DESCRIPTOR.pack(_MAGIC, _VERSION, index, slot.generation, nbytes, len(buffer_blob),
                                      len(event_blob)) + buffer_blob + event_blob
        body = payload_bytes(descriptor)
        slot.awaiting = True
        request = self._core.send(peer, tag, code | IPC_FLAG, list(shape), body.data_ptr(), body.numel())
        if request is not None:
            request.wait()
        return True, token

    def close(self) -> None:
        """Forgets this sender's exports (the transport closes; peers hold their own handles)."""
        for ring in self._rings.values():
            for slot in ring:
                for blob in slot.exports.values():
                    self.engine.forget_export(blob)
                slot.exports.clear()


class _ReceiveSlot:
    __slots__ = ("buffer", "generation", "filled", "consumed", "consumed_said", "consumed_blob")

    def __init__(self):
        self.buffer = None
        self.generation = 0
        self.filled = None
        self.consumed = None
        self.consumed_said = False
        self.consumed_blob = None   # `consumed` as exported (forgotten when the transport closes)


class IpcReceiver:
    """The receiving half, run on the thread that takes the message. `released`: acknowledgements of lent slots
    whose tensors died, (peer, ack tag, ack payload), for the transport to send."""

    def __init__(self, engine, lend: Optional[bool] = None):
        self.engine = engine
        self.lend = (lend_requested() if lend is None else lend) and hasattr(engine, "ipc_lend")
        self._slots: dict[tuple[int, int], _ReceiveSlot] = {}
        self.released: collections.deque = collections.deque()
        self.lent = 0

    @staticmethod
    def _ack(slot: "_ReceiveSlot", index: int, generation: int, engine) -> bytes:
        event_blob = b""
        if not slot.consumed_said:
            event_blob = slot.consumed_blob = engine.export_event(slot.consumed)
            slot.consumed_said = True
        return _ACK.pack(_MAGIC, _VERSION, index, generation, len(event_blob)) + event_blob

    def _on_release(self, peer: int, index: int, generation: int, slot: "_ReceiveSlot"):
        """What runs when a lent slot's tensor dies (any thread): `consumed` recorded, the acknowledgement queued."""
        engine, released, device = self.engine, self.released, slot.buffer.device

        def release() -> None:
            try:
                engine.ipc_release(slot.consumed, device)
                released.append((peer, ack_tag(index), self._ack(slot, index, generation, engine)))
            except Exception:  # noqa: BLE001 - at interpreter exit, or CUDA gone: nobody waits for this slot
                pass

        return release

    def close(self) -> None:
        """Forgets the events this receiver exported (the transport closes)."""
        for slot in self._slots.values():
            if slot.consumed_blob is not None:
                self.engine.forget_export(slot.consumed_blob)
                slot.consumed_blob = None

    def take(self, peer: int, code: int, shape, nbytes: int, payload, device) -> tuple[torch.Tensor, int, bytes]:
        """(the tensor on `device`, ack tag, ack payload) for a descriptor from `peer`: the tensor is the slot itself
        where it can be lent (ack tag None: the acknowledgement waits for the tensor's death, see `released`), else
        a copy of its own. Every field is checked before it is used: the descriptor comes from another process."""
        dtype = dtype_from_code(code & ~IPC_FLAG)
        data = bytes(memoryview(payload)) if nbytes else b""
        if len(data) < _DESCRIPTOR.size:
            raise ValueError(f"received a malformed IPC descriptor of {len(data)} bytes from peer {peer}")
        magic, version, index, generation, size, buffer_bytes, event_bytes = _DESCRIPTOR.unpack_from(data)
        if (magic, version) != (_MAGIC, _VERSION) or index >= IPC_SLOTS or \
                _DESCRIPTOR.size + buffer_bytes + event_bytes != len(data):
            raise ValueError(f"received a malformed IPC descriptor from peer {peer}")
        if any(extent < 0 for extent in shape) or math.prod(shape) * dtype.itemsize != size:
            raise ValueError(f"received a malformed IPC descriptor: shape {tuple(shape)} of {dtype} does not "
                             f"describe its {size} bytes")
        slot = self._slots.setdefault((peer, index), _ReceiveSlot())
        blobs = data[_DESCRIPTOR.size:]
        if buffer_bytes:
            slot.buffer = self.engine.open_buffer(blobs[:buffer_bytes])
            slot.generation = generation
        if event_bytes:
            slot.filled = self.engine.open_event(blobs[buffer_bytes:], slot.buffer.device)
        if slot.buffer is None or slot.filled is None or slot.generation != generation or \
                size > slot.buffer.numel():
            raise ValueError(f"IPC descriptor from peer {peer} names slot {index} generation {generation} of "
                             f"{size} bytes, which this rank never opened")
        if slot.consumed is None:
            slot.consumed = self.engine.ipc_event(slot.buffer.device)
        if self.lend and size and device is not None:
            tensor = self.engine.ipc_lend(slot.buffer[:size], slot.filled, dtype, tuple(shape), device,
                                          self._on_release(peer, index, generation, slot))
            if tensor is not None:  # the acknowledgement goes out once the tensor dies (`released`)
                self.lent += 1
                return tensor, None, b""
        view = slot.buffer[:size].view(dtype).reshape(tuple(shape)) if size else None
        tensor = self.engine.ipc_take(view, slot.filled, slot.consumed, dtype, tuple(shape),
                                      device if device is not None else "cpu")
        return tensor, ack_tag(index), self._ack(slot, index, generation, self.engine)
