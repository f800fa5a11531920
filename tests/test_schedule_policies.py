"""Policies: options and errors, greedy preferences, static waiting, the deadlock-free admission rule, drive()."""

import pytest

from megatron_app.schedule import (GreedyPolicy, Kind, PipelineShape, RankState, ScheduleConfigError,
                                   ScheduleStallError, Task, drive, forward_fits, make_policy,
                                   megatron_interleaved_cap, minimum_memory_cap, policies_for)

F, B = Kind.FORWARD, Kind.BACKWARD


def run(state, task):
    state.mark_started(task)
    state.mark_done(task)


@pytest.mark.parametrize("args, message", [
    (("lifo", PipelineShape(2, 1, 4), 0, None), "unknown policy 'lifo'; choose one of dfc, bfc, 1f1b, interleaved"),
    (("1f1b", PipelineShape(2, 2, 4), 0, None), "policy '1f1b' needs num_chunks == 1, got 2"),
    (("dfc", PipelineShape(2, 3, 4), 0, 2), "memory_cap=2 cannot finish: a rank must hold at least 3"),
    (("bfc", PipelineShape(2, 1, 4), 0, 0), "memory_cap=0 cannot finish"),
    (("dfc", PipelineShape(2, 1, 4), 0, 1.5), "memory_cap must be an int, got 1.5"),
    (("interleaved", PipelineShape(4, 2, 8), 0, 10), "policy 'interleaved' holds up to 11 activations on rank 0"),
    (("dfc", PipelineShape(2, 1, 4), 2, None), "rank 2 is outside 0..1"),
])
def test_policy_option_errors(args, message):
    with pytest.raises(ScheduleConfigError) as info:
        make_policy(*args)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_default_caps_are_megatrons_and_smaller_caps_are_kept():
    shape = PipelineShape(4, 2, 8)
    for name in ("dfc", "bfc", "interleaved"):
        for rank in range(4):
            policy = make_policy(name, shape, rank)
            assert policy.name == name and policy.memory_cap == megatron_interleaved_cap(shape, rank)
    assert make_policy("dfc", shape, 0, memory_cap=2).memory_cap == 2 == minimum_memory_cap(shape)
    assert make_policy("interleaved", shape, 3, memory_cap=7).memory_cap == 7


def test_greedy_runs_any_ready_backward_before_forwards():
    shape = PipelineShape(1, 1, 3)
    state = RankState(shape, 0)
    for name in ("dfc", "bfc"):
        policy = make_policy(name, shape, 0)
        assert policy.next(state) == Task(F, 0, 0)
    run(state, Task(F, 0, 0))
    for name in ("dfc", "bfc"):
        assert make_policy(name, shape, 0, memory_cap=3).next(state) == Task(B, 0, 0)


def test_depth_first_continues_a_microbatch_breadth_first_widens_a_chunk():
    shape = PipelineShape(2, 2, 4)
    state = RankState(shape, 0)
    run(state, Task(F, 0, 0))
    run(state, Task(F, 0, 1))
    state.mark_arrived(Task(F, 1, 0))   # microbatch 0 came back around the ring
    assert make_policy("dfc", shape, 0).next(state) == Task(F, 1, 0)
    # bfc stays on chunk 0 within the microbatch group (size P = 2): microbatches 0 and 1 done, so chunk 1 next.
    assert make_policy("bfc", shape, 0).next(state) == Task(F, 1, 0)
    pure_breadth = PipelineShape(2, 2, 4, microbatch_group_size=4)
    state = RankState(pure_breadth, 0)
    run(state, Task(F, 0, 0))
    run(state, Task(F, 0, 1))
    state.mark_arrived(Task(F, 1, 0))
    assert make_policy("bfc", pure_breadth, 0).next(state) == Task(F, 0, 2)
    assert make_policy("dfc", pure_breadth, 0).next(state) == Task(F, 1, 0)


def test_backward_preferences_depth_versus_breadth():
    shape = PipelineShape(2, 2, 2)
    state = RankState(shape, 1)    # vs 1 (chunk 0) and vs 3 (chunk 1, last stage)
    for task in (Task(F, 0, 0), Task(F, 0, 1), Task(F, 1, 0)):
        state.mark_arrived(task)
        run(state, task)
    run(state, Task(B, 1, 0))
    state.mark_arrived(Task(F, 1, 1))
    run(state, Task(F, 1, 1))
    state.mark_arrived(Task(B, 0, 0))   # rank 0 ran B(chunk 1, mb 0) on the gradient sent above
    assert [t for t in state.ready() if t.kind is B] == [Task(B, 0, 0), Task(B, 1, 1)]
    assert make_policy("dfc", shape, 1).next(state) == Task(B, 0, 0)   # finish the oldest microbatch
    assert make_policy("bfc", shape, 1).next(state) == Task(B, 1, 1)   # earlier in the backward chain first


def test_static_order_waits_for_its_next_task():
    shape = PipelineShape(2, 1, 3)
    policy = make_policy("1f1b", shape, 1)
    state = RankState(shape, 1)
    assert policy.expected_next(state) == Task(F, 0, 0)
    state.mark_arrived(Task(F, 0, 1))            # a later microbatch is here, the order does not skip ahead
    assert policy.next(state) is None
    state.mark_arrived(Task(F, 0, 0))
    assert policy.next(state) == Task(F, 0, 0)
    assert make_policy("dfc", shape, 1).expected_next(state) is None
    assert policy.observe(Task(F, 0, 0), 0.1) is None


def test_admission_reserves_room_for_the_chunks_a_microbatch_still_needs():
    shape = PipelineShape(4, 2, 8)
    state = RankState(shape, 3)                  # last rank, Megatron cap 5
    cap = megatron_interleaved_cap(shape, 3)
    assert cap == 5
    for mb in range(4):
        state.mark_arrived(Task(F, 0, mb))
        assert forward_fits(state, Task(F, 0, mb), cap)
        run(state, Task(F, 0, mb))
    state.mark_arrived(Task(F, 0, 4))
    # "held < cap" would admit it (4 < 5) and leave no room for microbatch 0's chunk 1 forward.
    assert state.activations_held == 4 and not forward_fits(state, Task(F, 0, 4), cap)
    state.mark_arrived(Task(F, 1, 0))
    assert forward_fits(state, Task(F, 1, 0), cap)
    assert make_policy("bfc", shape, 3).next(state) == Task(F, 1, 0)


def test_admission_starts_microbatches_in_order():
    shape = PipelineShape(2, 1, 4)
    state = RankState(shape, 1)
    state.mark_arrived(Task(F, 0, 1))
    assert not forward_fits(state, Task(F, 0, 1), 2)       # microbatch 0 has not started here yet
    assert make_policy("dfc", shape, 1).next(state) is None
    assert forward_fits(RankState(PipelineShape(2, 1, 4, forward_only=True), 1), Task(F, 0, 1), 1)
    with pytest.raises(ScheduleConfigError, match="forward_fits is for forwards"):
        forward_fits(state, Task(B, 0, 0), 2)


class NaiveCapPolicy(GreedyPolicy):
    """The tempting rule the admission replaces: start a forward whenever held < cap."""

    def next(self, state):
        ready = sorted(state.ready(), key=self.priority)
        backwards = [t for t in ready if t.kind is B]
        if backwards:
            return backwards[0]
        return ready[0] if ready and state.activations_held < self.memory_cap else None


@pytest.mark.parametrize("name", ["dfc", "bfc"])
def test_naive_cap_deadlocks_where_admission_finishes(name):
    shape = PipelineShape(3, 3, 9)
    naive = [NaiveCapPolicy(shape, r, megatron_interleaved_cap(shape, r), name, make_policy(name, shape, r).priority)
             for r in range(3)]
    with pytest.raises(ScheduleStallError) as info:
        drive(shape, naive)
    report = str(info.value)
    assert "schedule stalled" in report and "rank 2: done" in report and "ready:" in report
    result = drive(shape, name)
    assert all(sorted(map(str, result[r])) == sorted(map(str, shape.tasks(r))) for r in range(3))


def test_drive_runs_every_policy_with_delays_and_durations():
    shape, split = PipelineShape(3, 2, 6), PipelineShape(3, 2, 6, split_backward=True)
    delays = lambda src, task, dst: 0.5 + 0.25 * ((task.microbatch + src) % 3)
    durations = lambda rank, task: 1.0 if task.kind is F else 2.0 + rank
    for each_shape in (shape, split):
        for name in policies_for(each_shape):
            result = drive(each_shape, name, arrival_delay=delays, task_duration=durations)
            assert sorted(result) == [0, 1, 2]
            for rank, tasks in result.items():
                assert len(tasks) == len(set(tasks)) == len(each_shape.tasks(rank))
    assert drive(PipelineShape(1, 1, 2), "1f1b")[0] == [Task(F, 0, 0), Task(B, 0, 0), Task(F, 0, 1),
                                                          Task(B, 0, 1)]


def test_drive_rejects_bad_arguments():
    shape = PipelineShape(2, 1, 2)
    with pytest.raises(ScheduleConfigError, match="need one policy per rank"):
        drive(shape, [make_policy("dfc", shape, 0)])
    with pytest.raises(ScheduleConfigError, match="arrival_delay returned -1"):
        drive(shape, "dfc", arrival_delay=lambda *_: -1)
