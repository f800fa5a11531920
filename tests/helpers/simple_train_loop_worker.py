"""A training loop in the shape of NVIDIA's examples/run_simple_mcore_train_loop.py (our own code), on CPU.

initialize_distributed -> model chunks built per virtual stage -> Megatron's DistributedDataParallel and the config
hooks Megatron-LM sets -> one data iterator per chunk -> megatron_app.install() -> get_forward_backward_func() ->
forward_backward_func + optimizer step. With --reference the same loop runs Megatron's own schedule (P=1).
The CPU changes a user's loop needs are marked "CPU:" (README, "In your own Megatron training script").
Writes losses.json on the rank that has the loss.
"""

import argparse
import json
import os
import time
from functools import partial

import torch
import torch.distributed as dist

SEQ, MBS, MICROBATCHES, ITERS, VOCAB, SEED = 16, 2, 4, 3, 128, 1234


def initialize_distributed(P, V):
    from megatron.core import parallel_state

    dist.init_process_group(backend="gloo")                      # CPU: gloo instead of nccl
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=P,
                                             virtual_pipeline_model_parallel_size=V if V > 1 else None)


def model_provider(P, V):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_app.train.model import document_layer_spec
    from megatron_app.train.weights import reinitialize_by_global_name

    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=2, pipeline_model_parallel_size=P,
                               virtual_pipeline_model_parallel_size=V if V > 1 else None,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32,   # CPU
                               hidden_dropout=0.0, attention_dropout=0.0, cuda_graph_scope=[])
    chunks = []
    for vp_stage in range(V):
        stage = vp_stage if V > 1 else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=document_layer_spec(),                # CPU: attention without CUDA
            vocab_size=VOCAB, max_sequence_length=SEQ,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=False, vp_stage=stage))
    reinitialize_by_global_name(chunks, config, SEED)   # the same weights for P=1 and P=2 (not in NVIDIA's loop)
    return config, chunks


def wrap_with_ddp(config, chunks, overlap_grad_reduce=False):
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce, use_distributed_optimizer=False)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                     disable_bucketing=(i > 0)) for i, chunk in enumerate(chunks)]
    # The hooks megatron/training/training.py sets (with overlap, this loop leaves the reduction to DDP's own
    # backward hooks: no grad_sync_func, the harder case for a schedule that splits backwards).
    config.no_sync_func = [m.no_sync for m in model]
    config.grad_sync_func = None if overlap_grad_reduce else [m.start_grad_sync for m in model]
    if len(model) == 1:
        config.no_sync_func = config.no_sync_func[0]
        config.grad_sync_func = config.grad_sync_func and config.grad_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    return model


def batches(iters=ITERS):
    """Deterministic microbatches: the same sequence for every chunk's iterator and every layout."""
    for step in range(iters * MICROBATCHES):
        generator = torch.Generator().manual_seed(SEED + step)
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(MBS, SEQ),
               "position_ids": torch.arange(SEQ).expand(MBS, SEQ)}


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    loss = torch.sum(losses * loss_mask.view(-1)) / loss_mask.sum()
    return loss, {"lm loss": loss}


def forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline_parallel", type=int, required=True)
    parser.add_argument("--model_chunks", type=int, default=1)
    parser.add_argument("--reference", action="store_true", help="Megatron's own schedule, no install()")
    parser.add_argument("--split-backward", action="store_true",
                        help="install(split_backward=True), with DDP's overlapped reduction driven by its hooks")
    parser.add_argument("--iters", type=int, default=ITERS)
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    P, V = opts.pipeline_parallel, opts.model_chunks

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import megatron_app
    from megatron_app.train.cpu_compat import CudaDeviceToCpu

    torch.cuda.current_device = lambda: "cpu"   # CPU: Megatron's DDP buffers ask for the current CUDA device
    initialize_distributed(P, V)
    config, chunks = model_provider(P, V)
    with CudaDeviceToCpu():                     # CPU: device="cuda" arguments inside Megatron go to the CPU
        model = wrap_with_ddp(config, chunks, overlap_grad_reduce=opts.split_backward)
        optimizer = torch.optim.Adam([p for m in model for p in m.parameters()], lr=1e-3)
        if not opts.reference:
            megatron_app.install(schedule="app", policy="dfc", timeout_s=120, split_backward=opts.split_backward)
        forward_backward_func = get_forward_backward_func()
        source = [batches(opts.iters) for _ in range(V)]
        data_iterator = source if V > 1 else source[0]
        losses = []
        started = time.monotonic()
        for iteration in range(opts.iters):
            for m in model:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            losses_reduced = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model if V > 1 else model[0],
                num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS, decoder_seq_length=SEQ,
                forward_only=False)
            for m in model:                     # a plain torch optimizer reads .grad; DDP keeps main_grad
                for p in m.parameters():
                    p.grad = p.main_grad
            optimizer.step()
            if losses_reduced:
                losses.append(sum(d["lm loss"].item() for d in losses_reduced) / len(losses_reduced))
            if iteration == 0:  # includes opening the transport and connecting to the peers: the start-up
                first_iteration_s = time.monotonic() - started
    with open(os.path.join(opts.out, f"first_iteration_s_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(first_iteration_s, f)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        with open(os.path.join(opts.out, "losses.json"), "w") as f:
            json.dump(losses, f)
    if not opts.reference:
        from megatron_app.runtime import shutdown

        shutdown()
        megatron_app.uninstall()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
