"""LossyMegatronIntegration: the collectives megatron-core's tensor-parallel modules look up become lossy on
intra-layer groups, per direction, on a real 2-rank gloo group; disable restores the original objects exactly."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_app.lossy import TP_SITES, LossConfigError, make_loss_config
from megatron_app.lossy.collectives import wrapped_collectives
from megatron_app.lossy.tensor_parallel import LEFT_OUT, SITES, LossyMegatronIntegration

ALL_LOST = make_loss_config("bernoulli", loss_rate=1.0, packet_bytes=64)
NO_LOSS = make_loss_config("bernoulli", loss_rate=0.0, packet_bytes=64)


def site_bindings():
    """(module name, attribute) -> object for every name a site module looks collectives up through."""
    import importlib

    originals = {id(function) for function in wrapped_collectives().values()} | {id(torch), id(dist)}
    found = {}
    for module_name in SITES:
        module = importlib.import_module(module_name)
        for attribute, value in vars(module).items():
            if id(value) in originals:
                found[(module_name, attribute)] = value
    return found


def test_enable_patches_every_site_binding_and_disable_restores_the_originals():
    from megatron.core.tensor_parallel import cross_entropy, layers, mappings

    before = site_bindings()
    for expected in [("megatron.core.tensor_parallel.mappings", "torch"),
                     ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func"),
                     ("megatron.core.tensor_parallel.layers", "dist_reduce_scatter_func"),
                     ("megatron.core.tensor_parallel.cross_entropy", "torch"),
                     ("megatron.core.fusions.fused_cross_entropy", "torch")]:
        assert expected in before
    real_all_reduce = dist.all_reduce
    with LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.1)) as integration:
        assert integration.enabled
        for (module_name, attribute), original in before.items():
            assert getattr(sys.modules[module_name], attribute) is not original, (module_name, attribute)
        assert cross_entropy.torch.distributed.all_reduce.__wrapped__ is real_all_reduce
        assert layers.dist_all_gather_func.__wrapped__ is dist.all_gather_into_tensor
        # the views are the real modules apart from the collectives; nothing outside the sites changes
        assert mappings.torch.empty is torch.empty and mappings.torch.distributed.ReduceOp is dist.ReduceOp
        assert dist.all_reduce is real_all_reduce and torch.distributed is dist
    assert not integration.enabled
    for (module_name, attribute), original in before.items():
        assert getattr(sys.modules[module_name], attribute) is original, (module_name, attribute)
    integration.disable()  # idempotent

    with LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.1), sites=["cross_entropy"]):
        assert cross_entropy.torch is not torch and mappings.torch is torch and layers.torch is torch
    assert cross_entropy.torch is torch
    with LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.1, tp_sites="layers")) as narrowed:
        assert narrowed.sites == {"layers"} and layers.torch is not torch and mappings.torch is torch
    assert layers.torch is torch


def test_every_megatron_module_calling_collectives_is_a_site_or_left_out_for_a_reason():
    """Guards an upgrade of megatron-core: a new module with its own collective calls must be looked at."""
    import re
    from pathlib import Path

    import megatron.core

    root = Path(megatron.core.__file__).parent
    call = re.compile(r"torch\.distributed\.(all_reduce|all_gather\w*|_all_gather_base|reduce_scatter\w*|"
                      r"_reduce_scatter_base|all_to_all\w*|broadcast)\(|dist_(all_gather|reduce_scatter)_func\(")
    files = [root / "utils.py"] + [path for folder in ("tensor_parallel", "transformer", "models", "fusions")
                                   for path in (root / folder).rglob("*.py")]
    calling = {".".join(("megatron", "core") + path.relative_to(root).with_suffix("").parts)
               for path in files if call.search(path.read_text(encoding="utf-8"))}
    assert {"megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.cross_entropy"} <= calling
    assert calling - set(SITES) - set(LEFT_OUT) == set()
    assert tuple(SITES.values()) == TP_SITES  # the names --loss-tp-sites accepts without importing torch


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
    with pytest.raises(LossConfigError, match="sites must name some of mappings"):
        LossyMegatronIntegration(make_loss_config("bernoulli", loss_rate=0.1), sites=["mapings"])


# -- two ranks -----------------------------------------------------------------------------------------------------
def _start(rank: int, store_path: str, **parallel) -> None:
    # Megatron allocates some outputs on torch.cuda.current_device() (sequence-parallel gathers, all-to-all-v):
    # on this CPU-only torch those go to the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(**parallel)


def _stop() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _by_link(integration, rank):
    """{(link without '@rank', direction): (packets, lost)}"""
    suffix = f"@rank{rank}"
    table = {}
    for stats in integration.stats():
        assert stats.traffic == "tp" and stats.link.endswith(suffix)
        table[(stats.link[:-len(suffix)], stats.direction)] = (stats.packets, stats.lost)
    return table


def _run(step, config=None, **options):
    """(outputs, gradients, stats table) of step() -> (outputs, leaves) without or with an integration."""
    if config is None:
        outputs, leaves = step()
        return outputs, [leaf.grad for leaf in leaves], {}
    with LossyMegatronIntegration(config, **options) as integration:
        outputs, leaves = step()
    return outputs, [leaf.grad for leaf in leaves], _by_link(integration, dist.get_rank())


def _equal(first, second) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _check_path(step, lossy_links, **options):
    """p=0 is bit-identical to no integration; total loss changes the result and is counted on lossy_links."""
    reference, reference_grads, _ = _run(step)
    exact, exact_grads, exact_stats = _run(step, NO_LOSS, **options)
    assert _equal(reference, exact) and _equal(reference_grads, exact_grads)
    assert all(lost == 0 for _, lost in exact_stats.values())
    lossy, lossy_grads, stats = _run(step, ALL_LOST, **options)
    assert not (_equal(reference, lossy) and _equal(reference_grads, lossy_grads))
    for link in lossy_links:
        packets, lost = stats[link]
        assert packets > 0 and lost == packets, (link, stats)
    return stats


def _collectives_worker(rank: int, store_path: str) -> None:
    _start(rank, store_path, tensor_model_parallel_size=2)
    import torch.utils.checkpoint
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers, mappings, vocab_parallel_cross_entropy

    tp_group = parallel_state.get_tensor_model_parallel_group()
    try:
        x = torch.full((8, 16), float(rank + 1), requires_grad=True)

        # forward only: the all-reduce result is lost; the all-reduce of gradients (copy_to's backward) arrives
        with LossyMegatronIntegration(ALL_LOST, forward=True, backward=False) as integration:
            reduced = layers.reduce_from_tensor_model_parallel_region(x * 1)
            assert torch.count_nonzero(reduced) == 0
            copied = layers.copy_to_tensor_model_parallel_region(x)
            copied.backward(torch.ones_like(copied))
            assert torch.equal(x.grad, torch.full_like(x, 2.0))  # the sum over 2 ranks of ones
        assert _by_link(integration, rank) == {("tp:mappings.all_reduce", "forward"): (8, 8)}

        # backward only: forward results are exact, gradients delivered by a collective are lost
        x.grad = None
        with LossyMegatronIntegration(ALL_LOST, forward=False, backward=True):
            reduced = mappings.reduce_from_tensor_model_parallel_region(x * 1)
            assert torch.equal(reduced, torch.full_like(x, 3.0))
            copied = mappings.copy_to_tensor_model_parallel_region(x)
            copied.backward(torch.full_like(copied, 5.0))
            assert torch.count_nonzero(x.grad) == 0

        # the input-gradient all-reduce inside the column-parallel linear
        weight = torch.ones(4, 16, requires_grad=True)
        inp = torch.ones(3, 16, requires_grad=True)
        with LossyMegatronIntegration(ALL_LOST, forward=False, backward=True):
            output = layers.linear_with_grad_accumulation_and_async_allreduce(inp, weight, None, False, True, False)
            output.backward(torch.ones_like(output))
        assert torch.count_nonzero(inp.grad) == 0 and torch.count_nonzero(weight.grad) > 0

        # a stream's losses are the same on a rerun with the same seed
        half = make_loss_config("bernoulli", loss_rate=0.5, packet_bytes=64, seed=11)
        results = []
        for _ in range(2):
            with LossyMegatronIntegration(half, rank=rank):
                results.append(mappings.reduce_from_tensor_model_parallel_region(torch.ones(64, 16)))
        assert torch.equal(results[0], results[1]) and 0 < torch.count_nonzero(results[0]) < 64 * 16

        torch.manual_seed(rank)
        tokens = torch.randn(8, 2, 16)

        # sequence parallelism: the all-gather before a linear and the reduce-scatter after it, both directions.
        # An all-gather loses only what came from the other rank: this rank's own rows are intact.
        def gather_then_scatter():
            local = tokens.clone().requires_grad_()
            gathered = mappings.gather_from_sequence_parallel_region(local)
            assert torch.equal(gathered[8 * rank:8 * rank + 8].detach(), tokens)
            scattered = mappings.reduce_scatter_to_sequence_parallel_region(gathered * 1)
            scattered.backward(torch.ones_like(scattered))
            return [gathered, scattered], [local]

        _check_path(gather_then_scatter, [("tp:mappings.all_gather", "forward"),
                                          ("tp:mappings.reduce_scatter", "forward"),
                                          ("tp:mappings.all_gather", "backward"),
                                          ("tp:mappings.reduce_scatter", "backward")])

        # the linear layer's own collectives with sequence_parallel=True: the forward all-gather of its input, and in
        # backward the all-gather again (for the weight gradient, asynchronous) and the input-gradient reduce-scatter
        def sequence_parallel_linear():
            local = tokens.clone().requires_grad_()
            weight = torch.linspace(-1, 1, 12 * 16).reshape(12, 16).requires_grad_()
            output = layers.linear_with_grad_accumulation_and_async_allreduce(local, weight, None, False, False, True)
            output.backward(torch.ones_like(output))
            return [output], [local, weight]

        stats = _check_path(sequence_parallel_linear, [("tp:layers.all_gather", "forward"),
                                                       ("tp:layers.all_gather", "backward"),
                                                       ("tp:layers.reduce_scatter", "backward")])
        assert stats[("tp:layers.all_gather", "forward")][0] == 8 * 2 * 16 * 4 // 64  # the other rank's rows only
        _, grads, _ = _run(sequence_parallel_linear, ALL_LOST, forward=True, backward=False)
        assert torch.count_nonzero(grads[0]) > 0  # forward-only loss leaves the backward collectives exact

        # vocab-parallel cross-entropy: three all-reduces of its own (max, predicted logit, sum of exponentials)
        logits = torch.randn(8, 2, 10)
        target = torch.randint(0, 20, (8, 2))

        def cross_entropy():
            local = logits.clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(local, target)
            loss.sum().backward()
            return [loss], [local]

        stats = _check_path(cross_entropy, [("tp:cross_entropy.all_reduce", "forward")])
        assert stats[("tp:cross_entropy.all_reduce", "forward")][0] == 3  # three payloads of 64 B or less
        _, _, stats = _run(cross_entropy, make_loss_config("bernoulli", loss_rate=0.5, packet_bytes=4))
        assert 0 < stats[("tp:cross_entropy.all_reduce", "forward")][1] < 3 * 16

        # stale fill remembers per calling line: a lost sum of exponentials becomes the last one received there,
        # not the same-sized predicted logits that arrived just before it (replayed pattern: the 6th packet is lost)
        reference = vocab_parallel_cross_entropy(logits.clone(), target)
        pattern = Path(store_path).with_name(f"pattern{rank}.txt")
        pattern.write_text("000 001\n")
        with LossyMegatronIntegration(make_loss_config(f"replay:{pattern}", fill="stale", packet_bytes=64)) as lossy:
            losses = [vocab_parallel_cross_entropy(logits.clone(), target) for _ in range(2)]
        assert torch.equal(losses[0], reference) and torch.equal(losses[1], reference)
        assert _by_link(lossy, rank) == {("tp:cross_entropy.all_reduce", "forward"): (6, 1)}

        # MoE token exchange: all_to_all (equal and all2all-v splits) and the sp2hp / hp2sp reshuffles
        def token_exchange():
            local = tokens.reshape(16, 16).clone().requires_grad_()
            even = mappings.all_to_all(tp_group, local)
            uneven = mappings.all_to_all(tp_group, local, [4, 4] if rank == 0 else [12, 12], [4, 12] if rank == 0
                                         else [4, 12])
            hidden = mappings.all_to_all_sp2hp(local)
            back = mappings.all_to_all_hp2sp(hidden)
            (even.sum() + uneven.sum() + back.sum()).backward()
            return [even, uneven, hidden, back], [local]

        _check_path(token_exchange, [("tp:mappings.all_to_all", "forward"), ("tp:mappings.all_to_all", "backward")])
        with LossyMegatronIntegration(ALL_LOST):
            own = mappings.all_to_all(tp_group, tokens.reshape(16, 16))
        assert torch.equal(own[8 * rank:8 * rank + 8], tokens.reshape(16, 16)[8 * rank:8 * rank + 8])

        # forward recomputed inside the backward pass (activation checkpointing) travels with backward traffic
        def recomputed():
            local = tokens.clone().requires_grad_()
            output = torch.utils.checkpoint.checkpoint(
                lambda t: mappings.reduce_from_tensor_model_parallel_region(t * t), local, use_reentrant=True)
            output.sum().backward()
            return [output], [local]

        _, _, stats = _run(recomputed, ALL_LOST, forward=True, backward=False)
        assert stats == {("tp:mappings.all_reduce", "forward"): (16, 16)}, stats  # the forward pass
        _, _, stats = _run(recomputed, ALL_LOST, forward=False, backward=True)
        assert stats == {("tp:mappings.all_reduce", "backward"): (16, 16)}, stats  # its recompute

        # what stays exact: other groups, collectives called from outside megatron, integer payloads (metadata)
        other_group = dist.new_group([0, 1])
        with LossyMegatronIntegration(ALL_LOST) as integration:
            assert torch.equal(mappings._reduce(torch.ones(8, 16), other_group), torch.full((8, 16), 2.0))
            ours = torch.ones(8, 16)
            dist.all_reduce(ours, group=tp_group)
            assert torch.equal(ours, torch.full((8, 16), 2.0))
            counts = mappings.gather_from_sequence_parallel_region(torch.full((4,), rank + 1))
            assert counts.tolist() == [1] * 4 + [2] * 4
        assert integration.stats() == []
    finally:
        _stop()


def test_loss_on_megatron_tensor_parallel_collectives(tmp_path):
    mp.spawn(_collectives_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)
