"""wrap_data_iterator (train/data_schedule.py): Megatron's packer's call shape over our agree_iteration_plan."""

import pytest
import torch

from megatron_app.runtime.microbatch_lengths import take_microbatch_lengths
from megatron_app.runtime.next_call import call_plan_of
from megatron_app.train.data_schedule import wrap_data_iterator

LENGTHS = (3, 5, 2, 4)


def _loader():
    """A loader of micro batch size 1: each item one document, [1, length]."""
    for n, length in enumerate(LENGTHS):
        ids = torch.arange(length + 1) + 10 * n
        yield {"tokens": ids[:-1].view(1, -1), "labels": ids[1:].view(1, -1),
               "loss_mask": torch.ones(1, length), "position_ids": torch.arange(length).view(1, -1)}


def test_packed_microbatches_concatenate_the_documents_and_tell_the_schedule_their_tokens():
    iterator, count, tokens, squares = wrap_data_iterator(_loader(), None, len(LENGTHS), composition="packed",
                                                          micro_batch_size=2)
    planned = call_plan_of(iterator)    # the call's plan travels with its data
    batches = list(iterator)
    assert count == len(batches) == 2
    assert [b["tokens"].shape for b in batches] == [(1, 8), (1, 6)]
    assert batches[0]["tokens"][0].tolist() == [0, 1, 2, 10, 11, 12, 13, 14]
    assert [b["cu_seqlens"].tolist() for b in batches] == [[0, 3, 8], [0, 2, 6]]
    assert [b["max_seqlen"] for b in batches] == [5, 4]
    assert batches[1]["position_ids"][0].tolist() == [0, 1, 0, 1, 2, 3]
    assert (tokens, squares) == (14, 9 + 25 + 4 + 16)
    assert planned.tokens == (8, 6)    # what the schedule plans with
    assert take_microbatch_lengths(2) is None    # nothing waits on the job


def test_loader_composition_pads_and_one_iterator_per_chunk_yields_the_same_batches():
    iterators, count, tokens, _ = wrap_data_iterator([_loader(), None], None, len(LENGTHS), composition="loader",
                                                     micro_batch_size=2)
    assert count == 2 and tokens == 2 * 5 + 2 * 4    # padding counted: it is computed
    assert iterators[1] is None                      # padded: a chunk that read no data still reads none
    batches = list(iterators[0])
    assert [b["tokens"].shape for b in batches] == [(2, 5), (2, 4)]
    assert batches[0]["loss_mask"].sum() == 8 and "cu_seqlens" not in batches[0]
    assert call_plan_of(iterators).tokens == (10, 8)


def test_packed_gives_every_chunk_the_bounds():
    iterators, _, _, _ = wrap_data_iterator([_loader(), None], None, len(LENGTHS), composition="packed",
                                            micro_batch_size=2)
    assert [b["cu_seqlens"].tolist() for b in iterators[1]] == [[0, 3, 8], [0, 2, 6]]


def test_no_data_and_no_pipeline_to_take_lengths_from_is_a_clear_error():
    with pytest.raises(ValueError, match="no data iterator"):
        wrap_data_iterator(None, None, 4, composition="packed")


def _pipeline_rank(rank, port, out_dir):
    import json
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        # only the first stage reads data, as in Megatron-LM's loops
        iterator, count, tokens, _ = wrap_data_iterator(_loader() if rank == 0 else None, None, len(LENGTHS),
                                                        composition="packed", micro_batch_size=2)
        result = {"count": count, "tokens": tokens, "told": list(call_plan_of(iterator).tokens),
                  "bounds": [b["cu_seqlens"].tolist() for b in iterator]}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_pipeline_stage_without_data_gets_the_first_stages_plan_and_bounds(tmp_path):
    import json

    import torch.multiprocessing as mp

    from test_checkpoint_resume import _free_port

    mp.start_processes(_pipeline_rank, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first == second == {"count": 2, "tokens": 14, "told": [8, 6], "bounds": [[0, 3, 8], [0, 2, 6]]}


def test_keyed_dropout_keys_each_iterations_documents_apart():
    """The document at one position of the global batch gets another key each iteration (set_iteration, or the
    advance after a training call), so its dropout masks differ between iterations; without keyed randomness the
    positions are the ids."""
    from megatron_app.runtime.job import current_job
    from megatron_app.runtime.keyed_randomness import KeyedRandomness, set_iteration

    current_job().keyed_randomness = state = KeyedRandomness(seed=5)
    try:
        seen = []
        for iteration in (3, 4):
            set_iteration(iteration)
            wrap_data_iterator(_loader(), None, len(LENGTHS), composition="packed", micro_batch_size=2)
            seen.append(sorted(s.document for mb in state.microbatch_documents for s in mb))
        assert seen == [[12, 13, 14, 15], [16, 17, 18, 19]]
    finally:
        current_job().keyed_randomness = None
    wrap_data_iterator(_loader(), None, len(LENGTHS), composition="packed", micro_batch_size=2)
