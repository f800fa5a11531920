"""Run-time reordering on and off: `planned` against `planned-fixed` (the same policy with deviates=False).

planned-fixed runs its plan's order exactly (W's of a split backward aside, which still fill waits) under any timing
and any delivery order; planned leaves its plan only when inputs arrive out of plan order. With in-order links (the
simulator's, the transport's) a late planned backward never has another ready backward behind it, so under slow
ranks, jitter, stragglers and slow links the two run the same orders: the frontier tools/bench_straggler.py reports.
"""

import random

import pytest

from megatron_app.schedule import Kind, PipelineShape, Task, drive, make_policy, megatron_order
from megatron_app.schedule.megatron_order import without_fill
from megatron_app.schedule.planned import PlannedPolicy
from megatron_app.sim.costs import ComputeCosts, ComputePerturbations
from megatron_app.sim.lengths import MicrobatchLengths
from megatron_app.sim.network import LinkCosts, SlowLink
from megatron_app.sim.simulator import SimConfig, simulate
from test_schedule_adaptive import late_backward_state
from test_schedule_properties import run_adversarially

F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT
SHAPES = [PipelineShape(2, 2, 8), PipelineShape(4, 2, 8), PipelineShape(4, 1, 8), PipelineShape(3, 3, 9)]


def policies(name, shape):
    return [make_policy(name, shape, rank) for rank in range(shape.num_stages)]


def test_planned_fixed_is_planned_with_the_deviation_step_off():
    shape = PipelineShape(4, 2, 8)
    fixed, planned = make_policy("planned-fixed", shape, 1), make_policy("planned", shape, 1)
    assert isinstance(fixed, PlannedPolicy) and fixed.name == "planned-fixed" and not fixed.deviates
    assert planned.deviates and planned.name == "planned"
    assert (fixed.memory_cap, fixed.plan, fixed.reorders) == (planned.memory_cap, planned.plan, planned.reorders)
    assert make_policy("planned-fixed", shape, 1, memory_factor=1.5).memory_factor == 1.5


def test_a_late_plan_backward_is_waited_for_not_overtaken():
    shape, state = late_backward_state()    # plan's next B(1, 0) is late, B(1, 1) is ready
    planned = PlannedPolicy(shape, 0, patience=1)
    fixed = PlannedPolicy(shape, 0, patience=1, deviates=False)
    assert [planned.next(state) for _ in range(2)] == [None, Task(B, 1, 1)] and planned.deviations == 1
    assert [fixed.next(state) for _ in range(5)] == [None] * 5 and fixed.deviations == 0
    state.mark_arrived(Task(B, 1, 0))
    assert fixed.next(state) == Task(B, 1, 0)


@pytest.mark.parametrize("shape", SHAPES)
def test_with_uniform_costs_planned_fixed_runs_megatrons_order_exactly(shape):
    result = drive(shape, "planned-fixed", task_duration=lambda rank, task: 1.0 if task.kind is F else 2.0)
    for rank in range(shape.num_stages):
        assert tuple(result[rank]) == megatron_order(shape, rank)


@pytest.mark.parametrize("shape", SHAPES + [PipelineShape(4, 2, 8, split_backward=True)])
def test_out_of_order_deliveries_make_planned_deviate_and_planned_fixed_keep_its_plan(shape):
    """The property tests' driver delivers messages in random order: planned then finds ready backwards behind a
    late one and runs them first; planned-fixed runs every rank's plan order whatever the order of arrivals."""
    deviations = 0
    for seed in range(6):
        fixed = policies("planned-fixed", shape)
        orders, _ = run_adversarially(shape, fixed, random.Random(seed))
        for rank, order in enumerate(orders):
            assert without_fill(order) == fixed[rank].plan == without_fill(megatron_order(shape, rank))
        assert sum(policy.deviations for policy in fixed) == 0
        planned = policies("planned", shape)
        orders, _ = run_adversarially(shape, planned, random.Random(seed))
        deviations += sum(policy.deviations for policy in planned)
        if sum(policy.deviations for policy in planned):
            assert any(without_fill(order) != policy.plan for order, policy in zip(orders, planned))
    assert deviations > 0


def test_split_backward_w_tasks_still_fill_the_waits_of_planned_fixed():
    shape = PipelineShape(2, 2, 8, split_backward=True)
    slow_rank_0 = lambda rank, task: (3.0 if rank == 0 else 1.0) * (1.0 if task.kind is F else 0.5)
    result = drive(shape, "planned-fixed", task_duration=slow_rank_0)
    for rank in range(2):
        assert without_fill(result[rank]) == without_fill(megatron_order(shape, rank))
    last_planned = max(i for i, task in enumerate(result[1]) if task.kind is not W)
    assert any(task.kind is W for task in result[1][:last_planned]), "rank 1 waited without filling with a W"


def test_with_lengths_planned_fixed_runs_the_iterations_plan_under_a_slow_rank():
    shape = PipelineShape(4, 2, 8)
    fixed = policies("planned-fixed", shape)
    config = SimConfig(shape, ComputeCosts.uniform(shape, 10e3, 20e3), iterations=1, seed=3,
                       lengths=MicrobatchLengths(sigma=1.0), perturbations=ComputePerturbations(slow_rank=2,
                                                                                               slow_factor=2.0))
    outcome = simulate(config, fixed).iterations[0]
    assert fixed[0].current_plan.start_order != tuple(range(8)), "the plan should reorder these lengths"
    for rank in range(4):
        assert tuple(outcome.orders[rank]) == fixed[rank].plan


MESSAGE_LINK = dict(latency_us=20.0, gbps=100.0, tensor_bytes=16 * 2**20)
SCENARIOS = {   # shape -> (perturbations, links)
    "slow rank 0 x2": lambda shape: (ComputePerturbations(slow_rank=0, slow_factor=2.0), LinkCosts()),
    "slow last rank x2": lambda shape: (ComputePerturbations(slow_rank=shape.num_stages - 1, slow_factor=2.0),
                                        LinkCosts()),
    "jitter +-50%": lambda shape: (ComputePerturbations(jitter=0.5), LinkCosts()),
    "stragglers 30% x4": lambda shape: (ComputePerturbations(straggler_prob=0.3, straggler_factor=4.0), LinkCosts()),
    "slow link 0-1": lambda shape: (ComputePerturbations(),
                                    LinkCosts(**MESSAGE_LINK, slow_links=(SlowLink.parse("0-1:0-300:10"),))),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("shape", [PipelineShape(2, 2, 8), PipelineShape(4, 2, 8)])
def test_with_in_order_links_run_time_reordering_finds_nothing_to_reorder(scenario, shape):
    """The frontier (adaptive.py's "When it fires"): every rank's plan takes its backward inputs in the order its
    one gradient source sends them, so a late planned backward has no ready backward behind it, and a ready backward
    behind a late planned forward may not jump it (shorter chain). The simulator's links are in order: planned
    deviates nowhere and runs planned-fixed's orders, with and without lengths."""
    perturbations, links = SCENARIOS[scenario](shape)
    for lengths in (None, MicrobatchLengths(sigma=1.0)):
        for seed in range(2):
            config = SimConfig(shape, ComputeCosts.uniform(shape, 10e3, 20e3), links=links,
                               perturbations=perturbations, iterations=2, seed=seed, lengths=lengths)
            planned, fixed = policies("planned", shape), policies("planned-fixed", shape)
            ran = simulate(config, planned), simulate(config, fixed)
            assert sum(policy.deviations for policy in planned) == 0
            assert [it.orders for it in ran[0].iterations] == [it.orders for it in ran[1].iterations]
            assert ran[0].makespan_us == ran[1].makespan_us
