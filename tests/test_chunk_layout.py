"""A model built for another place in the pipeline is refused at the first call, in one line naming the pipeline
rank, the chunk and the fix (runtime/call_setup.check_chunk_layout): pre_process / post_process against the chunk's
virtual stage, vp_stage against the chunk index, the config's pipeline sizes against the call's group and chunks.
The end-to-end case (a misbuilt P=2 V=2 run) is in tests/test_simple_train_loop.py."""

import dataclasses
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """A tiny GPTModel built on a one-rank job: the check reads only its flags, set per case."""
    from helpers.one_rank_gpt import one_rank_gpt

    with one_rank_gpt(tmp_path_factory.mktemp("store"), vocab_size=32, max_sequence_length=8, num_layers=2,
                      hidden_size=16, num_attention_heads=2) as built:
        yield built


def _chunks(gpt, P, V, pp_rank):
    """V chunks of pipeline rank pp_rank, built right."""
    config, build = gpt
    models = []
    for c in range(V):
        model = build()
        stage = c * P + pp_rank
        model.pre_process, model.post_process = stage == 0, stage == P * V - 1
        model.vp_stage = c if V > 1 else None
        models.append(model)
    config = dataclasses.replace(config, pipeline_model_parallel_size=P,
                                 virtual_pipeline_model_parallel_size=V if V > 1 else None)
    return SimpleNamespace(models=models, config=config)


def _apply(chunks, key, value):
    """Build one thing wrong: key = (chunk, attribute), or (chunk, "config") with the config's changes."""
    c, attribute = key
    if attribute == "config":
        chunks.config = dataclasses.replace(chunks.config, **value)
    else:
        setattr(chunks.models[c], attribute, value)
    return chunks


def _refusal(chunks, pp_rank, P):
    from megatron_app.runtime.call_setup import check_chunk_layout
    from megatron_app.runtime.settings import AppConfigError

    with pytest.raises(AppConfigError) as refused:
        check_chunk_layout(chunks, pp_rank, P)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_a_well_built_layout_passes(gpt):
    from megatron_app.runtime.call_setup import check_chunk_layout

    for P, V in ((2, 1), (2, 2), (4, 2)):
        for pp_rank in range(P):
            check_chunk_layout(_chunks(gpt, P, V, pp_rank), pp_rank, P)


def test_pre_process_on_a_later_stage_names_rank_chunk_and_fix(gpt):
    message = _refusal(_apply(_chunks(gpt, 2, 2, 1), (0, "pre_process"), True), 1, 2)
    assert message == ("pipeline rank 1's model chunk 0 (virtual stage 1 of 4, P=2 V=2) was built with "
                       "pre_process=True; build it with pre_process=parallel_state.is_pipeline_first_stage("
                       "ignore_virtual=False, vp_stage=0)")


def test_post_process_missing_on_the_last_stage(gpt):
    message = _refusal(_apply(_chunks(gpt, 2, 1, 1), (0, "post_process"), False), 1, 2)
    assert message.startswith("pipeline rank 1's model chunk 0 (virtual stage 1 of 2, P=2 V=1) was built with "
                              "post_process=False; build it with post_process=parallel_state.is_pipeline_last_stage(")


def test_vp_stage_against_the_chunk_index(gpt):
    message = _refusal(_apply(_chunks(gpt, 2, 2, 0), (1, "vp_stage"), None), 0, 2)
    assert message == "pipeline rank 0's model chunk 1 (P=2 V=2) was built with vp_stage=None; build chunk 1 with " \
                      "vp_stage=1"


def test_the_configs_pipeline_size_against_the_group(gpt):
    message = _refusal(_apply(_chunks(gpt, 2, 1, 0), (0, "config"), {"pipeline_model_parallel_size": 1}), 0, 2)
    assert message == ("pipeline rank 0's model chunk 0: its config has pipeline_model_parallel_size=1 but the call's "
                       "pipeline group has 2 ranks; build the TransformerConfig with pipeline_model_parallel_size=2")


def test_the_configs_virtual_size_against_the_chunks(gpt):
    message = _refusal(_apply(_chunks(gpt, 2, 1, 0), (0, "config"), {"virtual_pipeline_model_parallel_size": 2}),
                       0, 2)
    assert "virtual_pipeline_model_parallel_size=2 but this rank passes 1 model chunk(s)" in message


def test_modules_that_are_no_megatron_language_model_are_not_checked(gpt):
    import torch

    from megatron_app.runtime.call_setup import check_chunk_layout

    linear = torch.nn.Linear(2, 1)
    linear.pre_process = True
    check_chunk_layout(SimpleNamespace(models=[linear], config=gpt[0]), 1, 2)


def test_data_iterators_against_the_chunks_are_one_line_naming_the_fix():
    import torch

    from megatron_app.runtime.call_setup import ModelChunks
    from megatron_app.runtime.settings import AppConfigError

    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with pytest.raises(AppConfigError,
                       match=r"^(rank \d+: )?got 1 data iterators for 2 model chunks; pass one per chunk") as raised:
        ModelChunks(chunks, [iter([])])
    assert len(str(raised.value).splitlines()) == 1
    with pytest.raises(AppConfigError, match="with 2 model chunks, data_iterator must be a list"):
        ModelChunks(chunks, iter([]))


def test_the_model_shape_the_trace_header_records(gpt):
    """RankPlacement.model (written into the trace header, carried on by cost curves): the config's sizes and the
    language model's vocabulary; a module that is no language model gives no vocabulary."""
    import torch

    from megatron_app.runtime.call_setup import model_shape_of

    shape = model_shape_of(_chunks(gpt, 2, 2, 1))
    assert shape == {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "ffn_hidden_size": 64,
                     "vocab_size": 32, "params_dtype": "float32", "tensor_parallel": 1}
    assert model_shape_of(SimpleNamespace(models=[torch.nn.Linear(2, 1)], config=gpt[0]))["vocab_size"] is None
