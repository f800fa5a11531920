"""bench_transport --device cuda: CUDA tensors between two processes on one GPU host.

Each size, one way (a ping-pong's round trip / 2, both ends' device tensors ready when the clock stops):
  ours       our transport, staged: device-to-host straight into the peer's registered shared-memory slots on a
             side stream, host-to-device on the receiver (megatron_app/transport/device_staging.py)
  ipc        our transport with CUDA IPC: a device copy into a slot of an exported device buffer, a descriptor
             through the transport, a device copy out on the receiver (megatron_app/transport/device_ipc.py)
  d2d        one device-to-device copy in one process (the bound a device path aims at)
  pinned     device-to-host into pinned memory + host-to-device, in one process (staging done by hand)
  pageable   the same through pageable memory
  gloo       torch.distributed gloo between the two processes with the CUDA tensor moved to and from the host
             around each send/recv (gloo's send/recv carry host memory)
  ours_block, ipc_block   ours and ipc with blocking-sync copy events (MEGATRON_APP_CUDA_EVENT_WAIT=block) instead of
             spinning ones: `faster_wait_ours` / `faster_wait_ipc` say which wait was faster at each size
  ours_arena ours with receives through the page-locked arena instead of straight from the registered slots
             (MEGATRON_APP_CUDA_RECEIVE_FROM_SLOTS=0): `slots_over_arena` is ours' time over this one's
  ours_8m    ours with 8 MiB slots (4 of them) instead of 1 MiB ones: a large message crosses in 8x fewer chunks,
             each a hand-off between the processes (`big_slots_over_ours`: its time over ours'; on an H100 the
             staged path reached 0.44-0.57x pinned staging at 16-256 MiB, against a 0.8x target)
Once per section, the floor a device message pays between two processes sharing the GPU before any copy:
  turn_us    one way of a ping-pong in which each side runs a one-element device op, waits for it, and sends a
             4-byte host tensor through our transport
  host_msg_us   the same without the device op (our transport's host latency)
  floor_over_ours, floor_over_ipc   turn_us over each path's one-way time: the share of a message that two processes
             taking turns on one GPU cost before any copy (on the H200 of 2026-11-27: 197 us, so a 1 MiB message that
             pinned staging moves in 49 us inside one process could not reach 0.8x of it between two)
The IPC methods run in two processes of their own after the others (cli.run_cuda): a crash there empties their
columns only, and the run still fails. Repetitions fill about `seconds` per size and method, at least 2 (plus one
warm-up): 256 MiB runs a few times.
plan["device"] "cpu" rehearses the same code on host tensors (the test suite runs it): a host copy engine takes them
down the device path (the stager, the leased slots, the receive arena), so its numbers are that machinery's cost on
this host with memcpy for every device copy; IPC has no host stand-in across processes (that column is staged).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_app.bench.transport.links import KIB, MIB

CUDA_SIZES = [64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
CUDA_QUICK_SIZES = [64 * KIB, 1 * MIB]
METHODS = ("ours", "ours_block", "ours_arena", "ours_8m", "ipc", "ipc_block", "d2d", "pinned", "pageable", "gloo")
# Our transports, by method: (job id suffix, CUDA IPC on, event wait mode of the copy engine, receives straight
# from the slots, Transport's slot_bytes and num_slots).
DEFAULT_SLOTS = (1 << 20, 16)     # Transport's own defaults
TRANSPORTS = {"ours": ("", False, "spin", True, DEFAULT_SLOTS),
              "ours_block": ("b", False, "block", True, DEFAULT_SLOTS),
              "ours_arena": ("a", False, "spin", False, DEFAULT_SLOTS),
              "ours_8m": ("s8", False, "spin", True, (8 << 20, 4)),
              "ipc": ("i", True, "spin", True, DEFAULT_SLOTS), "ipc_block": ("ib", True, "block", True, DEFAULT_SLOTS)}
# The IPC transports run in a section (two processes) of their own, after the staged one: a crash there (the H100
# run of 2026-11-26 lost every column to one) leaves the staged, local and gloo columns measured.
STAGED_TRANSPORTS = ("ours", "ours_block", "ours_arena", "ours_8m")
IPC_TRANSPORTS = ("ipc", "ipc_block")


class RehearsalEngine:
    """The copy engine of device_staging.py for host tensors, synchronous: `--rehearsal` runs the CUDA section's
    transport code (stager, slots, arena) with a memcpy where a device copy would be."""

    @staticmethod
    def handles(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    @staticmethod
    def begin(tensor: torch.Tensor):
        from megatron_app.transport.device_staging import prepare

        return prepare(tensor), None

    @staticmethod
    def ready_within(ready, seconds: float) -> bool:
        return True

    @staticmethod
    def follow(source, ready) -> None:
        pass

    @staticmethod
    def to_host(destination: torch.Tensor, source: torch.Tensor):
        destination.copy_(source)

    @staticmethod
    def mark(device) -> float:
        return time.monotonic()

    @staticmethod
    def seconds_between(start: float, end: float) -> float:
        return end - start

    @staticmethod
    def done(token) -> bool:
        return True

    @staticmethod
    def wait(token) -> None:
        pass

    @staticmethod
    def host_view(address: int, nbytes: int) -> torch.Tensor:
        from megatron_app.transport.device_engine import host_view

        return host_view(address, nbytes)

    @staticmethod
    def pinned_like(flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(flat.shape, dtype=torch.uint8)

    @staticmethod
    def register(address: int, nbytes: int):
        return "a rehearsal on host tensors registers nothing"

    @staticmethod
    def unregister(address: int) -> None:
        pass

    @staticmethod
    def receives_onto(device) -> bool:
        return torch.device(device).type == "cpu"

    @staticmethod
    def receive_arena(nbytes: int) -> torch.Tensor:
        raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
        start = -raw.data_ptr() % 4096
        return raw[start:start + nbytes]

    @staticmethod
    def to_device_async(host: torch.Tensor, device):
        return host.clone(), None

    @staticmethod
    def to_device(host: torch.Tensor, device) -> torch.Tensor:
        return host.clone()

    @staticmethod
    def empty(shape, dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    @staticmethod
    def from_host(destination: torch.Tensor, source: torch.Tensor):
        destination.copy_(source)

    @staticmethod
    def order_after(tensor: torch.Tensor, token) -> None:
        pass

    @staticmethod
    def ipc_unavailable_reason() -> str:
        return "a rehearsal on host tensors has no IPC"


def cuda_unavailable_reason() -> str | None:
    """None where a CUDA device is usable, else one line saying why not."""
    if not torch.cuda.is_available():
        return f"--device cuda needs a CUDA device; torch {torch.__version__} sees none"
    return None


def repetitions(size: int, seconds: float, guess_bytes_per_second: float = 10e9) -> int:
    return max(2, min(500, int(seconds * guess_bytes_per_second / size)))


class Device:
    """The device the section runs on: CUDA, or the host for the rehearsal."""

    def __init__(self, name: str):
        self.name = name
        self.cuda = name == "cuda"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _timed(device: Device, run, count: int) -> float:
    """Seconds per call of run() after one warm-up, the device drained before and after."""
    run()
    device.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        run()
    device.synchronize()
    return (time.perf_counter() - start) / count


def local_rows(device: Device, size: int, count: int) -> dict:
    """d2d, pinned and pageable staging in this process: seconds one way."""
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device.name)
    target = torch.empty_like(source)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=device.cuda)
    pageable = torch.empty(size, dtype=torch.uint8)

    def pinned_staging():
        pinned.copy_(source, non_blocking=True)
        target.copy_(pinned, non_blocking=True)

    def pageable_staging():
        pageable.copy_(source)
        target.copy_(pageable)

    return {"d2d_s": _timed(device, lambda: target.copy_(source), count),
            "pinned_s": _timed(device, pinned_staging, count),
            "pageable_s": _timed(device, pageable_staging, count)}


def ping_pong(device: Device, send, recv, rank: int, count: int) -> float:
    """One-way seconds of `count` round trips (after one): rank 0 sends and waits for the echo."""
    dist.barrier()
    for round_ in range(count + 1):
        if round_ == 1:
            device.synchronize()
            start = time.perf_counter()
        if rank == 0:
            send()
            recv()
        else:
            recv()
            send()
    device.synchronize()
    elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed / (2 * count)


def message_floor(device: Device, transport, rank: int, count: int = 200) -> dict:
    """turn_us and host_msg_us (see the module's docstring), one way, in microseconds."""
    from megatron_app.transport import Direction, make_tag

    peer = 1 - rank
    probe = torch.zeros(1, device=device.name)
    token = torch.zeros(1, dtype=torch.int32)
    counter = [1 << 20]

    def step(device_op: bool):
        def send():
            if device_op:
                probe.add_(1)
                device.synchronize()
            transport.send(peer, make_tag(Direction.BACKWARD, counter[0]), token)
            counter[0] += 1

        def recv():
            transport.recv(peer, make_tag(Direction.BACKWARD, counter[0]))
            counter[0] += 1
        return send, recv

    result = {}
    for key, device_op in (("turn_us", True), ("host_msg_us", False)):
        send, recv = step(device_op)
        result[key] = ping_pong(device, send, recv, rank, count) * 1e6
    return result


def run_cuda_section(plan: dict, rank: int) -> list:
    """Both ranks on device 0 (the bench's subject is two ranks sharing a host; one GPU is what it needs).
    plan["transports"]: which of TRANSPORTS to measure (default all); plan["local"] (default True): also the floor,
    gloo and the one-process copies (d2d, pinned, pageable). Rank 0's rows hold the raw times (`<method>_s`); the
    caller derives the ratios (add_cuda_ratios) once every section's rows are merged."""
    from megatron_app.transport import Direction, Transport, make_tag

    device = Device(plan.get("device", "cuda"))
    if device.cuda:
        from megatron_app.transport.device_engine import CudaCopyEngine

        torch.cuda.set_device(0)
    peer = 1 - rank
    local = plan.get("local", True)
    transports = {}
    for name in plan.get("transports", list(TRANSPORTS)):
        suffix, ipc, wait, slots, (slot_bytes, num_slots) = TRANSPORTS[name]
        engine = CudaCopyEngine(event_wait=wait) if device.cuda else RehearsalEngine()
        transports[name] = Transport(rank, 2, plan["job_id"] + suffix, timeout_s=120, cuda_ipc=ipc,
                                     copy_engine=engine, receive_from_slots=slots, slot_bytes=slot_bytes,
                                     num_slots=num_slots)
    floor = message_floor(device, next(iter(transports.values())), rank) if local else {}
    rows = []
    counter = [0]
    for size in plan["sizes"]:
        count = repetitions(size, plan["seconds"])
        payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
        payload = payload.to(device.name)
        held = {"tensor": payload}
        row = {"size": size, "repetitions": count}

        for name, transport in transports.items():
            def ours_send(transport=transport):
                transport.send(peer, make_tag(Direction.FORWARD, counter[0] % (1 << 32)), held["tensor"])
                counter[0] += 1

            def ours_recv(transport=transport):
                held["tensor"] = transport.recv(peer, make_tag(Direction.FORWARD, counter[0] % (1 << 32)),
                                                device=device.name)
                counter[0] += 1

            # Bit-exact check on one round trip first (the echo is what rank 1 received).
            held["tensor"] = payload
            ping_pong(device, ours_send, ours_recv, rank, 1)
            if rank == 0:
                row[f"{name}_bit_exact"] = bool(torch.equal(held["tensor"], payload))
            row[f"{name}_s"] = ping_pong(device, ours_send, ours_recv, rank, count)
            transport.wait_sends(timeout=120)
            row[f"{name}_path"] = transport.device_path_of(peer)

        if local:
            host = torch.empty(size, dtype=torch.uint8)

            def gloo_send():
                dist.send(held["tensor"].cpu(), dst=peer)

            def gloo_recv():
                dist.recv(host, src=peer)
                held["tensor"] = host.to(device.name)

            held["tensor"] = payload
            row["gloo_s"] = ping_pong(device, gloo_send, gloo_recv, rank, max(2, count // 2))
        dist.barrier()
        if rank == 0:
            if local:
                row.update(local_rows(device, size, count))
                row.update(floor)
            rows.append(row)
        dist.barrier()
    for transport in transports.values():
        transport.close()
    return rows


def add_cuda_ratios(rows: list) -> list:
    """GB/s, microseconds and the ratios of each row, from the `<method>_s` times its sections measured (a method
    whose section failed has none: its columns stay empty)."""
    for row in rows:
        measured = [method for method in METHODS if f"{method}_s" in row]
        for method in measured:
            row[f"{method}_gbs"] = row["size"] / row[f"{method}_s"] / 1e9
            row[f"{method}_us"] = row[f"{method}_s"] * 1e6
        row["bit_exact"] = all(row.get(f"{name}_bit_exact", True) for name in TRANSPORTS)
        ratios = {"ours_over_pinned": ("ours", "pinned"), "ours_over_d2d": ("ours", "d2d"),
                  "ours_over_gloo": ("ours", "gloo"), "ipc_over_d2d": ("ipc", "d2d")}
        for key, (top, bottom) in ratios.items():
            if top in measured and bottom in measured:
                row[key] = row[f"{top}_gbs"] / row[f"{bottom}_gbs"]
        if "ours" in measured and "ours_arena" in measured:
            row["slots_over_arena"] = row["ours_s"] / row["ours_arena_s"]
        if "ours" in measured and "ours_8m" in measured:
            row["big_slots_over_ours"] = row["ours_8m_s"] / row["ours_s"]
            if "pinned" in measured:
                row["ours_8m_over_pinned"] = row["ours_8m_gbs"] / row["pinned_gbs"]
        for name in ("ours", "ipc"):   # how much of a message the per-message floor between the processes is
            if name in measured and "turn_us" in row:
                row[f"floor_over_{name}"] = row["turn_us"] / row[f"{name}_us"]
        for name in ("ours", "ipc"):
            if name in measured and f"{name}_block" in measured:
                row[f"{name}_block_over_spin"] = row[f"{name}_block_s"] / row[f"{name}_s"]
                row[f"faster_wait_{name}"] = "spin" if row[f"{name}_s"] <= row[f"{name}_block_s"] else "block"
    return rows


CUDA_COLUMNS = [("size", "size", 0), ("ours us", "ours_us", 1), ("ours GB/s", "ours_gbs", 2),
                ("ipc us", "ipc_us", 1), ("ipc GB/s", "ipc_gbs", 2),
                ("d2d GB/s", "d2d_gbs", 1), ("pinned GB/s", "pinned_gbs", 2), ("pageable GB/s", "pageable_gbs", 2),
                ("gloo GB/s", "gloo_gbs", 2), ("ours/pinned", "ours_over_pinned", 2),
                ("ours/d2d", "ours_over_d2d", 4), ("ours/gloo", "ours_over_gloo", 2),
                ("ipc/d2d", "ipc_over_d2d", 3), ("ours blk us", "ours_block_us", 1),
                ("ipc blk us", "ipc_block_us", 1), ("ours blk/spin", "ours_block_over_spin", 2),
                ("ipc blk/spin", "ipc_block_over_spin", 2), ("arena us", "ours_arena_us", 1),
                ("slots/arena", "slots_over_arena", 2), ("8M-slot us", "ours_8m_us", 1),
                ("8M/ours", "big_slots_over_ours", 2), ("8M/pinned", "ours_8m_over_pinned", 2),
                ("floor/ours", "floor_over_ours", 2), ("floor/ipc", "floor_over_ipc", 2)]
