"""What the runtime needs from a transport (PipelineTransport), and the public way to wrap one (TransportWrapper).

Layers above the transport (the loss layer, link-delay emulation) change its behaviour by wrapping it: a wrapper
forwards every call of the protocol explicitly, and a subclass overrides the two hooks it needs, `filter_arrival`
(every received tensor passes through it) and `send`. Nothing outside megatron_app.transport touches a transport's
private attributes; everything a wrapper may forward is named here.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Protocol, Tuple, runtime_checkable

Key = Tuple[int, int]   # (peer rank, tag)


@runtime_checkable
class SendCompletion(Protocol):
    def done(self) -> bool: ...

    def wait(self, timeout: Optional[float] = None) -> None: ...


@runtime_checkable
class PipelineTransport(Protocol):
    """One rank's endpoint as megatron_app.runtime uses it (megatron_app.transport.Transport implements it)."""

    rank: int
    peers: Tuple[int, ...]

    def send(self, peer: int, tag: int, tensor) -> SendCompletion: ...

    def wait_sends(self, timeout: Optional[float] = None) -> None: ...

    def poll(self) -> List[Key]: ...

    def try_recv(self, peer: int, tag: int, dtype=None, device=None): ...

    def recv(self, peer: int, tag: int, timeout: Optional[float] = None, dtype=None, device=None): ...

    def wait_any(self, keys: Iterable[Key], timeout: Optional[float] = None) -> Key: ...

    def backend_of(self, peer: int) -> str: ...

    def peer_failure(self, peer: int) -> Optional[Tuple[bool, str]]: ...

    def attach_loss_injector(self, injector) -> None: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


class ClosesOnExit:
    """`with transport:` waits for posted sends when the block ends normally, and always closes."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if exc_type is None and not self.closed:
                self.wait_sends()
        finally:
            self.close()


class TransportWrapper(ClosesOnExit):
    """A PipelineTransport around another one. Subclasses override `filter_arrival(peer, tag, tensor)` to change
    what a receive returns, `send` to change what is sent and when, or any other call; the rest is forwarded."""

    def __init__(self, inner: PipelineTransport):
        self.inner = inner

    # ---- hooks ------------------------------------------------------------------------------------------------
    def filter_arrival(self, peer: int, tag: int, tensor):
        """Every tensor this transport hands out passes through here (on the receiving rank's thread)."""
        return tensor

    def send(self, peer: int, tag: int, tensor) -> SendCompletion:
        return self.inner.send(peer, tag, tensor)

    # ---- forwarded --------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def peers(self) -> Tuple[int, ...]:
        return self.inner.peers

    def wait_sends(self, timeout: Optional[float] = None) -> None:
        self.inner.wait_sends(timeout)

    def poll(self) -> List[Key]:
        return self.inner.poll()

    def try_recv(self, peer: int, tag: int, dtype=None, device=None):
        if not self._filters:
            return self.inner.try_recv(peer, tag, dtype=dtype, device=device)
        tensor = self.inner.try_recv(peer, tag, dtype=dtype)
        return None if tensor is None else self._hand_out(peer, tag, tensor, device)

    def recv(self, peer: int, tag: int, timeout: Optional[float] = None, dtype=None, device=None):
        if not self._filters:
            return self.inner.recv(peer, tag, timeout=timeout, dtype=dtype, device=device)
        return self._hand_out(peer, tag, self.inner.recv(peer, tag, timeout=timeout, dtype=dtype), device)

    def wait_any(self, keys: Iterable[Key], timeout: Optional[float] = None) -> Key:
        return self.inner.wait_any(keys, timeout=timeout)

    def backend_of(self, peer: int) -> str:
        return self.inner.backend_of(peer)

    def peer_failure(self, peer: int) -> Optional[Tuple[bool, str]]:
        return self.inner.peer_failure(peer)

    def attach_loss_injector(self, injector) -> None:
        self.inner.attach_loss_injector(injector)

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def close(self) -> None:
        self.inner.close()

    @property
    def _filters(self) -> bool:
        """Whether a subclass filters arrivals (else the inner transport decodes straight onto `device`)."""
        return type(self).filter_arrival is not TransportWrapper.filter_arrival

    def _hand_out(self, peer: int, tag: int, tensor, device):
        # The filter sees the tensor where the transport decoded it (host memory); the device move comes last.
        tensor = self.filter_arrival(peer, tag, tensor)
        if device is None:
            return tensor
        from .codec import to_device  # CUDA through page-locked chunks, as an unwrapped transport does

        return to_device(tensor, device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
