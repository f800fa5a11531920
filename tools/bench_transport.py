#!/usr/bin/env python3
"""Benchmark the shared-memory transport against torch.distributed gloo and a single-thread memcpy.

Two processes (spawned here) exchange tensors of each size:
  latency   - ping-pong round trip / 2 (median and p99 over many round trips)
  bandwidth - a stream of back-to-back messages from rank 0 to rank 1, closed by a 1-element ack
and rank 0 times a single-thread torch copy_ of the same size as the memcpy reference.

    python tools/bench_transport.py                 # full table
    python tools/bench_transport.py --quick         # a few seconds
    python tools/bench_transport.py --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import uuid

KIB = 1024
MIB = 1024 * KIB
FULL_SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [4 * KIB, 1 * MIB]


def parse_size(text: str) -> int:
    units = {"K": KIB, "M": MIB, "G": 1024 * MIB}
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if number and number[-1] in units:
            return int(float(number[:-1]) * units[number[-1]])
        return int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4K, 16M)") from None


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad input: one line on stderr and exit status 2, no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv):
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_size, nargs="+", help="message sizes (default 4K..64M, powers of 4)")
    parser.add_argument("--quick", action="store_true", help="short run with two sizes (smoke test)")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    parser.add_argument("--seconds", type=float, default=None, help="time budget per size and method")
    parser.add_argument("--loss-model", default="none",
                        help="run our transport with this packet-loss model on the receive side (e.g. bernoulli)")
    parser.add_argument("--loss-rate", type=float, default=None, help="loss rate for --loss-model (e.g. 0)")
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if any(size < 4 for size in args.sizes):
        parser.error("sizes must be at least 4 bytes")
    if args.seconds is None:
        args.seconds = 0.05 if args.quick else 0.6
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")
    from megatron_app.lossy import LossConfigError, make_loss_config

    try:
        args.loss_config = make_loss_config(args.loss_model, loss_rate=args.loss_rate)
    except LossConfigError as exc:
        parser.error(str(exc))
    return args


def iterations(size: int, seconds: float, minimum: int, maximum: int, bytes_per_second: float = 2e9) -> int:
    """Enough repetitions to fill about `seconds` at a rough guess of the speed, clamped."""
    return max(minimum, min(maximum, int(seconds * bytes_per_second / max(size, 64 * KIB))))


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


class OursLink:
    """Blocking send/recv over megatron_app.transport for the benchmark loops."""

    def __init__(self, rank, job_id, loss_config=None):
        from megatron_app.transport import Direction, Transport, make_tag

        self.make_tag = make_tag  # imported once: an import statement per message costs about 1 us
        self.transport = Transport(rank, 2, job_id)
        self.peer = 1 - rank
        self.counter = 0
        self.direction = Direction.CONTROL
        if loss_config is not None and loss_config.enabled:
            from megatron_app.lossy.pipeline import PipelineLoss

            PipelineLoss(self.transport, loss_config)  # the loss layer sees forward traffic, not control
            self.direction = Direction.FORWARD

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


def bandwidth_gbs(link, rank, size, seconds):
    """Stream bandwidth in GB/s (1e9 bytes/s) measured on rank 0: best of a few bursts."""
    import torch

    payload = torch.ones(size // 4, dtype=torch.float32)
    landing = torch.empty_like(payload)
    ack = torch.zeros(1)
    # At most ~128 MiB per burst: the receiver copies out as fast as it can, so a longer burst only measures
    # how fast fresh receive buffers can be faulted in once its buffer cache (256 MiB) is exhausted.
    burst = min(iterations(size, seconds / 4, minimum=4, maximum=400), max(4, (128 * MIB) // size))
    best = 0.0
    for attempt in range(4):  # the first burst warms up buffers and pages
        if rank == 0:
            start = time.perf_counter()
            for _ in range(burst):
                link.send(payload)
            link.recv(ack)
            elapsed = time.perf_counter() - start
            if attempt > 0:
                best = max(best, burst * payload.numel() * 4 / elapsed / 1e9)
        else:
            for _ in range(burst):
                link.recv(landing)
            link.send(ack)
        link.flush()
    return best


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


def rank_main(rank, args, job_id, store_path, results):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # single-thread copies everywhere: the reference is a single-thread memcpy
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
        ours = OursLink(rank, job_id, args.loss_config)
        gloo = GlooLink(rank)
        rows = []
        for size in args.sizes:
            row = {"size": size}
            for name, link in (("ours", ours), ("gloo", gloo)):
                dist.barrier()
                samples = latency_us(link, rank, size, args.seconds)
                dist.barrier()
                bandwidth = bandwidth_gbs(link, rank, size, args.seconds)
                if rank == 0:
                    row[f"{name}_latency_median_us"] = statistics.median(samples)
                    row[f"{name}_latency_p99_us"] = percentile(samples, 0.99)
                    row[f"{name}_gbs"] = bandwidth
            dist.barrier()
            if rank == 0:
                row["memcpy_gbs"] = memcpy_gbs(size, args.seconds)
                rows.append(row)
            dist.barrier()
        ours.close()
        dist.destroy_process_group()
        if rank == 0:
            results.put(("rows", rows))
    except BaseException:
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))
        raise


def add_ratios(rows):
    for row in rows:
        row["ours_over_memcpy"] = row["ours_gbs"] / row["memcpy_gbs"]
        row["ours_over_gloo"] = row["ours_gbs"] / row["gloo_gbs"]
        row["latency_ours_over_gloo"] = row["ours_latency_median_us"] / row["gloo_latency_median_us"]
    return rows


def format_size(size):
    for unit, scale in (("M", MIB), ("K", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def print_table(rows):
    header = (f"{'size':>6} {'ours med us':>11} {'ours p99 us':>11} {'gloo med us':>11} {'gloo p99 us':>11} "
              f"{'ours GB/s':>9} {'gloo GB/s':>9} {'memcpy GB/s':>11} {'ours/memcpy':>11} {'ours/gloo':>9} "
              f"{'lat ours/gloo':>13}")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{format_size(row['size']):>6} {row['ours_latency_median_us']:>11.1f} "
              f"{row['ours_latency_p99_us']:>11.1f} "
              f"{row['gloo_latency_median_us']:>11.1f} {row['gloo_latency_p99_us']:>11.1f} {row['ours_gbs']:>9.2f} "
              f"{row['gloo_gbs']:>9.2f} {row['memcpy_gbs']:>11.2f} {row['ours_over_memcpy']:>11.2f} "
              f"{row['ours_over_gloo']:>9.2f} {row['latency_ours_over_gloo']:>13.2f}")


def main(argv=None):
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    job_id = f"bench{uuid.uuid4().hex[:10]}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        store_path = os.path.join(scratch, "gloo_store")
        ranks = [context.Process(target=rank_main, args=(rank, args, job_id, store_path, results)) for rank in (0, 1)]
        for process in ranks:
            process.start()
        kind, payload = results.get()
        for process in ranks:
            process.join(timeout=None if kind == "rows" else 10)
            if process.is_alive():
                process.kill()
    from megatron_app.transport import cleanup_job

    cleanup_job(job_id)
    if kind == "error":
        print(f"bench_transport: benchmark failed in {payload.strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    rows = add_ratios(payload)
    load_after = os.getloadavg()[0]
    print_table(rows)
    # Other processes competing for the cores skew every number: say how busy the machine was.
    print(f"load average (1 min) before/after: {load_before:.2f} / {load_after:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        document = {
            "benchmark": "bench_transport",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
            "load_average_before_after": [load_before, load_after],
            "quick": args.quick,
            "seconds_per_measurement": args.seconds,
            "rows": rows,
        }
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
