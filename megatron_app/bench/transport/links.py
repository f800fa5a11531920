"""What bench_transport measures and through what: blocking send/recv links over our transport, gloo and a raw
TCP socket, and the three loops run over each (ping-pong latency, stream bandwidth, single-thread memcpy).

Every link has send(tensor), recv(like) -> tensor, flush() and close() (and may have prepare(), called before each
of its bandwidth bursts); rank 0 and rank 1 run the same loop.
"""

from __future__ import annotations

import socket
import statistics
import time

KIB = 1024
MIB = 1024 * KIB


def iterations(size: int, seconds: float, minimum: int, maximum: int, bytes_per_second: float = 2e9) -> int:
    """Enough repetitions to fill about `seconds` at a rough guess of the speed, clamped."""
    return max(minimum, min(maximum, int(seconds * bytes_per_second / max(size, 64 * KIB))))


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


# ---- links ---------------------------------------------------------------------------------------------------
class OursLink:
    """Blocking send/recv over a megatron_app.transport.Transport (any backend) with forward-activation tags,
    the traffic the loss layer sees."""

    def __init__(self, transport, loss_config=None):
        from megatron_app.transport import Direction, make_tag

        self.make_tag = make_tag  # looked up once: the loop should time the transport, not imports
        self.transport = transport
        self.peer = 1 - transport.rank
        self.counter = 0
        self.direction = Direction.FORWARD
        if loss_config is not None and loss_config.enabled:
            from megatron_app.lossy.pipeline import PipelineLoss

            PipelineLoss(transport, loss_config)

    def send(self, tensor):
        self.transport.send(self.peer, self.make_tag(self.direction, self.counter % (1 << 32)), tensor)
        self.counter += 1

    def recv(self, like):
        tensor = self.transport.recv(self.peer, self.make_tag(self.direction, self.counter % (1 << 32)))
        self.counter += 1
        return tensor

    def flush(self):
        self.transport.wait_sends()

    def close(self):
        self.transport.close()


class LossLayerView:
    """One OursLink seen with the loss layer attached (`injector`) or detached (None) during this view's bursts:
    'layer on' and 'layer off' then run on the very same transport (same rings, threads and buffers), so only the
    layer differs. Both ranks switch in step between bursts, when no message is in flight."""

    def __init__(self, link: OursLink, injector):
        self.link = link
        self.injector = injector

    def prepare(self):
        self.link.transport.attach_loss_injector(self.injector)  # None detaches

    def send(self, tensor):
        self.link.send(tensor)

    def recv(self, like):
        return self.link.recv(like)

    def flush(self):
        self.link.flush()

    def close(self):
        pass  # the viewed link is closed by its owner


class GlooLink:
    def __init__(self, rank):
        self.peer = 1 - rank

    def send(self, tensor):
        import torch.distributed as dist

        dist.send(tensor, self.peer)

    def recv(self, like):
        import torch.distributed as dist

        dist.recv(like, self.peer)
        return like

    def flush(self):
        pass

    def close(self):
        pass


class RawSocketLink:
    """The baseline for a TCP backend: one plain TCP connection, sendall() of the tensor's bytes and
    recv_into() a preallocated tensor with MSG_WAITALL (no framing, no threads, no allocation per message).
    Both calls release the GIL for the whole transfer, so this runs at the kernel's socket speed."""

    def __init__(self, rank, store, host):
        if rank == 1:
            with socket.create_server((host, 0)) as listener:
                store.set("raw_socket_address", f"{host}:{listener.getsockname()[1]}")
                self.socket, _ = listener.accept()
        else:
            peer_host, port = store.get("raw_socket_address").decode().rsplit(":", 1)
            self.socket = socket.create_connection((peer_host, int(port)))
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def _bytes(tensor):
        return memoryview(tensor.numpy()).cast("B")

    def send(self, tensor):
        self.socket.sendall(self._bytes(tensor))

    def recv(self, like):
        view = self._bytes(like)
        done = 0
        while done < len(view):
            got = self.socket.recv_into(view[done:], len(view) - done, socket.MSG_WAITALL)
            if got == 0:
                raise ConnectionError("raw socket peer closed the connection")
            done += got
        return like

    def flush(self):
        pass

    def close(self):
        self.socket.close()


# ---- loops ---------------------------------------------------------------------------------------------------
def latency_us(link, rank, size, seconds):
    """One-way latency samples (round trip / 2) in microseconds, measured on rank 0."""
    import torch

    payload = torch.ones(size // 4, dtype=torch.float32)
    landing = torch.empty_like(payload)
    rounds = iterations(size, seconds, minimum=20, maximum=3000, bytes_per_second=0.5e9)
    warmup = max(5, rounds // 10)
    samples = []
    for i in range(warmup + rounds):
        if rank == 0:
            start = time.perf_counter()
            link.send(payload)
            link.recv(landing)
            if i >= warmup:
                samples.append((time.perf_counter() - start) / 2 * 1e6)
        else:
            link.send(link.recv(landing))
    link.flush()
    return samples


class Stream:
    """Bursts of back-to-back messages from rank 0 to rank 1, each closed by a 1-element ack; rank 0 times them."""

    def __init__(self, size, seconds):
        import torch

        self.payload = torch.ones(size // 4, dtype=torch.float32)
        self.landing = torch.empty_like(self.payload)
        self.ack = torch.zeros(1)
        # At most ~128 MiB per burst: the receiver copies out as fast as it can, so a longer burst only measures
        # how fast fresh receive buffers can be faulted in once its buffer cache (256 MiB) is exhausted.
        self.count = min(iterations(size, seconds / 4, minimum=4, maximum=400), max(4, (128 * MIB) // size))

    def burst_gbs(self, link, rank):
        """GB/s (1e9 bytes/s) of one burst on rank 0 (0.0 on rank 1)."""
        if rank == 0:
            start = time.perf_counter()
            for _ in range(self.count):
                link.send(self.payload)
            link.recv(self.ack)
            elapsed = time.perf_counter() - start
        else:
            for _ in range(self.count):
                link.recv(self.landing)
            link.send(self.ack)
        link.flush()
        return self.count * self.payload.numel() * 4 / elapsed / 1e9 if rank == 0 else 0.0


def interleaved_bursts_gbs(links, rank, size, seconds, rounds=6, barrier=lambda: None):
    """{name: [GB/s of each burst]} of several links measured in turns, one burst each per round, the order
    rotating every round: load from elsewhere on the machine lands on every link alike, so their ratio is fair."""
    stream = Stream(size, seconds)
    bursts = {name: [] for name, _ in links}
    for turn in range(-1, rounds):  # turn -1: a warm-up burst each
        shift = turn % len(links)
        for name, link in links[shift:] + links[:shift]:
            if hasattr(link, "prepare"):
                link.prepare()  # before the barrier: no rank sends until both are prepared
            barrier()
            gbs = stream.burst_gbs(link, rank)
            if turn >= 0:
                bursts[name].append(gbs)
    return bursts


def memcpy_gbs(size, seconds):
    import torch

    source = torch.ones(size // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)
    repeats = iterations(size, seconds, minimum=10, maximum=5000, bytes_per_second=5e9)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return source.numel() * 4 / statistics.median(times) / 1e9
