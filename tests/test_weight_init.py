"""Building the model draws each initial weight once (megatron_app.train.weights): Megatron's own draw and master
weights are skipped while its initialisation still allocates and tags the parameters, and ours runs on several
threads; the weights and tags are those of drawing everything serially after Megatron's full initialisation."""

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """(config, build) of a small GPTModel with biases, on a one-rank job."""
    from helpers.one_rank_gpt import one_rank_gpt

    with one_rank_gpt(tmp_path_factory.mktemp("store"), vocab_size=64, max_sequence_length=16, num_layers=3,
                      hidden_size=32, num_attention_heads=4, init_method_std=0.02) as built:
        yield built


def _state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items() if hasattr(tensor, "clone")}


def _tags(model):
    """Each parameter's tensor-parallel tags, as Megatron's initialisation sets them."""
    return {name: tuple(getattr(param, tag, None) for tag in ("tensor_model_parallel", "partition_dim",
                                                              "partition_stride", "allreduce"))
            for name, param in model.named_parameters()}


def _same(a, b):
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_skipping_megatrons_draw_leaves_the_weights_bit_identical(gpt, monkeypatch):
    from megatron_app.train import weights

    config, build = gpt
    monkeypatch.setattr(weights, "_MOST_DRAW_THREADS", 1)
    reference = build()                      # Megatron draws, then ours serially: what every run did before
    weights.reinitialize_by_global_name([reference], config, seed=5)
    monkeypatch.setattr(weights, "_MOST_DRAW_THREADS", 8)
    with weights.megatron_draws_skipped(config):
        model = build()
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.partition_dim == 0 and qkv.tensor_model_parallel   # still tagged for the sharding and the clipping
    assert _tags(model) == _tags(reference)
    weights.reinitialize_by_global_name([model], config, seed=5)
    assert _same(_state(model), _state(reference))


def test_the_threads_draw_what_one_thread_draws(gpt, monkeypatch):
    from megatron_app.train import weights

    config, build = gpt
    drawn = {}
    for threads in (1, 4):
        monkeypatch.setattr(weights, "_MOST_DRAW_THREADS", threads)
        monkeypatch.setattr(weights.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
        model = build()
        weights.reinitialize_by_global_name([model], config, seed=11)
        drawn[threads] = _state(model)
    assert weights._draw_threads(100) == 4
    assert _same(drawn[1], drawn[4])


def test_drawn_ahead_within_the_byte_bound_and_copied_on_the_calling_thread(gpt, monkeypatch):
    """Workers only draw: the copies into the parameters (on a GPU, onto the device) run on the calling thread, and
    no more than the bound is drawn ahead of them (here 1 byte: each parameter alone)."""
    import threading

    import torch

    from megatron_app.train import weights

    config, build = gpt
    monkeypatch.setattr(weights, "_MOST_DRAW_THREADS", 1)
    reference = build()
    weights.reinitialize_by_global_name([reference], config, seed=7)
    monkeypatch.setattr(weights, "_MOST_DRAW_THREADS", 4)
    monkeypatch.setattr(weights.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(weights, "_DRAWN_BYTES_AHEAD", 1)
    copying_threads = set()
    megatron_copy = torch.Tensor.copy_

    def copy_(tensor, *args, **kwargs):
        copying_threads.add(threading.get_ident())
        return megatron_copy(tensor, *args, **kwargs)

    model = build()
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    weights.reinitialize_by_global_name([model], config, seed=7)
    monkeypatch.setattr(torch.Tensor, "copy_", megatron_copy)
    assert copying_threads == {threading.get_ident()}
    assert _same(_state(model), _state(reference))


def test_the_configs_init_methods_come_back_even_after_a_failed_build(gpt):
    from megatron_app.train import weights

    config, _ = gpt
    before = (config.init_method, config.output_layer_init_method, config.embedding_init_method)
    initializer = weights.megatron_layers._initialize_affine_weight_cpu
    with pytest.raises(RuntimeError, match="mid-build"):
        with weights.megatron_draws_skipped(config):
            assert config.init_method is weights._leave_as_allocated
            assert weights.megatron_layers._initialize_affine_weight_cpu is not initializer
            raise RuntimeError("mid-build")
    assert (config.init_method, config.output_layer_init_method, config.embedding_init_method) == before
    assert weights.megatron_layers._initialize_affine_weight_cpu is initializer


def test_a_caller_keeping_megatrons_master_weight_gets_megatrons_initializer():
    import torch

    from megatron_app.train import weights

    calls = []

    def megatron_like(weight, output_size, input_size, per_partition_size, partition_dim, init_method, stride=1,
                      return_master_weight=False, *, params_dtype=torch.float32, rank=None, world_size=None,
                      skip_set_tensor_parallel_attributes=False):
        calls.append(return_master_weight)
        return "master"

    tag_only = weights._tag_only(megatron_like)
    weight = torch.empty(4, 2)
    assert tag_only(weight, 8, 2, 4, 0, None, return_master_weight=True, rank=0, world_size=2) == "master"
    assert tag_only(weight, 8, 2, 4, 0, None, 2, rank=0, world_size=2) is None and calls == [True]
    assert (weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride) == (True, 0, 2)
    assert weights._tag_only(lambda tensor: None) is None   # another signature: Megatron's own stays


def test_a_worker_threads_failure_reaches_the_caller(gpt, monkeypatch):
    from megatron_app.train import weights

    config, build = gpt
    model = build()
    monkeypatch.setattr(weights, "_MOST_DRAW_THREADS", 4)
    monkeypatch.setattr(weights, "init_rule", lambda name, cfg: (_ for _ in ()).throw(ValueError(f"no rule {name}")))
    with pytest.raises(ValueError, match="no rule"):
        weights.reinitialize_by_global_name([model], config, seed=1)
