"""session.share_through_store: the ranks' layout refusals at a pipeline group's first call go through the job's c10d
store, not a gloo collective (whose worker thread can die in a C++ destructor when the caller raises and the
interpreter finalizes first: 'terminate called without an active exception' after the one-line refusal)."""

import threading

import pytest
import torch.distributed as dist

from megatron_app.runtime.session import share_through_store

TOPIC = "megatron_app/layout_refusal"


def _share_on_threads(store, told_by_rank, timeout_s=10.0):
    ranks = sorted(told_by_rank)
    results, errors = {}, {}

    def rank_body(rank):
        try:
            results[rank] = share_through_store(store, TOPIC, rank, ranks, told_by_rank[rank], timeout_s)
        except Exception as error:  # the test reads it
            errors[rank] = error

    threads = [threading.Thread(target=rank_body, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    return results


def test_every_rank_hears_every_rank_and_an_empty_message_is_not_none():
    store = dist.HashStore()
    told = {0: None, 1: "rank 1's chunk 0 was built with pre_process=True", 2: ""}
    results = _share_on_threads(store, told)
    assert results == {rank: told for rank in told}


def test_a_later_round_is_not_answered_by_an_earlier_one():
    store = dist.HashStore()
    assert _share_on_threads(store, {0: "first", 1: None})[0] == {0: "first", 1: None}
    assert _share_on_threads(store, {0: None, 1: None})[1] == {0: None, 1: None}


def test_groups_of_other_ranks_keep_their_own_keys():
    store = dist.HashStore()
    assert _share_on_threads(store, {0: "a", 1: None})[1] == {0: "a", 1: None}
    assert _share_on_threads(store, {2: None, 3: "b"})[2] == {2: None, 3: "b"}


def test_a_rank_that_never_comes_is_named_with_the_wait():
    store = dist.HashStore()
    with pytest.raises(TimeoutError, match=r"rank 0: ranks \[0, 1\] did not all reach their first pipeline call "
                                           r"within 0.2 s"):
        share_through_store(store, TOPIC, 0, [0, 1], None, 0.2)
