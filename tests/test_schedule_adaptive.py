"""The `adaptive` policy: the schedule property tests' guarantees (finishes, each task once, dependencies, memory cap)
under any delivery order and any cap it accepts, plus its own rules: follow Megatron's plan, deviate only with a
ready backward at least as critical after `patience` idle answers, learn costs from observe(), fall back to dfc
below the plan's cap."""

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_app.schedule import (Kind, PipelineShape, RankState, ScheduleConfigError, Task, drive, forward_fits,
                                   make_policy, megatron_interleaved_cap, megatron_order, minimum_memory_cap)
from megatron_app.schedule.adaptive import AdaptivePolicy, DurationEstimates, make_adaptive
from megatron_app.schedule.megatron_order import megatron_pipeline_cap
from test_schedule_properties import PROPERTY_SETTINGS, Stall, check_policy, run_adversarially, shapes, small_grid

F, B = Kind.FORWARD, Kind.BACKWARD


def run(state, task):
    state.mark_started(task)
    state.mark_done(task)


# ---- guarantees, with the property tests' adversarial driver ---------------------------------------------------
@PROPERTY_SETTINGS
@given(data=st.data(), shape=shapes(max_stages=6), seed=st.integers(0, 2**32 - 1))
def test_finishes_under_any_cap_it_accepts(data, shape, seed):
    least = minimum_memory_cap(shape)
    caps = [data.draw(st.integers(least, max(least, megatron_interleaved_cap(shape, rank)) + 2), label=f"cap{rank}")
            for rank in range(shape.num_stages)]
    check_policy(shape, "adaptive", random.Random(seed), caps)


@PROPERTY_SETTINGS
@given(shape=shapes(), seed=st.integers(0, 2**32 - 1), patience=st.integers(0, 2))
def test_impatient_deviations_keep_every_guarantee(shape, seed, patience):
    # Random delivery order makes plan inputs late all the time, so deviations happen often here.
    policies = [make_adaptive(shape, rank, patience=patience) for rank in range(shape.num_stages)]
    orders, peak = run_adversarially(shape, policies, random.Random(seed))
    for rank, order in enumerate(orders):
        assert sorted(map(str, order)) == sorted(map(str, shape.tasks(rank)))
        # a split backward's default cap is the pipeline's peak (W's defer into the tail, as in ZB-H1)
        assert peak[rank] <= (megatron_pipeline_cap(shape) if shape.split_backward
                              else megatron_interleaved_cap(shape, rank))


def test_sweep_small_grid_tight_caps_and_no_patience():
    count = 0
    for shape in small_grid():
        for seed in range(2):
            check_policy(shape, "adaptive", random.Random(seed), [minimum_memory_cap(shape)] * shape.num_stages)
            policies = [make_adaptive(shape, rank, patience=0) for rank in range(shape.num_stages)]
            run_adversarially(shape, policies, random.Random(seed))
            count += 1
    assert count > 100


def test_megatron_plan_passes_admission_at_its_own_peak():
    """The premise of plan mode: executing Megatron's order never asks forward_fits for more than its peak."""
    for shape in small_grid():
        for rank in range(shape.num_stages):
            cap, state = megatron_interleaved_cap(shape, rank), RankState(shape, rank)
            for task in megatron_order(shape, rank):
                if shape.input_source(rank, task) is not None:
                    state.mark_arrived(task)
                assert task.kind is not F or forward_fits(state, task, cap), (shape, rank, task)
                run(state, task)


# ---- plan following -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [PipelineShape(4, 1, 8), PipelineShape(4, 2, 8), PipelineShape(3, 3, 9)])
def test_on_time_inputs_give_exactly_megatrons_order(shape):
    result = drive(shape, "adaptive", task_duration=lambda rank, task: 1.0 if task.kind is F else 2.0)
    for rank in range(shape.num_stages):
        assert tuple(result[rank]) == megatron_order(shape, rank)


def test_default_cap_and_plan_mode():
    shape = PipelineShape(4, 2, 8)
    for rank in range(4):
        policy = make_policy("adaptive", shape, rank)
        assert isinstance(policy, AdaptivePolicy) and policy.name == "adaptive"
        assert policy.memory_cap == megatron_interleaved_cap(shape, rank) and policy.follows_plan
        assert policy.expected_next(RankState(shape, rank)) == megatron_order(shape, rank)[0]


def late_backward_state():
    """Rank 0 of P=2, V=2, m=2 after its four forwards; its plan's next task is B(chunk 1, mb 0), whose gradient
    has not come, while B(chunk 1, mb 1)'s has."""
    shape = PipelineShape(2, 2, 2)
    state = RankState(shape, 0)
    assert megatron_order(shape, 0)[:5] == (Task(F, 0, 0), Task(F, 0, 1), Task(F, 1, 0), Task(F, 1, 1),
                                            Task(B, 1, 0))
    for task in megatron_order(shape, 0)[:4]:
        if task.chunk == 1:
            state.mark_arrived(task)
        run(state, task)
    state.mark_arrived(Task(B, 1, 1))
    return shape, state


def test_a_late_plan_backward_is_overtaken_after_patience_idle_answers():
    shape, state = late_backward_state()
    patient = make_adaptive(shape, 0, patience=1)
    assert patient.expected_next(state) == Task(B, 1, 0)
    assert patient.next(state) is None                 # just became idle: the input may be moments away
    assert patient.next(state) == Task(B, 1, 1)       # still missing after another arrival: deviate
    assert make_adaptive(shape, 0, patience=0).next(state) == Task(B, 1, 1)
    stubborn = make_adaptive(shape, 0, patience=3)
    assert [stubborn.next(state) for _ in range(4)] == [None, None, None, Task(B, 1, 1)]


def test_a_backward_never_jumps_a_late_forward():
    shape = PipelineShape(2, 2, 2)
    state = RankState(shape, 1)                        # plan: F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 B0.0 B0.1
    for task in megatron_order(shape, 1)[:4]:
        if task.kind is F:
            state.mark_arrived(task)
        run(state, task)
    state.mark_arrived(Task(B, 0, 0))                  # ready, but F(1, 1) feeds a longer chain
    policy = make_adaptive(shape, 1, patience=0)
    assert policy.expected_next(state) == Task(F, 1, 1) and state.is_ready(Task(B, 0, 0))
    assert [policy.next(state) for _ in range(3)] == [None, None, None]
    state.mark_arrived(Task(F, 1, 1))
    assert policy.next(state) == Task(F, 1, 1)


def test_one_policy_serves_several_iterations():
    shape = PipelineShape(3, 2, 6)
    policies = [make_policy("adaptive", shape, rank) for rank in range(3)]
    first = drive(shape, policies)
    second = drive(shape, policies)                    # fresh RankStates, same policy objects
    assert first == second and all(tuple(first[r]) == megatron_order(shape, r) for r in range(3))


def test_below_the_plans_cap_it_runs_dfc():
    shape = PipelineShape(4, 2, 8)
    caps = [minimum_memory_cap(shape)] * 4
    adaptive = [make_policy("adaptive", shape, r, caps[r]) for r in range(4)]
    assert not any(p.follows_plan for p in adaptive) and adaptive[0].expected_next(RankState(shape, 0)) is None
    delays = lambda src, task, dst: 0.25 * (1 + (task.microbatch + src) % 3)
    dfc = [make_policy("dfc", shape, r, caps[r]) for r in range(4)]
    assert drive(shape, adaptive, arrival_delay=delays) == drive(shape, dfc, arrival_delay=delays)


# ---- learning -------------------------------------------------------------------------------------------------
def test_estimates_are_moving_averages_per_kind_and_chunk():
    estimates = DurationEstimates(smoothing=0.5)
    assert (estimates.seconds(F, 0), estimates.seconds(B, 3)) == (1.0, 2.0)       # prior ratio only
    estimates.observe(Task(F, 0, 0), 0.010)
    assert estimates.seconds(F, 0) == 0.010
    assert estimates.seconds(F, 1) == 0.010                                         # the kind's mean
    assert math.isclose(estimates.seconds(B, 0), 0.020)                             # other kind x prior ratio
    estimates.observe(Task(F, 0, 1), 0.030)
    assert math.isclose(estimates.seconds(F, 0), 0.020)                             # 0.01 + 0.5 * (0.03 - 0.01)
    estimates.observe(Task(B, 1, 0), 0.050)
    assert estimates.seconds(B, 1) == 0.050 and estimates.seconds(B, 0) == 0.050
    for bad in (-1.0, float("nan")):
        with pytest.raises(ScheduleConfigError, match="must be >= 0 seconds"):
            estimates.observe(Task(F, 0, 0), bad)


def test_criticality_uses_what_was_learned():
    shape = PipelineShape(4, 2, 8)
    policy = make_adaptive(shape, 1)
    for task, seconds in ((Task(F, 0, 0), 1.0), (Task(F, 1, 0), 3.0), (Task(B, 0, 0), 2.0), (Task(B, 1, 0), 5.0)):
        policy.observe(task, seconds)
    # B(chunk 1) on rank 1 is virtual stage 5: stages 4..0 remain = one chunk-1 stage (5 s) + four chunk-0 (2 s)
    assert policy.chain_after_seconds(Task(B, 1, 3)) == 5.0 + 4 * 2.0
    assert policy.chain_after_seconds(Task(B, 0, 3)) == 2.0                         # stage 1 -> stage 0
    # F(chunk 0) on rank 1 is stage 1: forwards of stages 2, 3 (1 s) and 4..7 (3 s), then all 8 backwards
    assert policy.chain_after_seconds(Task(F, 0, 3)) == 2 * 1.0 + 4 * 3.0 + 4 * 2.0 + 4 * 5.0


def test_option_errors():
    shape = PipelineShape(2, 2, 4)
    with pytest.raises(ScheduleConfigError, match="patience must be an int >= 0, got -1"):
        make_adaptive(shape, 0, patience=-1)
    with pytest.raises(ScheduleConfigError, match="memory_cap=1 cannot finish"):
        make_policy("adaptive", shape, 0, memory_cap=1)
    with pytest.raises(ScheduleConfigError, match="must list each of its tasks exactly once"):
        AdaptivePolicy(shape, 0, 8, megatron_order(shape, 0)[1:], make_policy("dfc", shape, 0))
    with pytest.raises(ScheduleConfigError, match=r"smoothing must be in \(0, 1\], got 0"):
        DurationEstimates(smoothing=0)


def test_explicit_caps_guard_progress_when_some_ranks_cannot_follow_the_plan():
    # Ranks 0 and 1 are below their plan's cap (they run dfc); rank 2 could follow its plan, but a plan rank that
    # waits for its plan input while holding the oldest microbatch's ready task would hang them all.
    shape = PipelineShape(3, 2, 3, microbatch_group_size=3)
    caps = [2, 2, 4]
    guarded = [make_policy("adaptive", shape, rank, caps[rank]) for rank in range(3)]
    assert [p.follows_plan for p in guarded] == [False, False, True] and guarded[2].keeps_oldest_moving
    check_policy(shape, "adaptive", random.Random(0), caps)
    unguarded = [AdaptivePolicy(shape, rank, caps[rank], megatron_order(shape, rank),
                                make_policy("dfc", shape, rank, caps[rank]), keeps_oldest_moving=False)
                 for rank in range(3)]
    with pytest.raises(Stall):
        run_adversarially(shape, unguarded, random.Random(0))
