"""Causality check on valid traces (no violations) and on doctored ones (each violation found, nothing else)."""

from __future__ import annotations

import pytest

from megatron_app.trace import read_trace_dir
from megatron_app.trace.causality import check_causality
from test_trace_synthetic import plan_greedy, write_plan


def move(event, new_start):
    duration = event.end - event.start
    event.start, event.end = new_start, new_start + duration


@pytest.mark.parametrize("P,V,m", [(1, 1, 2), (2, 1, 4), (4, 2, 4), (3, 3, 6)])
def test_valid_schedules_have_no_violation(tmp_path, P, V, m):
    plan = plan_greedy(P, V, m, duration=lambda r, k, c, i: 3.0 + (r * 7 + c * 3 + i) % 5, latency_us=0.5,
                       iterations=2)
    run = read_trace_dir(write_plan(tmp_path, plan))
    assert check_causality(run, [0, 1]) == []


def test_forward_starting_before_its_input_left_the_previous_stage(tmp_path):
    plan = plan_greedy(4, 1, 4, forward_us=10, backward_us=20)
    producer = plan.task(0, 1, "forward", 0, 2)
    consumer = plan.task(0, 2, "forward", 0, 2)
    move(consumer, producer.end - 4.0)
    run = read_trace_dir(write_plan(tmp_path, plan))
    (violation,) = check_causality(run, [0])
    assert (violation.global_rank, violation.pp_rank, violation.task) == (2, 2, "forward 0-2")
    assert (violation.producer_pp_rank, violation.producer_task) == (1, "forward 0-2")
    assert violation.producer_end_us == producer.end
    assert "started 4.0 us before its input was ready" in violation.describe()
    # clock slack absorbs it
    assert check_causality(run, [0], tolerance_us=5.0) == []


def test_wrap_around_between_chunks_is_checked(tmp_path):
    """Rank 0's chunk 1 consumes the last rank's chunk 0 output."""
    plan = plan_greedy(2, 2, 2)
    producer = plan.task(0, 1, "forward", 0, 1)
    consumer = plan.task(0, 0, "forward", 1, 1)
    move(consumer, producer.start)
    (violation,) = check_causality(read_trace_dir(write_plan(tmp_path, plan)), [0])
    assert (violation.pp_rank, violation.task, violation.producer_pp_rank, violation.producer_task) == \
        (0, "forward 1-1", 1, "forward 0-1")


def test_backward_starting_before_the_next_stage_backward_ended(tmp_path):
    plan = plan_greedy(3, 1, 3)
    producer = plan.task(0, 2, "backward", 0, 0)
    consumer = plan.task(0, 1, "backward", 0, 0)
    move(consumer, producer.start + 1.0)
    violations = check_causality(read_trace_dir(write_plan(tmp_path, plan)), [0])
    assert [(v.pp_rank, v.task, v.producer_pp_rank, v.producer_task) for v in violations] == \
        [(1, "backward 0-0", 2, "backward 0-0")]


def test_backward_before_its_own_forward(tmp_path):
    plan = plan_greedy(1, 1, 2)
    forward = plan.task(0, 0, "forward", 0, 1)
    backward = plan.task(0, 0, "backward", 0, 1)
    move(backward, forward.start)
    violations = check_causality(read_trace_dir(write_plan(tmp_path, plan)), [0])
    assert [(v.task, v.producer_task) for v in violations] == [("backward 0-1", "forward 0-1")]


def test_missing_producer_is_reported(tmp_path):
    plan = plan_greedy(2, 1, 2)
    plan.events.remove(plan.task(0, 0, "forward", 0, 1))
    violations = check_causality(read_trace_dir(write_plan(tmp_path, plan)), [0])
    # rank 1's forward lost its input, and rank 0's own backward lost its activations
    assert sorted((v.pp_rank, v.task, v.producer_end_us) for v in violations) == \
        [(0, "backward 0-1", None), (1, "forward 0-1", None)]
    assert "is missing" in violations[0].describe()
