"""A small Megatron-Core GPTModel on a one-rank gloo job, for in-process tests of what reads a built model."""

from contextlib import contextmanager


@contextmanager
def one_rank_gpt(store_dir, vocab_size: int, max_sequence_length: int, **config_fields):
    """Yields (config, build): the TransformerConfig (CPU initialisation, fp32 pipeline, ``config_fields``) and a
    function that builds one GPTModel with our layer spec; the process group and Megatron's model-parallel state
    exist while inside."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_app.train.model import document_layer_spec

    dist.init_process_group("gloo", init_method=f"file://{store_dir / 'store'}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        config = TransformerConfig(use_cpu_initialization=True, pipeline_dtype=torch.float32, **config_fields)
        yield config, lambda: GPTModel(config=config, transformer_layer_spec=document_layer_spec(),
                                       vocab_size=vocab_size, max_sequence_length=max_sequence_length)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
