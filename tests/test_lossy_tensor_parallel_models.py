"""LossyMegatronIntegration end to end on stock megatron-core models with T=2 on CPU (gloo): a sequence-parallel
GPT forward/backward (vocab-parallel cross-entropy included) and an MoE layer (all-gather token dispatcher).

Megatron's all-to-all token dispatcher creates torch.cuda.Stream objects and cannot be built on CPU; the all-to-all
it calls (mappings.all_to_all) is tested directly in test_lossy_tensor_parallel.py."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_app.lossy import make_loss_config
from megatron_app.lossy.tensor_parallel import LossyMegatronIntegration

SEQUENCE, BATCH, HIDDEN, VOCAB = 16, 2, 32, 64


def _start(rank: int, store_path: str, **parallel) -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron's output buffers, on this CPU-only torch
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16 reads moe_utils.te_general_gemm without defining it when Transformer Engine is absent
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    from megatron_app.train.init import seed_all

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(**parallel)
    seed_all(0, "cpu")  # the trainer's CPU stand-in for Megatron's CUDA RNG tracker (used by the embedding)


def _stop() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=2,
                             sequence_parallel=True, use_cpu_initialization=True, params_dtype=torch.float32,
                             pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                             cuda_graph_scope=[], **extra)


class SequenceParallelLayerNorm:
    """torch LayerNorm for a sequence-parallel spec (megatron's torch wrapper refuses sequence parallelism without
    Apex or Transformer Engine); the parameters are marked as Megatron marks its own sequence-parallel norms."""

    def __new__(cls, config, hidden_size, eps=1e-5, **unused):
        norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def _sequence_parallel_gpt_spec():
    import copy

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_app.train.model import document_layer_spec

    layer = copy.deepcopy(document_layer_spec())
    layer.submodules.input_layernorm = SequenceParallelLayerNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * 2, layer_norm=SequenceParallelLayerNorm)


def _step(model, inputs):
    """Loss and every parameter's gradient after one forward/backward."""
    model.zero_grad(set_to_none=True)
    loss = inputs(model)
    loss.backward()
    return loss.detach(), [param.grad.clone() for param in model.parameters()]


def _compare_runs(model, inputs, lossy_config, **options):
    """(reference, p=0 run, lossy run, lossy stats by link) of one step."""
    reference = _step(model, inputs)
    with LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.0, packet_bytes=256), **options):
        exact = _step(model, inputs)
    with LossyMegatronIntegration(lossy_config, **options) as integration:
        lossy = _step(model, inputs)
    stats = {(s.link.rsplit("@", 1)[0], s.direction): (s.packets, s.lost) for s in integration.stats()}
    return reference, exact, lossy, stats


def _identical(first, second) -> bool:
    return torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def _gpt_worker(rank: int, store_path: str) -> None:
    _start(rank, store_path, tensor_model_parallel_size=2)
    from megatron.core.models.gpt import GPTModel

    try:
        torch.manual_seed(0)
        model = GPTModel(config=_config(), transformer_layer_spec=_sequence_parallel_gpt_spec(), vocab_size=VOCAB,
                         max_sequence_length=SEQUENCE, share_embeddings_and_output_weights=False)
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
        labels = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
        positions = torch.arange(SEQUENCE).expand(BATCH, SEQUENCE)

        def inputs(gpt):
            return gpt(tokens, positions, None, labels=labels).mean()

        lossy_config = make_loss_config("bernoulli", loss_rate=0.3, packet_bytes=32, seed=5)
        reference, exact, lossy, stats = _compare_runs(model, inputs, lossy_config)
        assert torch.isfinite(reference[0])
        assert _identical(reference, exact)
        assert not torch.equal(reference[0], lossy[0])
        for link in [("tp:layers.all_gather", "forward"),           # sequence-parallel input of each linear
                     ("tp:mappings.reduce_scatter", "forward"),     # row-parallel outputs back to sequence shards
                     ("tp:cross_entropy.all_reduce", "forward"),    # vocab-parallel cross-entropy
                     ("tp:layers.reduce_scatter", "backward"),      # input gradients of column-parallel linears
                     ("tp:layers.all_gather", "backward"),          # inputs again, for weight gradients
                     ("tp:mappings.all_gather", "backward")]:       # gradients of the row-parallel outputs
            packets, lost = stats[link]
            assert packets > 0 and 0 < lost < packets, (link, stats)

        # the same run with loss everywhere but the cross-entropy stays finite and still differs
        _, _, lossy, stats = _compare_runs(model, inputs, lossy_config,
                                           sites=["mappings", "layers", "tp_utils", "core_utils"])
        assert torch.isfinite(lossy[0]) and not torch.equal(reference[0], lossy[0])
        assert not any(link.startswith("tp:cross_entropy") for link, _ in stats)
    finally:
        _stop()


def test_sequence_parallel_gpt_with_loss_on_tensor_parallel_traffic(tmp_path):
    mp.spawn(_gpt_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def _moe_worker(rank: int, store_path: str) -> None:
    _start(rank, store_path, tensor_model_parallel_size=2)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    try:
        torch.manual_seed(0)
        config = _config(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                         moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.0, add_bias_linear=False)
        spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
        layer = build_module(spec.submodules.mlp, config=config)
        hidden = torch.randn(SEQUENCE // 2, BATCH, HIDDEN, generator=torch.Generator().manual_seed(rank))

        def inputs(moe):
            local = hidden.clone().requires_grad_()
            output, _ = moe(local)
            return (output * output).mean()

        lossy_config = make_loss_config("bernoulli", loss_rate=0.5, packet_bytes=64, seed=3)
        reference, exact, lossy, stats = _compare_runs(layer, inputs, lossy_config)
        assert _identical(reference, exact)
        assert not _identical(reference, lossy)
        # tokens and routing probabilities gathered over the expert tensor-and-model-parallel group, expert outputs
        # reduce-scattered back, and the gradients of both
        for link in [("tp_ep:mappings.all_gather", "forward"), ("tp_ep:mappings.reduce_scatter", "forward"),
                     ("tp_ep:mappings.all_gather", "backward"), ("tp_ep:mappings.reduce_scatter", "backward")]:
            packets, lost = stats[link]
            assert packets > 0 and 0 < lost < packets, (link, stats)
    finally:
        _stop()


def test_moe_layer_with_loss_on_token_dispatch(tmp_path):
    mp.spawn(_moe_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)
