"""plan_microbatches in one process (no pipeline group): what it hands the next forward_backward call."""

import pytest

from megatron_app.runtime import composition as runtime_composition
from megatron_app.runtime.microbatch_lengths import take_microbatch_lengths
from megatron_app.runtime.job import shutdown

LENGTHS = (120, 300, 2048, 90, 410, 150, 1900, 260)


@pytest.fixture(autouse=True)
def fresh_session():
    shutdown()
    yield
    shutdown()


@pytest.mark.parametrize("name,packed,count", [("loader", False, 4), ("packed", True, 4)])
def test_loader_compositions_tell_tokens_and_leave_planning_to_the_policy(name, packed, count):
    chosen = runtime_composition.plan_microbatches(LENGTHS, 2, name)
    assert chosen.packed is packed and chosen.num_microbatches == count
    assert take_microbatch_lengths(count) == chosen.microbatch_tokens(LENGTHS)
    pending = runtime_composition.take_pending_composition(count)
    assert pending.plan is None and pending.squared_tokens == chosen.microbatch_squared_tokens(LENGTHS)


def test_balanced_composition_comes_with_its_plan_before_any_call():
    chosen = runtime_composition.plan_microbatches(LENGTHS, 2, "balanced")
    chosen.check(len(LENGTHS))
    m = chosen.num_microbatches
    assert take_microbatch_lengths(m) == chosen.microbatch_tokens(LENGTHS)
    pending = runtime_composition.take_pending_composition(m)
    assert pending.plan is not None and len(pending.plan.start_order) == m
    assert runtime_composition.take_pending_composition(m) is None        # consumed


def test_a_call_with_another_count_is_refused():
    chosen = runtime_composition.plan_microbatches(LENGTHS, 2, "packed")
    with pytest.raises(ValueError):
        runtime_composition.take_pending_composition(chosen.num_microbatches + 1)
    with pytest.raises(Exception):
        runtime_composition.plan_microbatches(LENGTHS, 2, "shuffled")
