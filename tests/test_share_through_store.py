"""session.first_refusal_through_store: the ranks' layout refusals at a pipeline group's first call go through the
job's c10d store, not a gloo collective (whose worker thread can die in a C++ destructor when the caller raises and
the interpreter finalizes first: 'terminate called without an active exception' after the one-line refusal)."""

import threading

import pytest
import torch.distributed as dist

from megatron_app.runtime.session import first_refusal_through_store

TOPIC = "megatron_app/layout_refusal"


def _tell_on_threads(store, told_by_rank, group="ranks-0-1", timeout_s=10.0):
    results, errors = {}, {}

    def rank_body(rank):
        try:
            results[rank] = first_refusal_through_store(store, TOPIC, group, rank, len(told_by_rank),
                                                        told_by_rank[rank], timeout_s)
        except Exception as error:  # the test reads it
            errors[rank] = error

    threads = [threading.Thread(target=rank_body, args=(rank,)) for rank in told_by_rank]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    return results


def test_every_rank_hears_of_the_refusal_and_its_rank():
    store = dist.HashStore()
    refusal = "pipeline rank 1's model chunk 0 was built with pre_process=True: rank 1 fixes it"
    assert _tell_on_threads(store, {0: None, 1: refusal, 2: None}) == {rank: (1, refusal) for rank in (0, 1, 2)}


def test_no_refusal_is_none_everywhere_and_two_refusals_agree_on_one():
    store = dist.HashStore()
    assert _tell_on_threads(store, {0: None, 1: None}) == {0: None, 1: None}
    told = _tell_on_threads(store, {0: "a", 1: "b"})
    assert told[0] == told[1] in ((0, "a"), (1, "b"))


def test_a_later_round_is_not_answered_by_an_earlier_one():
    store = dist.HashStore()
    assert _tell_on_threads(store, {0: "first", 1: None})[1] == (0, "first")
    assert _tell_on_threads(store, {0: None, 1: None}) == {0: None, 1: None}


def test_groups_keep_their_own_keys():
    store = dist.HashStore()
    assert _tell_on_threads(store, {0: "a", 1: None}, group="ranks-0-1")[1] == (0, "a")
    assert _tell_on_threads(store, {0: None, 1: None}, group="ranks-2-3") == {0: None, 1: None}


def test_a_rank_that_never_comes_is_named_with_the_wait():
    with pytest.raises(TimeoutError, match=r"rank 0: the 2 ranks of ranks-0-1 did not all reach their first "
                                           r"pipeline call within 0.2 s"):
        first_refusal_through_store(dist.HashStore(), TOPIC, "ranks-0-1", 0, 2, None, 0.2)
