"""Benchmark our transport's backends against gloo, a raw TCP socket and a single-thread memcpy.

Two processes (started here) exchange tensors of each size:
  latency   - ping-pong round trip / 2 (median and p99 over many round trips)
  bandwidth - a stream of back-to-back messages from rank 0 to rank 1, closed by a 1-element ack
Sections (--backends):
  shm   both processes on this host: our shared-memory transport vs gloo, and a memcpy of the same size
  tcp   two network namespaces joined by a veth pair made here (root; else loopback, and the table says so): our
        TCP backend vs a raw socket stream (sendall / recv_into a preallocated buffer) vs gloo, on the same link
  rdma  our RDMA backend vs a raw TCP socket when an RDMA device is usable, else one line saying it was skipped
--device cuda runs instead one section with CUDA tensors (bench/transport/cuda.py): our transport between two
processes on one GPU against a device-to-device copy, pinned and pageable staging and gloo, 64 KiB .. 256 MiB.
--loss-compare adds the loss layer's cost: the bandwidth of one shm transport with its loss layer off vs on
(bernoulli p=0), switched between interleaved bursts, several repetitions.

    python tools/bench_transport.py                          # every section
    python tools/bench_transport.py --backends tcp --rate 1gbit
    python tools/bench_transport.py --backends shm --loss-compare --repeats 9
    python tools/bench_transport.py --quick --json out.json  # a few seconds per section
    python tools/bench_transport.py --device cuda --json cuda.json  # CUDA tensors (about a minute on an H200)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

from megatron_app.bench.transport import netns_pair
from megatron_app.bench.transport.latency_model import fit_latency_model
from megatron_app.bench.transport.links import KIB, MIB
from megatron_app.lossy import LossConfigError, make_loss_config
from megatron_app.trace.cli import OneLineArgumentParser, number, positive_int
from megatron_app.transport import cleanup_job, rdma_status
from megatron_app.transport.backends import BACKEND_NAMES

PROG = "bench_transport.py"
WORKER_MODULE = "megatron_app.bench.transport.worker"
FULL_SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [4 * KIB, 1 * MIB]
LOSS_COMPARE_SIZES = [1 * MIB, 16 * MIB]
BACKENDS = BACKEND_NAMES


class BenchError(RuntimeError):
    """A section could not run; the message is one line for the user."""


def parse_size(text: str) -> int:
    units = {"K": KIB, "M": MIB, "G": 1024 * MIB}
    amount = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if amount and amount[-1] in units:
            return int(float(amount[:-1]) * units[amount[-1]])
        return int(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4K, 16M)") from None


def parse_backends(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in BACKENDS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {unknown or [text]}: choose from {', '.join(BACKENDS)} "
                                         "or none")
    return list(dict.fromkeys(chosen))


def parse_rate(text: str) -> str:
    try:
        netns_pair.parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip().lower()


def parse_args(argv):
    parser = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", type=parse_backends, default=list(BACKENDS),
                        help="comma-separated sections: shm,tcp,rdma (default: all), or none (with --loss-compare)")
    parser.add_argument("--sizes", type=parse_size, nargs="+", help="message sizes (default 4K..64M, powers of 4)")
    parser.add_argument("--quick", action="store_true", help="short run with two sizes (smoke test)")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    parser.add_argument("--seconds", type=number(0, inclusive=False, finite=True), default=None,
                        help="time budget per size and method (default 0.6, --quick 0.05)")
    parser.add_argument("--rate", type=parse_rate, default=None,
                        help="tcp: limit the veth link with tc tbf to this rate each way (e.g. 1gbit)")
    parser.add_argument("--loopback", action="store_true",
                        help="tcp: run over loopback in this namespace even when namespaces could be made")
    parser.add_argument("--loss-model", default="none",
                        help="run our transport with this packet-loss model on the receive side (e.g. bernoulli)")
    parser.add_argument("--loss-rate", type=float, default=None, help="loss rate for --loss-model (e.g. 0)")
    parser.add_argument("--loss-compare", action="store_true",
                        help="add shm bandwidth with the loss layer off vs on (bernoulli p=0) at 1 MiB and 16 MiB")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="--loss-compare: repetitions per size (default 9, --quick 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: CUDA tensors between two processes on one GPU instead of the host sections")
    parser.add_argument("--rehearsal", action="store_true",
                        help="with --device cuda: run that section's code on host tensors (tests; numbers mean nothing)")
    parser.add_argument("--timeout", type=number(0, inclusive=False, finite=True), default=1800.0,
                        help="seconds before a section's processes are stopped (1800)")
    args = parser.parse_args(argv)
    if args.rehearsal and args.device != "cuda":
        parser.error("--rehearsal rehearses --device cuda; add it")
    if args.device == "cuda":
        from megatron_app.bench.transport.cuda import CUDA_QUICK_SIZES, CUDA_SIZES

        if args.sizes is None:
            args.sizes = CUDA_QUICK_SIZES if args.quick else CUDA_SIZES
        if args.seconds is None:
            args.seconds = 0.05 if args.quick else 0.25
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if any(size < 4 for size in args.sizes):
        parser.error("sizes must be at least 4 bytes")
    if args.seconds is None:
        args.seconds = 0.05 if args.quick else 0.6
    if args.repeats is None:
        args.repeats = 2 if args.quick else 9
    if not args.backends and not args.loss_compare:
        parser.error("--backends none leaves nothing to run; add --loss-compare")
    if args.rate and "tcp" not in args.backends:
        parser.error("--rate applies to the tcp section; add tcp to --backends")
    if args.rate and args.loopback:
        parser.error("--rate shapes the veth link; it cannot be combined with --loopback")
    try:
        config = make_loss_config(args.loss_model, loss_rate=args.loss_rate)
    except LossConfigError as exc:
        parser.error(str(exc))
    args.loss = {"model": args.loss_model, "rate": args.loss_rate} if config.enabled else None
    return args


# ---- running a section's two processes -------------------------------------------------------------------------
def last_error_line(log_path: Path, returncode: Optional[int] = None) -> str:
    """What a section's rank died of: its log's last line, or, killed by a signal (a crash in compiled code), the
    signal and the innermost Python frame faulthandler wrote (the worker enables it)."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    if returncode is None or returncode >= 0:
        return lines[-1] if lines else "no output"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    frame = next((line for line in lines[current + 1:] if line.startswith("File ")), None) \
        if current is not None else None
    return f"killed by {name}" + (f" in {frame}" if frame else "")


def run_section(plan: dict, scratch: Path, timeout_s: float, prefixes=([], []), envs=({}, {})) -> list:
    """Starts rank 0 and rank 1 of `plan` (each under its command prefix, e.g. `ip netns exec NS`), waits for both,
    and returns rank 0's rows. A rank that fails stops the other at once: BenchError with its last error line."""
    section = plan["section"]
    plan = dict(plan, store_path=str(scratch / f"{section}.store"), result_path=str(scratch / f"{section}.json"))
    plan_path = scratch / f"{section}.plan.json"
    plan_path.write_text(json.dumps(plan))
    processes, logs = [], []
    try:
        for rank in (0, 1):
            log_path = scratch / f"{section}.rank{rank}.log"
            logs.append(log_path)
            env = dict(os.environ, OMP_NUM_THREADS="1", **envs[rank])
            with open(log_path, "w") as log:
                processes.append(subprocess.Popen([*prefixes[rank], sys.executable, "-m", WORKER_MODULE, str(plan_path),
                                                   str(rank)], stdout=log, stderr=subprocess.STDOUT, env=env))
        give_up_at = time.monotonic() + timeout_s
        while any(process.poll() is None for process in processes):
            failed = [rank for rank, process in enumerate(processes) if process.poll() not in (None, 0)]
            if failed:
                raise BenchError(f"{section} rank {failed[0]} failed: "
                                 f"{last_error_line(logs[failed[0]], processes[failed[0]].returncode)}")
            if time.monotonic() > give_up_at:
                raise BenchError(f"{section} did not finish within {timeout_s:g} s (see --timeout)")
            time.sleep(0.2)
        failed = [rank for rank, process in enumerate(processes) if process.returncode != 0]
        if failed:
            raise BenchError(f"{section} rank {failed[0]} failed: "
                             f"{last_error_line(logs[failed[0]], processes[failed[0]].returncode)}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        cleanup_job(plan["job_id"])
    return json.loads(Path(plan["result_path"]).read_text())


def run_shm(args, scratch, job_id):
    plan = {"section": "shm", "job_id": job_id, "sizes": args.sizes, "seconds": args.seconds, "loss": args.loss}
    rows = run_section(plan, scratch, args.timeout)
    for row in rows:
        row["ours_over_memcpy"] = row["ours_gbs"] / row["memcpy_gbs"]
        row["ours_over_gloo"] = row["ours_gbs"] / row["gloo_gbs"]
        row["latency_ours_over_gloo"] = row["ours_latency_median_us"] / row["gloo_latency_median_us"]
    return rows


def shm_latency_models(rows):
    """{method: fixed + per-byte model} fitted to the one-way medians (memcpy: one copy's time), or {} when fewer
    than two sizes were measured."""
    if len({row["size"] for row in rows}) < 2:
        return {}
    sizes = [row["size"] for row in rows]
    times = {"ours": [row["ours_latency_median_us"] for row in rows],
             "gloo": [row["gloo_latency_median_us"] for row in rows],
             "memcpy": [row["size"] / row["memcpy_gbs"] / 1e3 for row in rows]}
    models = {}
    for method, values in times.items():
        model = fit_latency_model(sizes, values)
        models[method] = {"fixed_us": model.fixed_us, "gbs": None if math.isinf(model.gbs) else model.gbs,
                          "worst_relative_error": model.worst_relative_error, "text": model.describe()}
    return models


def add_remote_ratios(rows, backend):
    for row in rows:
        row[f"{backend}_over_raw"] = row[f"{backend}_gbs"] / row["raw_gbs"]
        # Best bursts show capability; the ratio of median bursts shows whether one lucky burst decided it.
        row[f"{backend}_over_raw_median"] = (statistics.median(row[f"{backend}_bursts_gbs"]) /
                                             statistics.median(row["raw_bursts_gbs"]))
        row[f"{backend}_over_gloo"] = row[f"{backend}_gbs"] / row["gloo_gbs"]
        row[f"latency_{backend}_over_raw"] = row[f"{backend}_latency_median_us"] / row["raw_latency_median_us"]
    return rows


def run_tcp(args, scratch, job_id):
    plan = {"section": "tcp", "job_id": job_id, "sizes": args.sizes, "seconds": args.seconds, "loss": args.loss}
    reason = "--loopback given" if args.loopback else netns_pair.unavailable_reason()
    if reason:
        plan["hosts"] = ["127.0.0.1", "127.0.0.1"]
        rows = run_section(plan, scratch, args.timeout, envs=({"GLOO_SOCKET_IFNAME": "lo"},) * 2)
        return {"link": "loopback", "link_description": f"loopback in one namespace ({reason})", "rate": None,
                "rows": add_remote_ratios(rows, "tcp")}
    with netns_pair.VethPair(args.rate) as link:
        plan["hosts"] = link.addresses
        rows = run_section(plan, scratch, args.timeout, prefixes=(link.exec_prefix(0), link.exec_prefix(1)),
                           envs=tuple({"GLOO_SOCKET_IFNAME": device} for device in link.devices))
        return {"link": "veth", "link_description": link.describe(), "rate": args.rate,
                "rows": add_remote_ratios(rows, "tcp")}


def run_rdma(args, scratch, job_id):
    """Both processes in this namespace (an RDMA device is not moved into the bench's namespaces). The RDMA
    connection set-up and the raw TCP socket use $MEGATRON_APP_HOST_ADDRESS (default 127.0.0.1)."""
    built, usable, detail = rdma_status()
    if not (built and usable):
        return {"skipped": f"no RDMA device: {detail}"}
    host = os.environ.get("MEGATRON_APP_HOST_ADDRESS", "127.0.0.1")
    plan = {"section": "rdma", "job_id": job_id, "sizes": args.sizes, "seconds": args.seconds, "loss": args.loss,
            "hosts": [host, host]}
    rows = run_section(plan, scratch, args.timeout)
    return {"link": host, "link_description": f"RDMA device, both ranks on this host, connection set-up via {host}",
            "rows": add_remote_ratios(rows, "rdma")}


def run_cuda(args, scratch, job_id):
    from megatron_app.bench.transport.cuda import cuda_unavailable_reason

    import torch

    reason = None if args.rehearsal else cuda_unavailable_reason()
    if reason:
        raise BenchError(reason)
    from megatron_app.bench.transport.cuda import IPC_TRANSPORTS, STAGED_TRANSPORTS, add_cuda_ratios

    device = "cpu" if args.rehearsal else "cuda"
    plan = {"section": "cuda", "job_id": job_id, "sizes": args.sizes, "seconds": args.seconds, "device": device,
            "transports": list(STAGED_TRANSPORTS)}
    rows = run_section(plan, scratch, args.timeout)
    section = {"device": "host (rehearsal)" if args.rehearsal else torch.cuda.get_device_name(0),
               "torch": torch.__version__, "rows": rows}
    try:   # the IPC transports in processes of their own: a crash there leaves the columns above
        ipc_rows = run_section(dict(plan, section="cuda_ipc", job_id=f"{job_id}x", transports=list(IPC_TRANSPORTS),
                                    local=False), scratch, args.timeout)
    except BenchError as error:
        section["ipc_error"] = str(error)
    else:
        for row, ipc_row in zip(rows, ipc_rows):
            row.update({key: value for key, value in ipc_row.items() if key not in ("size", "repetitions")})
    add_cuda_ratios(rows)
    return section


def run_loss_compare(args, scratch, job_id):
    loss = {"model": "bernoulli", "rate": 0.0}
    plan = {"section": "loss_compare", "job_id": job_id, "sizes": LOSS_COMPARE_SIZES, "seconds": args.seconds,
            "loss": loss, "repeats": args.repeats}
    rows = run_section(plan, scratch, args.timeout)
    for row in rows:
        for name in ("off", "on", "control"):
            row[f"{name}_median_gbs"] = statistics.median(row[f"{name}_gbs"])
        for name in ("on", "control"):
            row[f"{name}_over_off"] = row[f"{name}_median_gbs"] / row["off_median_gbs"]
            # Each repetition measures the views side by side: per-repetition ratios cancel slow drifts in load.
            paired = [value / off for value, off in zip(row[f"{name}_gbs"], row["off_gbs"])]
            row[f"{name}_over_off_paired_median"] = statistics.median(paired)
            row[f"{name}_over_off_paired_min_max"] = [min(paired), max(paired)]
    return {"loss": loss, "repeats": args.repeats, "rows": rows}


# ---- tables ------------------------------------------------------------------------------------------------------
def format_size(size):
    for unit, scale in (("M", MIB), ("K", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def print_table(columns, rows):
    """columns: (header, key, decimals); the first column is the size."""
    widths = [max(len(header), 6) for header, _, _ in columns]
    print(" ".join(f"{header:>{width}}" for (header, _, _), width in zip(columns, widths)))
    print("-" * (sum(widths) + len(widths) - 1))
    for row in rows:
        cells = [format_size(row["size"])] + [f"{row[key]:.{decimals}f}" if row.get(key) is not None else "-"
                                              for _, key, decimals in columns[1:]]
        print(" ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths)))


SHM_COLUMNS = [("size", "size", 0), ("ours med us", "ours_latency_median_us", 1),
               ("ours p99 us", "ours_latency_p99_us", 1), ("gloo med us", "gloo_latency_median_us", 1),
               ("gloo p99 us", "gloo_latency_p99_us", 1), ("ours GB/s", "ours_gbs", 2), ("gloo GB/s", "gloo_gbs", 2),
               ("memcpy GB/s", "memcpy_gbs", 2), ("ours/memcpy", "ours_over_memcpy", 2),
               ("ours/gloo", "ours_over_gloo", 2), ("lat ours/gloo", "latency_ours_over_gloo", 2)]


def remote_columns(backend):
    return [("size", "size", 0), (f"{backend} med us", f"{backend}_latency_median_us", 1),
            (f"{backend} p99 us", f"{backend}_latency_p99_us", 1), ("raw med us", "raw_latency_median_us", 1),
            ("raw p99 us", "raw_latency_p99_us", 1), ("gloo med us", "gloo_latency_median_us", 1),
            ("gloo p99 us", "gloo_latency_p99_us", 1), (f"{backend} GB/s", f"{backend}_gbs", 3),
            ("raw GB/s", "raw_gbs", 3), ("gloo GB/s", "gloo_gbs", 3), (f"{backend}/raw", f"{backend}_over_raw", 2),
            (f"{backend}/raw med", f"{backend}_over_raw_median", 2), (f"{backend}/gloo", f"{backend}_over_gloo", 2), (f"lat {backend}/raw", f"latency_{backend}_over_raw", 2)]


LOSS_COLUMNS = [("size", "size", 0), ("off GB/s", "off_median_gbs", 2), ("on p=0 GB/s", "on_median_gbs", 2),
                ("control GB/s", "control_median_gbs", 2), ("on/off", "on_over_off", 3),
                ("on/off paired", "on_over_off_paired_median", 3),
                ("control/off paired", "control_over_off_paired_median", 3)]


def report(document):
    if "cuda" in document:
        from megatron_app.bench.transport.cuda import CUDA_COLUMNS

        section = document["cuda"]
        paths = sorted({str(row.get("ours_path")) for row in section["rows"]})
        ipc_paths = sorted({str(row.get("ipc_path")) for row in section["rows"]})
        exact = all(row.get("bit_exact") for row in section["rows"])
        print(f"cuda: two processes on one {section['device']} (torch {section['torch']}), one way; ours went by "
              f"{', '.join(paths)}, ipc by {', '.join(ipc_paths)}; bit-exact: {'yes' if exact else 'NO'}")
        print_table(CUDA_COLUMNS, section["rows"])
        rows = section["rows"]
        if rows and "turn_us" in rows[0]:
            print(f"per message between the two processes before any copy: {rows[0]['turn_us']:.1f} us one way with a "
                  f"device op and its wait on each side, {rows[0]['host_msg_us']:.1f} us for the host message alone")
        for name in ("ours", "ipc"):
            if rows and f"faster_wait_{name}" in rows[0]:
                faster = ", ".join(f"{format_size(row['size'])} {row[f'faster_wait_{name}']}" for row in rows)
                print(f"faster event wait, {name}: {faster}")
    if "shm" in document["backends"]:
        print("shm: two processes on this host")
        print_table(SHM_COLUMNS, document["rows"])
        for method, model in document.get("latency_model", {}).items():
            print(f"latency model {method:>6}: one way = {model['text']}")
    for backend in ("tcp", "rdma"):
        section = document.get(backend)
        if section is None:
            continue
        if "skipped" in section:
            print(f"{backend}: skipped ({section['skipped']})")
            continue
        print(f"{backend}: {section['link_description']}")
        print_table(remote_columns(backend), section["rows"])
    if "loss_compare" in document:
        section = document["loss_compare"]
        print(f"loss layer cost: shm bandwidth of one transport, its loss layer off / on (bernoulli p=0) / off again "
              f"(control: the noise floor) in interleaved bursts, median of {section['repeats']} repetitions")
        print_table(LOSS_COLUMNS, section["rows"])


# ---- main ----------------------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    # A plain kill must still remove the namespaces and stop the workers (the finally blocks of _run do). Restored
    # on return: a caller's process (a test calling main) must not keep it, since processes it forks later inherit it.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args):
    load_before = os.getloadavg()[0]
    job_id = f"bench{uuid.uuid4().hex[:10]}"
    document = {
        "benchmark": "bench_transport",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "quick": args.quick,
        "device": args.device,
        "seconds_per_measurement": args.seconds,
        "backends": args.backends,
        "loss": args.loss,
        "rows": [],
    }
    runners = {"shm": run_shm, "tcp": run_tcp, "rdma": run_rdma}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_transport") as scratch:
            if args.device == "cuda":
                document["backends"] = []
                document["cuda"] = run_cuda(args, Path(scratch), f"{job_id}cuda")
            for backend in (args.backends if args.device == "cpu" else []):
                result = runners[backend](args, Path(scratch), f"{job_id}{backend}")
                document["rows" if backend == "shm" else backend] = result
                if backend == "shm":
                    document["latency_model"] = shm_latency_models(result)
            if args.loss_compare and args.device == "cpu":
                document["loss_compare"] = run_loss_compare(args, Path(scratch), f"{job_id}loss")
    except (BenchError, RuntimeError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    load_after = os.getloadavg()[0]
    document["load_average_before_after"] = [load_before, load_after]
    report(document)
    # Other processes competing for the cores skew every number: say how busy the machine was.
    print(f"load average (1 min) before/after: {load_before:.2f} / {load_after:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=2)
    ipc_error = document.get("cuda", {}).get("ipc_error")
    if ipc_error:   # the table above has the rest; a broken path still fails the run
        print(f"{PROG}: error: the IPC section failed ({ipc_error}); its columns are empty", file=sys.stderr)
        return 1
    return 0

