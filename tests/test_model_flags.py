"""Megatron-LM's architecture flags (a Llama-shaped model): their defaults and refusals, what reaches Megatron-Core's
TransformerConfig and GPTModel, and a checkpoint of another architecture refused. That such a model trains equal to
P=1 at P=2 V=2 and T=2, packed documents and rotary embeddings included: tests/test_pipeline_equality.py."""

import pytest
import torch

from megatron_app.train.args import UsageError, parse_args

WORLD = {"WORLD_SIZE": "1"}
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--group-query-attention",
         "--num-query-groups", "2", "--position-embedding-type", "rope"]


def test_defaults_are_the_classic_gpt_and_swiglu_takes_megatron_lms_width():
    args = parse_args(["--hidden-size", "96"], WORLD)
    assert (args.normalization, args.position_embedding_type, args.swiglu, args.disable_bias_linear) == \
        ("LayerNorm", "learned_absolute", False, False)
    assert args.ffn_hidden_size == 384 and args.num_query_groups == args.num_attention_heads
    assert parse_args(["--hidden-size", "96", "--swiglu"], WORLD).ffn_hidden_size == 256   # int(4h * 2/3 / 64) * 64
    assert parse_args(["--swiglu", "--ffn-hidden-size", "100"], WORLD).ffn_hidden_size == 100
    # a Megatron-LM command line that names the local layers runs as it is
    assert parse_args(["--transformer-impl", "local"], WORLD).transformer_impl == "local"


@pytest.mark.parametrize("argv,fragment", [
    (["--normalization", "BatchNorm"], "invalid choice"),
    (["--swiglu", "--hidden-size", "16", "--num-attention-heads", "4"], "rounds to 0; give --ffn-hidden-size"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size 0 must be a positive multiple"),
    (["--num-query-groups", "2"], "takes effect with --group-query-attention"),
    (["--group-query-attention"], "needs --num-query-groups G"),
    (["--group-query-attention", "--num-query-groups", "3"], "divides --num-attention-heads 4"),
    (["--rotary-base", "500000"], "--rotary-base shapes rotary embeddings"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent must be in (0, 1]"),
    (["--norm-epsilon", "0"], "--norm-epsilon must be positive"),
    (["--init-method-std", "-1"], "--init-method-std must be positive"),
    # Megatron-LM's default layers: not supported yet, said in one line (docs/gpu.md, "Limits on a GPU")
    (["--transformer-impl", "transformer_engine"], "Transformer Engine's layers are not supported yet"),
    (["--transformer-impl", "te"], "invalid choice"),
])
def test_architecture_mistakes_are_refused_in_one_line(argv, fragment):
    with pytest.raises(UsageError) as error:
        parse_args(argv, WORLD)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_the_flags_reach_megatron_cores_config_and_model(tmp_path):
    from megatron_app.train.model import build_transformer_config, document_layer_spec

    config = build_transformer_config(parse_args(LLAMA, WORLD))
    assert (config.normalization, config.gated_linear_unit, config.activation_func, config.add_bias_linear,
            config.num_query_groups, config.ffn_hidden_size) == ("RMSNorm", True, torch.nn.functional.silu, False, 2,
                                                                 128)
    classic = build_transformer_config(parse_args([], WORLD))
    assert (classic.normalization, classic.gated_linear_unit, classic.activation_func, classic.add_bias_linear,
            classic.num_query_groups, classic.ffn_hidden_size) == ("LayerNorm", False, torch.nn.functional.gelu, True,
                                                                   4, 256)
    norm = document_layer_spec("RMSNorm").submodules.input_layernorm   # Megatron's wrapper: the config decides
    assert isinstance(norm(config=config, hidden_size=64, eps=config.layernorm_epsilon), torch.nn.RMSNorm)
    assert isinstance(norm(config=classic, hidden_size=64, eps=classic.layernorm_epsilon), torch.nn.LayerNorm)


def test_the_initial_spread_reaches_the_layout_independent_weights_and_the_output_layer_is_tied_unless_untied():
    from megatron_app.train.model import build_transformer_config
    from megatron_app.train.weights import draw_full_parameter

    config = build_transformer_config(parse_args(["--init-method-std", "0.1", "--num-layers", "8"], WORLD))
    weight = draw_full_parameter("decoder.layers.0.mlp.linear_fc1.weight", (256, 64), config, seed=1)
    projection = draw_full_parameter("decoder.layers.0.mlp.linear_fc2.weight", (64, 256), config, seed=1)
    assert weight.std().item() == pytest.approx(0.1, rel=0.05)
    assert projection.std().item() == pytest.approx(0.1 / (2 * 8) ** 0.5, rel=0.05)   # Megatron's depth scaling
    assert parse_args(["--untie-embeddings-and-output-weights"], WORLD).untie_embeddings_and_output_weights
    assert not parse_args([], WORLD).untie_embeddings_and_output_weights   # tied, as in Megatron-LM


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path):
    import os

    from megatron_app.train.checkpoint_manifest import commit, iteration_dir, manifest_for

    saved = parse_args([*LLAMA, "--iters", "2"], WORLD)
    os.makedirs(iteration_dir(str(tmp_path), 2))
    commit(str(tmp_path), manifest_for(saved, 2, 16, files=[]))
    assert parse_args([*LLAMA, "--iters", "4", "--load", str(tmp_path)], WORLD).load == str(tmp_path)
    with pytest.raises(UsageError, match="has position_embedding_type=rope but this run has --position-embedding-type "
                                         "learned_absolute"):
        parse_args([*LLAMA[:-2], "--iters", "4", "--load", str(tmp_path)], WORLD)
    with pytest.raises(UsageError, match="has untie_embeddings_and_output_weights=False but this run has "
                                         "--untie-embeddings-and-output-weights True"):
        parse_args([*LLAMA, "--untie-embeddings-and-output-weights", "--iters", "4", "--load", str(tmp_path)], WORLD)


def test_a_checkpoint_from_before_tying_was_recorded_is_an_untied_one(tmp_path):
    import os

    from megatron_app.train.checkpoint_manifest import commit, iteration_dir, manifest_for

    saved = manifest_for(parse_args(["--iters", "2"], WORLD), 2, 16, files=[])
    del saved["model"]["untie_embeddings_and_output_weights"]   # every model was untied then
    os.makedirs(iteration_dir(str(tmp_path), 2))
    commit(str(tmp_path), saved)
    assert parse_args(["--untie-embeddings-and-output-weights", "--iters", "4", "--load", str(tmp_path)], WORLD).load
    with pytest.raises(UsageError, match="has untie_embeddings_and_output_weights=True"):
        parse_args(["--iters", "4", "--load", str(tmp_path)], WORLD)
