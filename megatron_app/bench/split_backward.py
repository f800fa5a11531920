"""What a split backward costs on one Megatron-Core GPTModel chunk: whole backward vs B (input gradient) + W (weight
gradients) as runtime/split_backward.py runs them, timed side by side in one process (alternating, medians).

    .venv/bin/python tools/bench_split_backward.py [--layers 4 --hidden 512 --seq 256 --batch 2 --repeats 10]

A middle chunk (no embedding, no loss: the chunks whose B has an input gradient to send). Also measures memory: the
bytes the forward saves for its backward (a whole backward frees them) against the bytes a pending W keeps after B.
Prints one table and, with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench_split_backward.py", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", dest="json_path", default=None)
    opts = parser.parse_args(argv)
    for name in ("layers", "hidden", "heads", "seq", "batch", "repeats"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name} must be >= 1")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    import torch
    from megatron.core.models.gpt import GPTModel

    from megatron_app.runtime.split_backward import run_input_backward, run_weight_backward
    from megatron_app.train.args import parse_args
    from megatron_app.train.init import init_distributed, init_model_parallel, shutdown
    from megatron_app.train.model import build_transformer_config, document_layer_spec

    torch.set_num_threads(1)
    init_distributed("cpu")
    init_model_parallel(1, 1, 1, "cpu")
    args = parse_args(["--pipeline_parallel", "1", "--model_chunks", "1", "--num-layers", str(opts.layers),
                       "--hidden-size", str(opts.hidden), "--num-attention-heads", str(opts.heads),
                       "--seq-length", str(opts.seq), "--micro-batch-size", str(opts.batch), "--no-trace"])
    config = build_transformer_config(args)
    config.grad_scale_func = None
    chunk = GPTModel(config=config, transformer_layer_spec=document_layer_spec(), vocab_size=args.vocab_size,
                     max_sequence_length=opts.seq, pre_process=False, post_process=False,
                     share_embeddings_and_output_weights=False)
    torch.manual_seed(0)
    grad = torch.randn(opts.seq, opts.batch, opts.hidden)

    def forward():
        x = torch.randn(opts.seq, opts.batch, opts.hidden, requires_grad=True)
        chunk.set_input_tensor(x)
        return x, chunk(None, None, None)

    def timed(func):
        start = time.perf_counter()
        result = func()
        return time.perf_counter() - start, result

    samples = {"forward": [], "whole backward": [], "B": [], "W": []}
    for _ in range(opts.repeats + 1):     # the first round warms up and is dropped
        x, out = forward()
        samples["forward"].append(timed(forward)[0])
        x, out = forward()
        samples["whole backward"].append(timed(lambda: torch.autograd.backward(out, grad))[0])
        x, out = forward()
        elapsed, (_, pending) = timed(lambda: run_input_backward(x, out, grad, None, config))
        samples["B"].append(elapsed)
        samples["W"].append(timed(lambda: run_weight_backward(pending))[0])
    medians = {name: statistics.median(values[1:]) * 1e3 for name, values in samples.items()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        x, out = forward()
    saved.pop(x.untyped_storage().data_ptr(), None)    # the input is held by the pipeline in either case
    activation_bytes = sum(saved.values())
    _, pending = run_input_backward(x, out, grad, None, config)
    pending_bytes = pending.kept_bytes()
    run_weight_backward(pending)
    whole = medians["whole backward"]
    print(f"GPTModel middle chunk: {opts.layers} layers, hidden {opts.hidden}, seq {opts.seq}, batch {opts.batch}; "
          f"medians of {opts.repeats}, 1 thread")
    for name, ms in medians.items():
        print(f"  {name:15s} {ms:9.2f} ms  {ms / whole:5.2f} x whole backward")
    print(f"  {'B + W':15s} {medians['B'] + medians['W']:9.2f} ms  {(medians['B'] + medians['W']) / whole:5.2f} x")
    print(f"  memory: the forward saves {activation_bytes / 2**20:.1f} MiB for the backward; a pending W keeps "
          f"{pending_bytes / 2**20:.1f} MiB after B ({pending_bytes / activation_bytes:.2f} x)")
    if opts.json_path:
        Path(opts.json_path).write_text(json.dumps({"config": vars(opts), "median_ms": medians,
                                                    "activation_bytes": activation_bytes,
                                                    "pending_weight_bytes": pending_bytes}, indent=2))
    shutdown(destroy_process_group=True)
    return 0

