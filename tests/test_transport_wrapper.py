"""TransportWrapper: the public way layers above the transport change it (arrival filter, send hook), everything
else forwarded explicitly; and the runtime session applies registered wrappers in order."""

from megatron_app.transport import PipelineTransport, TransportWrapper


class FakeTransport:
    rank, peers, closed = 3, (2, 4), False

    def __init__(self):
        self.sent, self.injector, self.waited = [], "none", None

    def send(self, peer, tag, tensor):
        self.sent.append((peer, tag, tensor))
        return "handle"

    def wait_sends(self, timeout=None):
        self.waited = timeout

    def poll(self):
        return [(2, 7)]

    def try_recv(self, peer, tag, dtype=None, device=None):
        return ("payload", peer, tag, device)

    def recv(self, peer, tag, timeout=None, dtype=None, device=None):
        return ("payload", peer, tag, device)

    def wait_any(self, keys, timeout=None):
        return list(keys)[0]

    def backend_of(self, peer):
        return "shm"

    def peer_failure(self, peer):
        return (True, f"peer rank {peer} closed its connection") if peer == 4 else None

    def attach_loss_injector(self, injector):
        self.injector = injector

    def close(self):
        self.closed = True


class Tagging(TransportWrapper):
    def filter_arrival(self, peer, tag, tensor):
        return ("filtered", tensor)

    def send(self, peer, tag, tensor):
        return self.inner.send(peer, tag + 100, tensor)


def test_a_plain_wrapper_forwards_every_call_of_the_protocol():
    inner = FakeTransport()
    wrapper = TransportWrapper(inner)
    assert isinstance(wrapper, PipelineTransport) and isinstance(inner, PipelineTransport)
    assert (wrapper.rank, wrapper.peers, wrapper.backend_of(2), wrapper.poll()) == (3, (2, 4), "shm", [(2, 7)])
    assert (wrapper.peer_failure(2), wrapper.peer_failure(4)) == (None, (True, "peer rank 4 closed its connection"))
    assert wrapper.try_recv(2, 7, device="cpu") == ("payload", 2, 7, "cpu")   # no filter: decoded on the device
    assert wrapper.send(4, 1, "x") == "handle" and inner.sent == [(4, 1, "x")]
    wrapper.attach_loss_injector("inj")
    wrapper.wait_sends(5.0)
    assert (inner.injector, inner.waited, wrapper.wait_any([(2, 7)])) == ("inj", 5.0, (2, 7))
    wrapper.close()
    assert inner.closed and wrapper.closed
    assert not hasattr(wrapper, "no_such_attribute")     # nothing forwarded by __getattr__


def test_hooks_filter_arrivals_and_change_sends():
    inner = FakeTransport()
    wrapper = Tagging(inner)
    assert wrapper.recv(2, 7) == ("filtered", ("payload", 2, 7, None))
    assert wrapper.try_recv(2, 7) == ("filtered", ("payload", 2, 7, None))
    wrapper.send(4, 1, "x")
    assert inner.sent == [(4, 101, "x")]


def test_the_session_applies_registered_wrappers_in_order(monkeypatch):
    from megatron_app.runtime import session as session_module
    from megatron_app.runtime.job import AppJob

    calls = []

    def outer(transport, ranks):
        calls.append(("outer", ranks))
        return Tagging(transport)

    def inner(transport, ranks):
        calls.append(("inner", ranks))
        return TransportWrapper(transport)

    fake = FakeTransport()
    monkeypatch.setattr(session_module, "agree_on_job_id", lambda requested: "job")
    monkeypatch.setattr("megatron_app.transport.open_transport", lambda *args, **kwargs: fake)
    monkeypatch.setattr(session_module.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(session_module.dist, "get_world_size", lambda: 5)
    monkeypatch.setattr(session_module.dist.distributed_c10d, "_get_default_store", lambda: None)
    job = AppJob()
    job.transport_wrappers += [inner, outer]
    transport = job.session.ensure_transport([2, 3, 4])
    assert [name for name, _ in calls] == ["inner", "outer"] and calls[0][1] == [2, 3, 4]
    assert isinstance(transport, Tagging) and type(transport.inner) is TransportWrapper and transport.inner.inner is fake
