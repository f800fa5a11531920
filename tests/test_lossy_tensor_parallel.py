"""LossyMegatronIntegration: wraps megatron-core's tensor-parallel communication wherever it is bound, applies the
loss model per direction on a real 2-rank tensor-parallel group, and restores the original objects exactly."""

import sys

import pytest
import torch
import torch.multiprocessing as mp

from megatron_app.lossy import LossConfigError, make_loss_config
from megatron_app.lossy.tensor_parallel import LINEAR_SITE, MAPPING_SITES, LossyMegatronIntegration


def megatron_bindings():
    """(module name, attribute) -> object for every megatron binding of a wrapped function."""
    from megatron.core.tensor_parallel import layers, mappings

    originals = {id(getattr(mappings, name)) for name in MAPPING_SITES} | {id(getattr(layers, LINEAR_SITE))}
    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is not None and module_name.startswith("megatron"):
            for attribute, value in vars(module).items():
                if id(value) in originals:
                    found[(module_name, attribute)] = value
    return found


def test_enable_patches_every_binding_and_disable_restores_the_originals():
    import megatron.core.tensor_parallel as tp_package
    from megatron.core.tensor_parallel import layers, mappings

    before = megatron_bindings()
    assert ("megatron.core.tensor_parallel.layers", "reduce_from_tensor_model_parallel_region") in before
    assert ("megatron.core.tensor_parallel", "copy_to_tensor_model_parallel_region") in before
    integration = LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.1))
    with integration:
        assert integration.enabled
        for (module_name, attribute), original in before.items():
            assert getattr(sys.modules[module_name], attribute) is not original
        assert layers.reduce_from_tensor_model_parallel_region.__wrapped__ is before[
            ("megatron.core.tensor_parallel.mappings", "reduce_from_tensor_model_parallel_region")]
    assert not integration.enabled
    for (module_name, attribute), original in before.items():
        assert getattr(sys.modules[module_name], attribute) is original
    assert mappings.copy_to_tensor_model_parallel_region is tp_package.copy_to_tensor_model_parallel_region
    integration.disable()  # idempotent


def test_only_one_integration_at_a_time_and_bad_arguments():
    first = LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.1)).enable()
    try:
        with pytest.raises(RuntimeError, match="another LossyMegatronIntegration is enabled"):
            LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.2)).enable()
    finally:
        first.disable()
    with pytest.raises(LossConfigError, match="has none of send"):
        LossyMegatronIntegration(object())
    with pytest.raises(LossConfigError, match="forward=True or backward=True"):
        LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.1), forward=False, backward=False)


def _tp_worker(rank: int, store_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers, mappings

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        all_lost = make_loss_config("bernoulli", loss_rate=1.0, packet_bytes=64)
        x = torch.full((8, 16), float(rank + 1), requires_grad=True)

        # forward only: the all-reduce result is lost; the all-reduce of gradients (copy_to's backward) arrives
        with LossyMegatronIntegration(all_lost, forward=True, backward=False) as integration:
            reduced = layers.reduce_from_tensor_model_parallel_region(x * 1)
            assert torch.count_nonzero(reduced) == 0
            copied = layers.copy_to_tensor_model_parallel_region(x)
            copied.backward(torch.ones_like(copied))  # a dense gradient: Megatron all-reduces a contiguous() copy
            assert torch.equal(x.grad, torch.full_like(x, 2.0))  # the sum over 2 ranks of ones
            (stats,) = integration.stats()
            assert (stats.link, stats.direction, stats.packets, stats.lost) == (
                f"all_reduce@rank{rank}", "forward", 8, 8)

        # backward only: forward results are exact, gradients delivered by a collective are lost
        x.grad = None
        with LossyMegatronIntegration(all_lost, forward=False, backward=True):
            reduced = mappings.reduce_from_tensor_model_parallel_region(x * 1)
            assert torch.equal(reduced, torch.full_like(x, 3.0))
            copied = mappings.copy_to_tensor_model_parallel_region(x)
            copied.backward(torch.full_like(copied, 5.0))
            assert torch.count_nonzero(x.grad) == 0

        # the input-gradient all-reduce inside the column-parallel linear
        weight = torch.ones(4, 16, requires_grad=True)
        inp = torch.ones(3, 16, requires_grad=True)
        with LossyMegatronIntegration(all_lost, forward=False, backward=True):
            output = layers.linear_with_grad_accumulation_and_async_allreduce(inp, weight, None, False, True, False)
            output.backward(torch.ones_like(output))
        assert torch.count_nonzero(inp.grad) == 0 and torch.count_nonzero(weight.grad) > 0

        # no loss: bit-exact, and a stream's losses are the same on a rerun with the same seed
        half = make_loss_config("bernoulli", loss_rate=0.5, packet_bytes=64, seed=11)
        results = []
        for _ in range(2):
            with LossyMegatronIntegration(half, rank=rank):
                results.append(mappings.reduce_from_tensor_model_parallel_region(torch.ones(64, 16)))
        assert torch.equal(results[0], results[1]) and 0 < torch.count_nonzero(results[0]) < 64 * 16
        with LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.0)):
            assert torch.equal(mappings.reduce_from_tensor_model_parallel_region(x.detach() * 1),
                               torch.full_like(x, 3.0))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_loss_on_a_two_rank_tensor_parallel_group(tmp_path):
    mp.spawn(_tp_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)
