"""Megatron's DDP on gloo groups reduces its buckets one all-reduce each (megatron_app/gloo_gradients.py): what
ranks sharing one GPU need, since torch's gloo has no coalesced all-reduce of CUDA tensors. On CPU the same manager
runs on CPU tensors; examples/simple_train_loop.py (tests/test_simple_train_loop.py) trains through it."""

import json

from pipeline_runs import HELPERS, forked_ranks


def test_collected_all_reduces_run_one_by_one_sync_and_async_and_other_collectives_are_refused():
    result = forked_ranks(2, [HELPERS / "gloo_buckets_worker.py"], timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(line["rank"] for line in lines) == [0, 1]
    for line in lines:
        for async_ops in (False, True):
            assert line[f"async={async_ops}"] == [[3.0] * 5, [30.0] * 3]
        assert line["works async=False"] == 0 and line["works async=True"] == 2
        assert "only all-reduces are issued one by one" in line["all_gather"]


def test_installing_wraps_megatrons_manager_once():
    from megatron.core.distributed import param_and_grad_buffer

    from megatron_app.gloo_gradients import reduce_ddp_buckets_one_by_one_on_gloo

    original = param_and_grad_buffer._coalescing_manager
    try:
        reduce_ddp_buckets_one_by_one_on_gloo()
        wrapped = param_and_grad_buffer._coalescing_manager
        reduce_ddp_buckets_one_by_one_on_gloo()
        assert wrapped is param_and_grad_buffer._coalescing_manager and wrapped is not original
        assert wrapped.one_by_one_on_gloo
    finally:
        param_and_grad_buffer._coalescing_manager = original
