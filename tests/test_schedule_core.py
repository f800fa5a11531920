"""The one schedule core: one order builder, one peak function, one dependency graph and one plan evaluator that
know every task kind (F, B and W), used by plan search, PlanGraph, the reference driver and the simulator."""

import numpy as np
import pytest

from megatron_app.schedule import Kind, PipelineShape, Task, drive
from megatron_app.schedule.megatron_order import (megatron_order, megatron_slot_order, order_over, order_peak_size,
                                                  peak_activations_of_order, with_fill_after_sources,
                                                  without_fill)
from megatron_app.schedule.plan_graph import PlanGraph
from megatron_app.schedule.plan_search import Plan, plan_order, predicted_makespan
from megatron_app.schedule.task_table import TaskTable
from megatron_app.trace.palette import task_rgb


@pytest.mark.parametrize("P,V,m", [(2, 1, 4), (4, 2, 8), (4, 2, 12)])
def test_megatron_order_is_the_slot_order_over_data_order(P, V, m):
    for split in (False, True):
        shape = PipelineShape(P, V, m, split_backward=split)
        for rank in range(P):
            order = megatron_order(shape, rank)
            assert order == order_over(megatron_slot_order(shape, rank))
            skeleton = without_fill(order)
            assert order == (tuple(with_fill_after_sources(shape, skeleton)) if split else skeleton)


def test_extra_warmup_moves_forwards_before_the_first_backward():
    shape = PipelineShape(4, 2, 8)
    for rank in range(4):
        base = megatron_slot_order(shape, rank, 0)
        deeper = megatron_slot_order(shape, rank, 2)
        first_backward = [k for k, step in enumerate(base) if step[0] is Kind.BACKWARD][0]
        assert [k for k, step in enumerate(deeper) if step[0] is Kind.BACKWARD][0] == first_backward + 2
        assert sorted(base) == sorted(deeper)


def test_plan_order_names_microbatches_by_the_plans_start_order():
    shape = PipelineShape(2, 2, 4)
    plan = Plan((2, 0, 3, 1), 1)
    slots = megatron_slot_order(shape, 1, 1, with_weights=False)
    assert plan_order(shape, 1, plan) == tuple(Task(kind, chunk, plan.start_order[slot]) for kind, chunk, slot in slots)


def test_one_peak_function_counts_sizes_or_activations_with_the_right_release():
    shape = PipelineShape(2, 1, 3, split_backward=True)
    order = megatron_order(shape, 0)
    sizes = [10, 20, 30]
    assert peak_activations_of_order(shape, order) == order_peak_size(order, None) == 2
    # With W's in the order an activation lives until its W; without, until its B.
    assert order_peak_size(order, sizes) == 50
    forward_only = PipelineShape(2, 1, 3, forward_only=True)
    assert peak_activations_of_order(forward_only, megatron_order(forward_only, 0)) == 1


def test_dependency_rules_cover_every_kind():
    shape = PipelineShape(2, 2, 2, split_backward=True)
    assert shape.local_source(Task(Kind.FORWARD, 0, 1)) is None
    assert shape.local_source(Task(Kind.BACKWARD, 1, 1)) == Task(Kind.FORWARD, 1, 1)
    assert shape.local_source(Task(Kind.WEIGHT, 1, 1)) == Task(Kind.BACKWARD, 1, 1)
    table = TaskTable(shape)
    for rank in range(2):
        for kind in shape.kinds:
            for chunk in range(2):
                task = Task(kind, chunk, 1)
                assert table.consumer(rank, task) == shape.output_target(rank, task)


def test_evaluator_times_weight_tasks_and_refuses_an_order_that_waits_on_itself():
    shape = PipelineShape(2, 1, 2, split_backward=True)
    orders = [megatron_order(shape, rank) for rank in range(2)]
    durations = [[[1.0, 1.0]], [[2.0, 2.0]], [[0.5, 0.5]]]
    finish = {}
    drive(shape, "interleaved", task_duration=lambda rank, task: durations[task.kind.index][task.chunk][task.microbatch],
          finish_times=finish)
    assert predicted_makespan(shape, orders, durations) == pytest.approx(max(finish.values()))
    # A W before its own B on the same rank can never run.
    early_weight = list(orders[1])
    w = next(k for k, task in enumerate(early_weight) if task.kind is Kind.WEIGHT)
    b = next(k for k, task in enumerate(early_weight) if task == Task(Kind.BACKWARD, 0, early_weight[w].microbatch))
    early_weight[b], early_weight[w] = early_weight[w], early_weight[b]
    assert predicted_makespan(shape, [orders[0], early_weight], durations) == float("inf")


def test_plan_graph_peaks_release_at_the_weight_task():
    shape = PipelineShape(2, 1, 2, split_backward=True)
    slot_orders = [megatron_slot_order(shape, rank) for rank in range(2)]
    graph = PlanGraph(shape, (0, 0), slot_orders)
    table = np.ones((3, 2))
    sizes = np.array([3.0, 5.0])
    _, peaks = graph.evaluate(np.array([[0, 1], [1, 0]]), table, sizes, [np.inf, np.inf])
    expected = [[order_peak_size(order_over(o, start), sizes) for o in slot_orders] for start in ([0, 1], [1, 0])]
    assert peaks.tolist() == expected


def test_palette_colours_a_kind_it_does_not_know():
    assert len(task_rgb("recompute", 0, 2)) == 6
