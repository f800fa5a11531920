"""RankState: readiness rules, activation accounting and protocol errors."""

import pytest

from megatron_app.schedule import Kind, PipelineShape, RankState, ScheduleStateError, Task

F, B = Kind.FORWARD, Kind.BACKWARD


def run(state, task):
    state.mark_started(task)
    state.mark_done(task)


def test_first_rank_starts_with_every_chunk0_forward_ready():
    state = RankState(PipelineShape(2, 2, 4), 0)
    assert state.ready() == [Task(F, 0, mb) for mb in range(4)]
    assert state.lowest_unstarted_microbatch == 0
    assert not state.finished and state.remaining == 2 * 2 * 4


def test_forward_waits_for_its_activation_and_backward_for_grad_and_own_forward():
    state = RankState(PipelineShape(2, 2, 2), 1)   # rank 1 holds vs 1 (chunk 0) and vs 3 (chunk 1, last)
    assert state.ready() == []
    state.mark_arrived(Task(B, 0, 0))               # gradient may arrive before... it cannot run without its F
    state.mark_arrived(Task(F, 0, 0))
    assert state.ready() == [Task(F, 0, 0)]
    run(state, Task(F, 0, 0))
    assert state.ready() == [Task(B, 0, 0)]         # grad here and own forward done
    state.mark_arrived(Task(F, 1, 0))
    run(state, Task(F, 1, 0))
    assert Task(B, 1, 0) in state.ready()           # last virtual stage: loss is local, no arrival needed


def test_activations_count_at_forward_start_and_free_at_backward_end():
    state = RankState(PipelineShape(1, 1, 3), 0)
    state.mark_started(Task(F, 0, 0))
    assert state.activations_held == 1
    state.mark_done(Task(F, 0, 0))
    run(state, Task(F, 0, 1))
    assert state.activations_held == 2 and state.peak_activations == 2
    assert state.in_flight_microbatches() == [0, 1]
    state.mark_started(Task(B, 0, 0))
    assert state.activations_held == 2              # freed when the backward ends
    state.mark_done(Task(B, 0, 0))
    assert state.activations_held == 1 and state.in_flight_microbatches() == [1]
    assert state.done_tasks == [Task(F, 0, 0), Task(F, 0, 1), Task(B, 0, 0)]
    assert state.lowest_unstarted_microbatch == 2


def test_forward_only_frees_each_activation_after_its_forward():
    state = RankState(PipelineShape(1, 1, 3, forward_only=True), 0)
    for mb in range(3):
        state.mark_started(Task(F, 0, mb))
        assert state.activations_held == 1
        state.mark_done(Task(F, 0, mb))
        assert state.activations_held == 0
    assert state.finished and state.peak_activations == 1 and state.in_flight_microbatches() == []


def test_per_microbatch_bookkeeping():
    state = RankState(PipelineShape(2, 2, 4), 0)
    run(state, Task(F, 0, 1))
    assert state.lowest_unstarted_microbatch == 0   # microbatch 0 has not started yet
    run(state, Task(F, 0, 0))
    assert state.lowest_unstarted_microbatch == 2
    state.mark_arrived(Task(F, 1, 1))
    run(state, Task(F, 1, 1))
    assert state.lowest_unstarted_microbatch == 2
    run(state, Task(F, 0, 3))
    run(state, Task(F, 0, 2))
    assert state.lowest_unstarted_microbatch is None
    assert (state.forwards_started(1), state.activations_of(1)) == (2, 2)
    assert (state.forwards_started(0), state.activations_of(0)) == (1, 1)


@pytest.mark.parametrize("action, message", [
    (lambda s: s.mark_started(Task(F, 0, 0)), "cannot start .* not ready"),
    (lambda s: s.mark_done(Task(F, 0, 0)), "never started"),
    (lambda s: s.mark_arrived(Task(B, 1, 0)), "takes no remote input"),
])
def test_protocol_errors_on_rank_with_nothing_ready(action, message):
    state = RankState(PipelineShape(2, 2, 2), 1)
    with pytest.raises(ScheduleStateError, match=message):
        action(state)


def test_double_events_are_rejected():
    state = RankState(PipelineShape(2, 1, 2), 1)
    state.mark_arrived(Task(F, 0, 0))
    with pytest.raises(ScheduleStateError, match="arrived twice"):
        state.mark_arrived(Task(F, 0, 0))
    state.mark_started(Task(F, 0, 0))
    with pytest.raises(ScheduleStateError, match="already started"):
        state.mark_started(Task(F, 0, 0))
    state.mark_done(Task(F, 0, 0))
    with pytest.raises(ScheduleStateError, match="finished twice"):
        state.mark_done(Task(F, 0, 0))


def test_describe_names_rank_and_ready_tasks():
    text = RankState(PipelineShape(2, 1, 2), 0).describe()
    assert text.startswith("rank 0: done 0/4") and "F(chunk=0, mb=0)" in text
