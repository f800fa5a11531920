"""Split backward in the schedule package: W tasks (weight gradients) in shapes, rank state, Megatron's order, the
ZB-H1-style static order (its closed form) and the adaptive policy filling waits with W's.

Makespans come from schedule.drive on its logical clock (one time unit per task unless said otherwise)."""

import pytest

from megatron_app.schedule import (Kind, PipelineShape, RankState, ScheduleConfigError, ScheduleStateError, Task,
                                   drive, make_policy, megatron_interleaved_cap, megatron_order)
from megatron_app.schedule.megatron_order import megatron_pipeline_cap, peak_activations_of_order
from megatron_app.schedule.zero_bubble import zb_h1_order

F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT


def makespan(shape, policies, forward=1.0, backward=1.0, weight=1.0, delay=0.0):
    """Logical-clock makespan of `policies` (a name or one policy per rank); split shapes' backward is B + W."""
    seconds = {F: forward, B: backward, W: weight}
    if not shape.split_backward:
        seconds[B] = backward + weight
    finish = {}
    drive(shape, policies, arrival_delay=lambda rank, task, peer: delay,
          task_duration=lambda rank, task: seconds[task.kind], finish_times=finish)
    return max(finish.values())


# ---- shape and state ------------------------------------------------------------------------------------------
def test_a_split_shape_lists_one_w_per_backward_and_w_stays_on_its_rank():
    shape = PipelineShape(2, 2, 4, split_backward=True)
    tasks = shape.tasks(1)
    assert sum(t.kind is W for t in tasks) == sum(t.kind is B for t in tasks) == 8
    w = Task(W, 0, 3)
    assert shape.input_source(1, w) is None and shape.output_target(1, w) is None
    assert shape.input_source(1, Task(B, 0, 3)) == (0, Task(B, 1, 3))     # B keeps the backward's path
    assert not any(t.kind is W for t in PipelineShape(2, 2, 4).tasks(1))


def test_w_tasks_need_a_split_shape_with_backwards():
    with pytest.raises(ScheduleConfigError, match="need split_backward"):
        PipelineShape(2, 1, 2).check_task(Task(W, 0, 0))
    with pytest.raises(ScheduleConfigError, match="forward-only shape has none"):
        PipelineShape(2, 1, 2, forward_only=True, split_backward=True)
    with pytest.raises(ScheduleConfigError, match="split_backward must be a bool"):
        PipelineShape(2, 1, 2, split_backward=1)


def test_w_becomes_ready_after_its_b_and_frees_the_activation():
    shape = PipelineShape(1, 1, 1, split_backward=True)
    state = RankState(shape, 0)
    forward, backward, weight = Task(F, 0, 0), Task(B, 0, 0), Task(W, 0, 0)
    state.mark_started(forward)
    state.mark_done(forward)
    assert state.ready() == [backward]
    state.mark_started(backward)
    state.mark_done(backward)
    assert state.ready_fill() == [weight]
    assert state.activations_held == 1 and state.in_flight_microbatches() == [0]     # W still needs the tensors
    state.mark_started(weight)
    state.mark_done(weight)
    assert state.activations_held == 0 and state.in_flight_microbatches() == [] and state.finished
    with pytest.raises(ScheduleStateError, match="no remote input"):
        state.mark_arrived(weight)


# ---- Megatron's order and ZB-H1 --------------------------------------------------------------------------------
@pytest.mark.parametrize("P, V, m", [(4, 1, 8), (3, 2, 6)])
def test_megatron_order_on_a_split_shape_runs_each_w_right_after_its_b(P, V, m):
    split, whole = PipelineShape(P, V, m, split_backward=True), PipelineShape(P, V, m)
    for rank in range(P):
        order = megatron_order(split, rank)
        assert tuple(t for t in order if t.kind is not W) == megatron_order(whole, rank)
        for index, task in enumerate(order):
            if task.kind is B:
                assert order[index + 1] == Task(W, task.chunk, task.microbatch)
        assert megatron_interleaved_cap(split, rank) == megatron_interleaved_cap(whole, rank)


@pytest.mark.parametrize("P, V, m", [(4, 1, 8), (8, 1, 16), (4, 2, 8), (4, 2, 16), (2, 3, 4)])
def test_zb_h1_meets_its_closed_form_with_uniform_costs(P, V, m):
    """ZB-H1's bubble is (P-1)(F+B-W) (Qi et al.): with F = B = W = 1 the makespan is 3mV + P - 1. 1F1B's bubble
    is (P-1)(F+B+W) with a whole backward, (P-1)(F+B) when each W runs right after its B (V == 1)."""
    shape = PipelineShape(P, V, m, split_backward=True)
    assert makespan(shape, "zb-h1") == 3 * m * V + P - 1
    if V == 1:
        assert makespan(shape, "1f1b") == 3 * m + 2 * (P - 1)
        assert makespan(PipelineShape(P, V, m), "1f1b") == 3 * (m + P - 1)
    assert makespan(shape, "zb-h1") < makespan(shape, "interleaved")


@pytest.mark.parametrize("P, V, m", [(4, 1, 8), (4, 2, 8)])
def test_zb_h1_holds_at_most_the_pipelines_megatron_peak_on_every_rank(P, V, m):
    shape = PipelineShape(P, V, m, split_backward=True)
    peaks = [peak_activations_of_order(shape, zb_h1_order(shape, rank)) for rank in range(P)]
    assert max(peaks) == megatron_pipeline_cap(shape)
    assert peaks[P - 1] > megatron_interleaved_cap(shape, P - 1)      # the price: later ranks hold more
    if V == 1:
        assert peaks == [P] * P


def test_zb_h1_needs_a_split_backward():
    with pytest.raises(ScheduleConfigError, match="needs a split backward"):
        make_policy("zb-h1", PipelineShape(2, 1, 4), 0)


# ---- adaptive: W's fill waits -----------------------------------------------------------------------------------
@pytest.mark.parametrize("P, V, m", [(4, 1, 8), (4, 2, 8), (8, 2, 16)])
def test_adaptive_with_a_split_backward_reaches_zb_h1_and_beats_it_when_messages_take_time(P, V, m):
    shape = PipelineShape(P, V, m, split_backward=True)
    assert makespan(shape, "adaptive") == makespan(shape, "zb-h1")
    slow = dict(forward=1.0, backward=1.0, weight=1.0, delay=1.0)
    assert makespan(shape, "adaptive", **slow) <= makespan(shape, "zb-h1", **slow)
    assert makespan(shape, "adaptive", **slow) <= makespan(shape, "interleaved", **slow)
    if V > 1:     # at V == 1 both take 41 units here (P=4, m=8, measured)
        assert makespan(shape, "adaptive", **slow) < makespan(shape, "interleaved", **slow)
    assert makespan(shape, "adaptive", **slow) < makespan(PipelineShape(P, V, m), "adaptive", **slow)


def test_adaptive_under_each_ranks_own_megatron_cap_keeps_megatrons_peak():
    shape = PipelineShape(4, 2, 8, split_backward=True)
    policies = [make_policy("adaptive", shape, rank, megatron_interleaved_cap(shape, rank)) for rank in range(4)]
    orders = drive(shape, policies)
    for rank, order in enumerate(orders.values()):
        assert peak_activations_of_order(shape, order) <= megatron_interleaved_cap(shape, rank)
