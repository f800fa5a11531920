"""One rank of a bench_transport section (started twice by tools/bench_transport.py, possibly inside a network
namespace):  python -m megatron_app.bench.transport.worker PLAN.json RANK

Sections:
  shm           our shared-memory transport vs gloo, and a single-thread memcpy on rank 0
  tcp | rdma    that backend of our transport vs a raw TCP socket stream vs gloo, between plan["hosts"]
  cuda          CUDA tensors between the two ranks on one GPU: ours vs gloo, and local copies (bench/transport/cuda.py)
  loss_compare  one shared-memory transport with its loss layer (plan["loss"]) switched on and off between
                interleaved bursts, so machine noise hits both alike
Rank 0 writes its rows to plan["result_path"]; errors end the process with a traceback and exit status 1.
"""

from __future__ import annotations

import faulthandler
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_app.bench.transport.links import (GlooLink, LossLayerView, OursLink, RawSocketLink, Stream,
                                                interleaved_bursts_gbs, latency_us, memcpy_gbs, percentile)
from megatron_app.lossy import make_loss_config
from megatron_app.lossy.pipeline import PipelineLoss
from megatron_app.transport import Transport, open_transport


def latency_fields(name, samples):
    return {f"{name}_latency_median_us": statistics.median(samples),
            f"{name}_latency_p99_us": percentile(samples, 0.99)}


def measure_links(links, rank, size, seconds):
    """Latency of each link in turn, then their bandwidth in interleaved bursts (best kept; all in the JSON)."""
    row = {"size": size}
    for name, link in links:
        dist.barrier()
        samples = latency_us(link, rank, size, seconds)
        if rank == 0:
            row.update(latency_fields(name, samples))
    for name, bursts in interleaved_bursts_gbs(links, rank, size, seconds, barrier=dist.barrier).items():
        row[f"{name}_gbs"] = max(bursts)  # the link's capability: its burst least disturbed by other load
        row[f"{name}_bursts_gbs"] = bursts
    return row


def loss_config_of(plan):
    loss = plan.get("loss")
    return None if loss is None else make_loss_config(loss["model"], loss_rate=loss["rate"])


def run_shm(plan, rank):
    ours = OursLink(Transport(rank, 2, plan["job_id"]), loss_config_of(plan))
    links = [("ours", ours), ("gloo", GlooLink(rank))]
    rows = []
    for size in plan["sizes"]:
        row = measure_links(links, rank, size, plan["seconds"])
        dist.barrier()
        if rank == 0:
            row["memcpy_gbs"] = memcpy_gbs(size, plan["seconds"])
            rows.append(row)
        dist.barrier()
    ours.close()
    return rows


def run_remote(plan, rank):
    """Our tcp (or rdma) backend, opened the way a multi-host job opens it: through the store, each rank
    advertising the address it routes to rank 0 by."""
    backend, hosts = plan["section"], plan["hosts"]
    store = dist.FileStore(plan["store_path"] + ".links", 2)
    transport = open_transport(store, rank, 2, plan["job_id"], [1 - rank], mode=backend, master_addr=hosts[0],
                               timeout_s=120)
    if transport.backend_of(1 - rank) != backend:
        raise RuntimeError(f"the link to rank {1 - rank} uses {transport.backend_of(1 - rank)}, not {backend}")
    ours = OursLink(transport, loss_config_of(plan))
    raw = RawSocketLink(rank, store, hosts[rank])
    links = [(backend, ours), ("raw", raw), ("gloo", GlooLink(rank))]
    rows = []
    for size in plan["sizes"]:
        rows.append(measure_links(links, rank, size, plan["seconds"]))
        dist.barrier()
    ours.close()
    raw.close()
    return rows


def run_loss_compare(plan, rank):
    """One transport, its loss layer switched on and off between interleaved bursts (see LossLayerView); per
    repetition each view's best burst. "control" is the layer off again: how far two identical views differ, the
    noise floor for the on/off ratio."""
    link = OursLink(Transport(rank, 2, plan["job_id"]))
    injector = PipelineLoss(link.transport, loss_config_of(plan)).injector
    views = [("off", LossLayerView(link, None)), ("on", LossLayerView(link, injector)),
             ("control", LossLayerView(link, None))]
    rows = []
    for size in plan["sizes"]:
        row = {"size": size, **{f"{name}_gbs": [] for name, _ in views}}
        before = receiver_packets(injector, rank)
        rounds = 3
        for _ in range(plan["repeats"]):
            bursts = interleaved_bursts_gbs(views, rank, size, plan["seconds"], rounds=rounds, barrier=dist.barrier)
            for name, values in bursts.items():
                row[f"{name}_gbs"].append(max(values))
        after = receiver_packets(injector, rank)
        # Proof that the layer saw exactly the payloads of the "on" bursts (warm-up included) and, at p=0, lost none.
        row["layer_packets"], row["layer_lost"] = after[0] - before[0], after[1] - before[1]
        on_messages = plan["repeats"] * (rounds + 1) * Stream(size, plan["seconds"]).count
        row["layer_packets_expected"] = on_messages * -(-size // loss_config_of(plan).packet_bytes)
        rows.append(row)
        dist.barrier()
    link.close()
    return rows


def receiver_packets(injector, rank):
    """(packets, lost) the loss layer of rank 1 (the receiver of the payloads) has seen so far, on both ranks."""
    mine = [sum(entry[key] for entry in injector.stats()) for key in ("packets", "lost")]
    shared = [mine]
    dist.broadcast_object_list(shared, src=1)
    return shared[0]


def run_cuda(plan, rank):
    from megatron_app.bench.transport.cuda import run_cuda_section  # touches CUDA: only for this section

    return run_cuda_section(plan, rank)


SECTIONS = {"shm": run_shm, "tcp": run_remote, "rdma": run_remote, "loss_compare": run_loss_compare,
            "cuda": run_cuda, "cuda_ipc": run_cuda}


def main(plan_path, rank):
    faulthandler.enable()   # a crash in compiled code names its Python frame in the log (cli.last_error_line)
    plan = json.loads(Path(plan_path).read_text())
    torch.set_num_threads(1)  # single-thread copies everywhere: the reference is a single-thread memcpy
    dist.init_process_group("gloo", init_method=f"file://{plan['store_path']}", rank=rank, world_size=2)
    rows = SECTIONS[plan["section"]](plan, rank)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(plan["result_path"]).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
