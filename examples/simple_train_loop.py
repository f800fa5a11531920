"""A small Megatron-Core GPT training loop that uses megatron_app's schedule: the shape of NVIDIA's
examples/run_simple_mcore_train_loop.py (Megatron-LM), our own code, with pipeline stages and virtual chunks.

    torchrun --nproc_per_node 1 examples/simple_train_loop.py                                      # P=1
    torchrun --nproc_per_node 2 examples/simple_train_loop.py --pipeline_parallel 2                # P=2
    torchrun --nproc_per_node 2 examples/simple_train_loop.py --pipeline_parallel 2 --model_chunks 2
    torchrun --nproc_per_node 2 examples/simple_train_loop.py --pipeline_parallel 2 --model_chunks 2 \\
        --variable-lengths --composition balanced                       # whole documents through wrap_data_iterator

The same file runs on CPU (gloo) and CUDA (nccl; gloo where ranks share a GPU, e.g. P=2 on one card), the device by
--device (auto: CUDA when a GPU is visible): every line that differs is marked "CPU:" and is listed in
docs/your-loop.md; tools/gpu_check.sh runs it on a GPU (its own-loop step). Steps NVIDIA's file does not need but a
pipelined loop does are marked "PIPELINE:"; the ones our drop-in adds are marked "APP:". Dropout is Megatron's default 0.1, keyed by (seed, iteration, microbatch, layer)
so that any P, V and schedule gives the same masks, and so the same losses: P=2 V=2 under our schedule equals P=1
under Megatron's own (tests/test_simple_train_loop.py). --reference runs Megatron's own schedule (no install()).
"""

import argparse
import contextlib
import json
import os
import time
from functools import partial

import torch
import torch.distributed as dist

SEQ, MBS, MICROBATCHES, ITERS, VOCAB, SEED = 16, 2, 4, 3, 128, 1234


def initialize_distributed(P, V, on_cpu):
    from megatron.core import parallel_state

    if on_cpu:
        dist.init_process_group(backend="gloo")                         # CPU: gloo instead of nccl
        torch.cuda.current_device = lambda: "cpu"                       # CPU: Megatron's DDP buffers ask for it
    else:
        gpus = torch.cuda.device_count()
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % gpus)    # more ranks than GPUs: they share them
        # NCCL refuses two ranks on one GPU: ranks sharing GPUs use gloo, which takes CUDA tensors too
        dist.init_process_group(backend="nccl" if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= gpus else "gloo")
    if dist.get_backend() == "gloo":
        # CPU: (and ranks sharing a GPU) gloo has no coalesced all-reduce of CUDA tensors: DDP's buckets one by one
        from megatron_app.gloo_gradients import reduce_ddp_buckets_one_by_one_on_gloo

        reduce_ddp_buckets_one_by_one_on_gloo()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=P,
        virtual_pipeline_model_parallel_size=V if V > 1 else None)     # PIPELINE: V chunks a rank
    if not on_cpu:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(SEED)                           # CPU: left out (CUDA generators only)


def model_provider(P, V, dropout, on_cpu):
    """This rank's V model chunks: chunk c is virtual stage c * P + pipeline rank."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_app.train.model import document_layer_spec
    from megatron_app.train.weights import reinitialize_by_global_name

    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=2,
        pipeline_model_parallel_size=P,                                 # PIPELINE: each stage builds its layers
        virtual_pipeline_model_parallel_size=V if V > 1 else None,      # PIPELINE
        use_cpu_initialization=True, pipeline_dtype=torch.float32,
        hidden_dropout=dropout, attention_dropout=dropout, cuda_graph_scope=[])
    chunks = []
    for vp_stage in range(V):
        stage = vp_stage if V > 1 else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=document_layer_spec(),   # APP: attention over packed documents
            vocab_size=VOCAB, max_sequence_length=SEQ,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),  # PIPELINE
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),  # PIPELINE
            share_embeddings_and_output_weights=False, vp_stage=stage))   # PIPELINE: vp_stage
    from megatron_app.train.document_dropout import DocumentDropout

    for chunk in chunks:   # APP: the embedding's dropout keyed by document too (the spec's dropouts already are)
        if chunk.pre_process:
            chunk.embedding.embedding_dropout = DocumentDropout(config.hidden_dropout)
        if not on_cpu:
            chunk.cuda()
    # Only to compare layouts: every parameter drawn from its global name, so P=1 and P=2 V=2 start equal.
    reinitialize_by_global_name(chunks, config, SEED)
    return config, chunks


def wrap_with_ddp(config, chunks, overlap_grad_reduce=False):
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce, use_distributed_optimizer=False)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                     disable_bucketing=(i > 0)) for i, chunk in enumerate(chunks)]
    # The config hooks megatron/training/training.py sets; the schedule calls them (with overlapped reduction the
    # loop leaves the reduction to DDP's own backward hooks: no grad_sync_func).
    config.no_sync_func = [m.no_sync for m in model]
    config.grad_sync_func = None if overlap_grad_reduce else [m.start_grad_sync for m in model]
    if len(model) == 1:                                                 # one chunk: the functions, not lists
        config.no_sync_func = config.no_sync_func[0]
        config.grad_sync_func = config.grad_sync_func and config.grad_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    return model


def fixed_length_batches(iters):
    """Microbatches of MBS rows of SEQ tokens, the same sequence for every chunk's iterator and every layout."""
    for step in range(iters * MICROBATCHES):
        generator = torch.Generator().manual_seed(SEED + step)
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(MBS, SEQ),
               "position_ids": torch.arange(SEQ).expand(MBS, SEQ)}


def documents(iters):
    """One document per next(), as wrap_data_iterator reads them: [1, L] tensors tokens, labels, loss_mask,
    position_ids, L from 3 to SEQ."""
    for step in range(iters * MICROBATCHES * MBS):
        generator = torch.Generator().manual_seed(SEED + step)
        length = int(torch.randint(3, SEQ + 1, (1,), generator=generator))
        tokens = torch.randint(0, VOCAB, (1, length + 1), generator=generator)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, length),
               "position_ids": torch.arange(length).unsqueeze(0)}


def loss_func(per_token, loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.reshape(-1).float()
    loss_sum, tokens = torch.sum(losses * loss_mask), loss_mask.sum()
    if per_token:   # APP (variable lengths): (sum, tokens): the schedule divides by the global batch's tokens
        return loss_sum, tokens.to(torch.int), {"lm loss": torch.stack([loss_sum, tokens])}
    loss = loss_sum / tokens
    return loss, {"lm loss": loss.detach().clone()}   # its own tensor: the schedule divides `loss` in place


def forward_step_func(per_token, data_iterator, model):
    from megatron_app.train.data_schedule import packed_seq_params_of

    host = next(data_iterator)
    device = next(model.parameters()).device
    batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in host.items()}   # as NVIDIA's
    packed = packed_seq_params_of(batch, host) if per_token else None   # APP: packed documents' bounds
    output = model(batch.get("tokens"), batch.get("position_ids"), None, labels=batch.get("labels"),
                   packed_seq_params=packed)
    loss_mask = batch.get("loss_mask")
    return output, partial(loss_func, per_token, loss_mask)


def iteration_loss(losses_reduced, per_token):
    if per_token:
        total = torch.stack([d["lm loss"] for d in losses_reduced]).sum(0)
        return (total[0] / total[1]).item()
    return sum(d["lm loss"].item() for d in losses_reduced) / len(losses_reduced)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline_parallel", type=int, default=1)
    parser.add_argument("--model_chunks", type=int, default=1)
    parser.add_argument("--iters", type=int, default=ITERS)
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout (Megatron's 0.1)")
    parser.add_argument("--variable-lengths", action="store_true",
                        help="whole documents of 3-16 tokens through wrap_data_iterator, per-token loss")
    parser.add_argument("--composition", default="packed", help="wrap_data_iterator's: packed, balanced, loader")
    parser.add_argument("--reference", action="store_true", help="Megatron's own schedule (no install())")
    parser.add_argument("--split-backward", action="store_true",
                        help="install(split_backward=True), with DDP's overlapped reduction driven by its hooks")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto (the default): CUDA when a GPU is visible, else CPU")
    parser.add_argument("--out", help="folder for losses.json (last stage) and each rank's first iteration time")
    opts = parser.parse_args()
    P, V = opts.pipeline_parallel, opts.model_chunks
    on_cpu = opts.device == "cpu" or (opts.device == "auto" and not torch.cuda.is_available())
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")

    from megatron_app.lazy_fusers import import_megatron_core

    import_megatron_core()              # APP (optional): Megatron's fusions compile at first call (~1 s less start-up)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import megatron_app
    from megatron_app.runtime import enable_keyed_randomness, set_iteration, shutdown
    from megatron_app.train.cpu_compat import CudaDeviceToCpu
    from megatron_app.train.data_schedule import wrap_data_iterator

    initialize_distributed(P, V, on_cpu)
    config, chunks = model_provider(P, V, opts.dropout, on_cpu)
    if opts.variable_lengths:
        config.calculate_per_token_loss = True                          # APP (variable lengths): per-token loss
        config.variable_seq_lengths = True
    enable_keyed_randomness(chunks, SEED)                               # APP: masks independent of the schedule
    with CudaDeviceToCpu() if on_cpu else contextlib.nullcontext():    # CPU: device="cuda" inside Megatron
        model = wrap_with_ddp(config, chunks, overlap_grad_reduce=opts.split_backward)
        optimizer = torch.optim.Adam([p for m in model for p in m.parameters()], lr=1e-3)
        if not opts.reference:
            megatron_app.install(schedule="app", policy="planned", timeout_s=120,     # APP: before the next line
                                 split_backward=opts.split_backward)
        forward_backward_func = get_forward_backward_func()
        if opts.variable_lengths:   # one document source; wrap_data_iterator gives each chunk its own iterator
            source = [documents(opts.iters)] * V
        else:                       # PIPELINE: one iterator per chunk, each yielding every microbatch
            source = [fixed_length_batches(opts.iters) for _ in range(V)]
        losses, started = [], time.monotonic()
        for iteration in range(opts.iters):
            set_iteration(iteration)                                    # APP: the dropout key, for any schedule
            for m in model:
                m.zero_grad_buffer()                                    # DDP: main_grad accumulates otherwise
            optimizer.zero_grad()
            if opts.variable_lengths:                                   # APP: one global batch, planned
                data_iterator, num_microbatches, _, _ = wrap_data_iterator(
                    source, config, MICROBATCHES * MBS, composition=opts.composition, micro_batch_size=MBS)
            else:
                data_iterator, num_microbatches = source, MICROBATCHES
            losses_reduced = forward_backward_func(
                forward_step_func=partial(forward_step_func, opts.variable_lengths),
                data_iterator=data_iterator if V > 1 else data_iterator[0],   # PIPELINE: lists for V > 1
                model=model if V > 1 else model[0], num_microbatches=num_microbatches, seq_length=SEQ,
                micro_batch_size=MBS, decoder_seq_length=SEQ, forward_only=False)
            for m in model:                     # a plain torch optimizer reads .grad; Megatron's DDP keeps main_grad
                for p in m.parameters():
                    p.grad = p.main_grad
            optimizer.step()
            if losses_reduced:
                losses.append(iteration_loss(losses_reduced, opts.variable_lengths))
                print(f"iteration {iteration}: lm loss {losses[-1]:.6f}", flush=True)
            if iteration == 0:  # includes opening the transport and connecting to the peers: the start-up
                first_iteration_s = time.monotonic() - started
    if opts.out:
        with open(os.path.join(opts.out, f"first_iteration_s_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(first_iteration_s, f)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            with open(os.path.join(opts.out, "losses.json"), "w") as f:
                json.dump(losses, f)
    if not opts.reference:
        shutdown()
        megatron_app.uninstall()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
