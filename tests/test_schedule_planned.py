"""Variable-length microbatches in the schedule package: size-aware admission (deadlock freedom with random sizes and
start orders, under adversarial message timing), the learnt f(tokens) cost model, the plan search and the
`planned` policy (same memory bound as Megatron's order, and it adopts one plan on every rank)."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_app.schedule import Kind, PipelineShape, Policy, RankState, ScheduleConfigError, Task, make_policy
from megatron_app.schedule.admission import admission_need, forward_fits, minimum_size_cap
from megatron_app.schedule.length_costs import LengthCostModel
from megatron_app.schedule.megatron_order import megatron_order
from megatron_app.schedule.plan_search import (MAX_EXTRA_WARMUP, Plan, PlanSearch, _graph, order_peak_size,
                                              plan_order, predicted_makespan)
from megatron_app.schedule.iteration_plan import PipelineSpec, plan_told_microbatches
from megatron_app.schedule.planned import megatron_peak_sizes
from test_schedule_properties import consumer, producers

F, B = Kind.FORWARD, Kind.BACKWARD


class SizedGreedy(Policy):
    """Backward first; forwards by start position then deepest chunk, each admitted by size-aware forward_fits."""

    name = "sized-greedy"

    def __init__(self, shape, rank, cap, sizes, start_order):
        super().__init__(shape, rank, cap)
        self.sizes, self.start_order = sizes, start_order
        self.position = {mb: i for i, mb in enumerate(start_order)}

    def next(self, state):
        ready = state.ready()
        backwards = [t for t in ready if t.kind is B]
        if backwards:
            return min(backwards, key=lambda t: (self.position[t.microbatch], -t.chunk))
        for task in sorted(ready, key=lambda t: (self.position[t.microbatch], -t.chunk)):
            if forward_fits(state, task, self.memory_cap, self.sizes, self.start_order):
                return task
        return None


def run_adversarially(shape, policies, sizes, rng):
    """Random interleaving of rank steps and message deliveries; returns per-rank peak held sizes. Asserts
    dependencies (by virtual-stage arithmetic) and completion."""
    P = shape.num_stages
    states = [RankState(shape, rank, sizes) for rank in range(P)]
    runnable, in_flight, finished = list(range(P)), [], set()
    while runnable or in_flight:
        choice = rng.randrange(len(runnable) + len(in_flight))
        if choice >= len(runnable):
            rank, task = in_flight.pop(choice - len(runnable))
            states[rank].mark_arrived(task)
            if rank not in runnable:
                runnable.append(rank)
            continue
        rank = runnable[choice]
        task = policies[rank].next(states[rank])
        if task is None:
            runnable.remove(rank)
            continue
        for need in producers(shape, rank, task):
            assert need in finished, f"rank {rank} started {task} before {need}"
        states[rank].mark_started(task)
        states[rank].mark_done(task)
        finished.add((rank, task.kind, task.chunk, task.microbatch))
        target = consumer(shape, rank, task)
        if target is not None:
            in_flight.append((target[0], Task(target[1], target[2], task.microbatch)))
    assert all(state.finished for state in states), "stalled:\n" + "\n".join(s.describe() for s in states)
    return [state.peak_size for state in states]


@st.composite
def sized_pipelines(draw):
    P = draw(st.integers(2, 4))
    V = draw(st.integers(1, 3))
    m = draw(st.integers(P, 2 * P + 2)) if V == 1 else P * draw(st.integers(1, 2))
    shape = PipelineShape(P, V, m)
    sizes = draw(st.lists(st.integers(1, 9), min_size=m, max_size=m))
    start_order = draw(st.permutations(list(range(m))))
    slack = draw(st.integers(0, sum(sizes)))
    return shape, sizes, tuple(start_order), draw(st.integers(0, 2 ** 32 - 1)), slack


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sized_pipelines())
def test_size_aware_admission_never_deadlocks_and_holds_its_cap(case):
    shape, sizes, start_order, seed, slack = case
    cap = minimum_size_cap(shape, sizes) + slack
    policies = [SizedGreedy(shape, rank, cap, sizes, start_order) for rank in range(shape.num_stages)]
    peaks = run_adversarially(shape, policies, sizes, random.Random(seed))
    assert all(peak <= cap for peak in peaks)


def test_admission_need_is_the_smallest_cap_that_admits():
    shape = PipelineShape(2, 2, 4)
    sizes = [3, 1, 4, 1]
    state = RankState(shape, 0, sizes)
    task = Task(F, 0, 2)
    start_order = (2, 0, 1, 3)
    need = admission_need(state, task, sizes, start_order)
    assert need == 8                      # microbatch 2: its own two chunks of 4 tokens
    assert forward_fits(state, task, need, sizes, start_order)
    assert not forward_fits(state, task, need - 1, sizes, start_order)
    assert not forward_fits(state, Task(F, 0, 0), 100, sizes, start_order)   # 2 starts first in this order


# ---- learnt costs ------------------------------------------------------------------------------------------------
def test_length_cost_model_recovers_a_quadratic_and_starts_proportional():
    model = LengthCostModel()
    assert model.seconds(B, 0, 100) == 2 * model.seconds(F, 0, 100)     # prior: backward twice forward
    true = lambda length: 0.002 + 3e-5 * length + 2e-7 * length ** 2
    model.observe(F, 1, 100, true(100))
    assert model.seconds(F, 1, 200) == pytest.approx(2 * true(100))    # one length seen: proportional
    for length in (50, 300, 700, 20, 512):
        model.observe(F, 1, length, true(length))
    for length in (10, 256, 800):
        assert model.seconds(F, 1, length) == pytest.approx(true(length), rel=1e-6)
    assert model.seconds(F, 0, 256) == pytest.approx(true(256), rel=1e-6)   # unseen chunk: same kind's fit
    with pytest.raises(ScheduleConfigError):
        model.observe(F, 0, 0, 1.0)


def test_length_cost_model_learns_each_pipeline_rank_and_falls_back_to_their_mean():
    model = LengthCostModel()
    own = lambda length, rank: (1.0 + 0.5 * rank) * (0.001 + 2e-5 * length + 1e-7 * length ** 2)
    for rank in (0, 1):
        for length in (100, 400, 900, 1600):
            model.observe(F, 1, length, own(length, rank), rank=rank)
    assert model.ranks_seen() == (0, 1)
    assert model.seconds(F, 1, 700, rank=1) == pytest.approx(own(700, 1), rel=1e-6)
    assert model.seconds(F, 1, 700, rank=0) == pytest.approx(own(700, 0), rel=1e-6)
    mean = (own(700, 0) + own(700, 1)) / 2
    assert model.seconds(F, 1, 700, rank=3) == pytest.approx(mean, rel=1e-6)    # an unseen rank: the ranks' mean
    assert model.seconds(F, 1, 700) == pytest.approx(mean, rel=1e-6)
    table = model.duration_table((F, B), 2, [700], [700 ** 2], num_stages=2)
    assert table.shape == (8, 1)                                   # rows (kind * P + rank) * V + chunk
    assert table[1 * 2 + 1, 0] == pytest.approx(own(700, 1), rel=1e-6)
    assert table[3 * 2 + 1, 0] == pytest.approx(2 * mean, rel=1e-6)   # no backward seen: 2 x the forwards' mean


def test_length_cost_fit_keeps_non_negative_terms_and_follows_a_machine_that_slows():
    # Narrow sizes with noise make an unconstrained fit put a negative term against the square: it then
    # extrapolates to a much larger microbatch far off the truth. The kept fit never has a negative term.
    true = lambda tokens: 0.004 + 1e-5 * tokens + 4e-9 * tokens ** 2
    model = LengthCostModel()
    sizes = np.array([900.0, 1000, 1100, 1200, 1300, 1400])
    measured = true(sizes) * np.array([1.08, 1.06, 0.96, 0.92, 0.96, 1.0])
    for tokens, seconds in zip(sizes, measured):
        model.observe(F, 0, tokens, seconds)
    a, b, c = model._fits[(F, 0, 0)].affine()
    assert min(a, b, c) >= 0.0
    assert model.seconds(F, 0, 4000) == pytest.approx(true(4000), rel=0.15)
    features = np.stack([np.ones_like(sizes), sizes, sizes ** 2], axis=1)
    unconstrained, *_ = np.linalg.lstsq(features, measured, rcond=None)
    assert min(unconstrained) < 0 and abs(unconstrained @ [1, 4000, 4000 ** 2] / true(4000) - 1) > 0.5
    # a competing process makes everything 1.5x slower: the window forgets the old speed
    window = LengthCostModel(window=64)
    for round_ in range(3):
        for tokens in (500, 1000, 2000, 3000):
            window.observe(B, 0, tokens, 2 * true(tokens), rank=1)
    for round_ in range(16):
        for tokens in (500, 1000, 2000, 3000):
            window.observe(B, 0, tokens, 3 * true(tokens), rank=1)
    assert window.seconds(B, 0, 2500, rank=1) == pytest.approx(3 * true(2500), rel=1e-6)


def test_a_microbatch_larger_than_any_before_is_set_aside_while_the_others_determine_the_fit():
    """Growth samples: the first microbatch above every earlier one's size pays the allocator's growth and first
    touches (a CPU GPT's first 2,154-token forward took 28% over its later like). As the largest samples they set
    the fit's slope: fitted, every later prediction runs long; set aside, the steady samples give the truth."""
    true = lambda tokens: 0.002 + 4e-5 * tokens + 1e-9 * tokens ** 2
    sizes = [300, 500, 400, 2200, 350, 700, 450, 600, 380, 650, 520, 2100, 480, 710]
    worst = []
    for model in (LengthCostModel(), LengthCostModel(set_aside_growth=False)):
        largest = 0
        for tokens in sizes:
            slow = 1.3 if tokens > largest and largest else 1.0     # a new largest microbatch grows the allocator
            largest = max(largest, tokens)
            model.observe(F, 0, tokens, slow * true(tokens))
        worst.append(max(abs(model.seconds(F, 0, t) / true(t) - 1) for t in (300, 600, 1000, 1500, 2000, 2150)))
    aside, fitted = worst
    assert aside < 1e-6
    assert fitted > 0.1        # 14% long at 300 tokens, 16% at 2,150
    # the fit uses every recent sample while the steady ones alone cannot determine it (sizes only ever grew)
    ramp = LengthCostModel()
    for tokens in (100, 200, 300, 400):
        ramp.observe(F, 0, tokens, 1.3 * true(tokens))
    assert ramp.seconds(F, 0, 250) == pytest.approx(1.3 * true(250), rel=1e-6)


def test_unreported_samples_reach_another_model_once():
    here, planner = LengthCostModel(), LengthCostModel()
    for length in (100, 300, 800):
        here.observe(B, 1, length, 1e-5 * length, length ** 2 / 2, rank=3)
    samples = here.take_unreported()
    assert len(samples) == 3 and here.take_unreported() == []
    planner.observe_reported(samples)
    assert planner.samples(B, 1, rank=3) == 3 and planner.take_unreported() == []
    assert planner.seconds(B, 1, 500, 500 ** 2 / 2, rank=3) == pytest.approx(here.seconds(B, 1, 500, 500 ** 2 / 2,
                                                                                         rank=3))


def test_per_rank_durations_evaluate_like_per_chunk_ones_and_show_a_costlier_stage():
    shape = PipelineShape(4, 2, 8)
    lengths = _lognormal_lengths(5, 8)
    per_chunk = np.array([[0.7 * L + 0.3 * L * L / 256 for L in lengths]] * 2 +
                         [[1.4 * L + 0.6 * L * L / 256 for L in lengths]] * 2)      # (F, B) x V rows
    per_rank = np.repeat(per_chunk.reshape(2, 1, 2, 8), 4, axis=1).reshape(16, 8)    # (F, B) x P x V rows
    orders = np.array([list(range(8)), list(reversed(range(8)))])
    caps = [float("inf")] * 4
    same, _ = _graph(shape, (0,) * 4).evaluate(orders, per_chunk, np.array(lengths, float), caps)
    alike, _ = _graph(shape, (0,) * 4).evaluate(orders, per_rank, np.array(lengths, float), caps)
    assert list(alike) == pytest.approx(list(same))
    slower = per_rank.reshape(2, 4, 2, 8).copy()
    slower[:, 3, 1] *= 1.5                    # the last stage (rank 3, chunk 1) holds the loss head
    costlier, _ = _graph(shape, (0,) * 4).evaluate(orders, slower.reshape(16, 8), np.array(lengths, float), caps)
    assert (costlier > same + 1e-9).all()
    timeline = _graph(shape, (0,) * 4).timeline(3, tuple(range(8)), slower.reshape(16, 8))
    last_forward = [t for t in timeline if t[0] == F.index and t[1] == 1]
    assert last_forward[0][4] == pytest.approx(slower[0, 3, 1, last_forward[0][2]])


# ---- plans -----------------------------------------------------------------------------------------------------
def _durations(shape, lengths):
    cost = [0.7 * L + 0.3 * L * L / 256 for L in lengths]
    return [[[c for c in cost] for _ in range(shape.num_chunks)], [[2 * c for c in cost] for _ in range(shape.num_chunks)]]


def test_plan_orders_are_megatrons_over_the_start_order():
    shape = PipelineShape(4, 2, 8)
    identity = Plan(tuple(range(8)))
    for rank in range(4):
        assert plan_order(shape, rank, identity) == megatron_order(shape, rank)
    reversed_plan = Plan(tuple(reversed(range(8))))
    mapped = tuple(Task(t.kind, t.chunk, 7 - t.microbatch) for t in megatron_order(shape, 0))
    assert plan_order(shape, 0, reversed_plan) == mapped


def test_plan_search_is_deterministic_within_caps_and_not_worse_than_data_order():
    shape = PipelineShape(4, 2, 16)
    lengths = [random.Random(3).randint(8, 800) for _ in range(16)]
    lengths = [int(v) for v in random.Random(5).sample(range(8, 900), 16)]
    durations = _durations(shape, lengths)
    caps = megatron_peak_sizes(shape, lengths)
    first = PlanSearch(shape, evaluations=30).choose(lengths, caps, durations)
    again = PlanSearch(shape, evaluations=30).choose(lengths, caps, durations)
    assert first == again
    assert first.predicted_makespan <= first.predicted_data_order_makespan
    for rank in range(4):
        order = plan_order(shape, rank, first.plan)
        assert order_peak_size(order, lengths) <= caps[rank] + 1e-9
    orders = [plan_order(shape, rank, first.plan) for rank in range(4)]
    assert predicted_makespan(shape, orders, durations) == pytest.approx(first.predicted_makespan)


def test_predicted_makespan_reports_a_deadlock_as_infinite():
    shape = PipelineShape(2, 1, 2)
    good = [megatron_order(shape, r) for r in range(2)]
    bad = [good[0], tuple(reversed(good[1]))]    # rank 1 would start with a backward whose forward comes later
    durations = [[[1.0, 1.0]], [[2.0, 2.0]]]
    assert predicted_makespan(shape, good, durations) == 9.0      # (m + P - 1) * (f + b)
    assert predicted_makespan(shape, bad, durations) == float("inf")


@pytest.mark.parametrize("factor", [1.0, 1.25])
def test_planned_policy_keeps_its_token_cap_under_adversarial_timing(factor):
    for seed in range(4):
        rng = random.Random(seed)
        shape = PipelineShape(4, 2, 8)
        lengths = [rng.randint(4, 600) for _ in range(8)]
        policies = [make_policy("planned", shape, rank, memory_factor=factor) for rank in range(4)]
        for rank in range(4):     # learn something first so the plan is not the prior's
            for mb in range(8):
                policies[rank].lengths = tuple(lengths)
                policies[rank].observe(Task(F, 0, mb), 0.001 * lengths[mb] ** 1.5)
        planner = policies[0]
        assert planner.orders_told_lengths
        plan = plan_told_microbatches(lengths, PipelineSpec.of_shape(shape, factor), planner.costs).replica(0).plan
        for policy in policies:
            policy.use_plan(lengths, plan)
        peaks = run_adversarially(shape, policies, lengths, rng)
        limits = megatron_peak_sizes(shape, lengths)
        assert all(peak <= factor * limit + 1e-9 for peak, limit in zip(peaks, limits))


def test_planned_without_lengths_is_megatrons_order():
    shape = PipelineShape(4, 2, 8)
    policy = make_policy("planned", shape, 1)
    policy.use_plan(None, None)     # no lengths: nothing to plan (data order)
    assert policy.current_plan == Plan(tuple(range(8)))
    assert policy.plan == megatron_order(shape, 1)
    assert policy.expected_next(RankState(shape, 1)) == megatron_order(shape, 1)[0]


def test_planned_under_an_explicit_count_cap_keeps_data_order():
    shape = PipelineShape(4, 2, 8)
    policy = make_policy("planned", shape, 0, memory_cap=6)
    assert not policy.orders_told_lengths       # the runtime and the simulator then plan nothing: data order
    assert make_policy("planned", PipelineShape(4, 2, 8, forward_only=True), 0).orders_told_lengths is False
    assert make_policy("planned", shape, 0).orders_told_lengths
    assert not make_policy("adaptive", shape, 0).orders_told_lengths


def test_planned_rejects_bad_options():
    shape = PipelineShape(4, 2, 8)
    with pytest.raises(ScheduleConfigError, match="memory factor"):
        make_policy("planned", shape, 0, memory_factor=0.9)
    with pytest.raises(ScheduleConfigError, match="memory_factor applies"):
        make_policy("dfc", shape, 0, memory_factor=1.1)
    policy = make_policy("planned", shape, 0)
    with pytest.raises(ScheduleConfigError, match="positive microbatch lengths"):
        policy.use_plan([1, 2, 3], None)
    with pytest.raises(ScheduleConfigError, match="once each"):
        policy.use_plan(None, Plan((0, 0, 1, 2, 3, 4, 5, 6)))


# ---- the batched evaluator and the annealing search ----------------------------------------------------------
def _lognormal_lengths(seed, m, sigma=1.0):
    rng = random.Random(seed)
    return [max(4, int(96 * rng.lognormvariate(0, sigma))) for _ in range(m)]



@pytest.mark.parametrize("shape", [PipelineShape(4, 2, 8), PipelineShape(3, 1, 7), PipelineShape(2, 3, 4),
                                   PipelineShape(1, 1, 3)])
def test_batched_evaluation_equals_the_list_evaluation(shape):
    rng = random.Random(11)
    P, m = shape.num_stages, shape.num_microbatches
    lengths = _lognormal_lengths(2, m)
    durations = _durations(shape, lengths)
    table = np.array([durations[0][c] for c in range(shape.num_chunks)] +
                     [durations[1][c] for c in range(shape.num_chunks)])
    for transfer in (0.0, 3.5):
        for _ in range(6):
            extras = tuple(rng.randint(0, 3) for _ in range(P))
            orders = np.array([rng.sample(range(m), m) for _ in range(5)])
            makespans, peaks = _graph(shape, extras).evaluate(orders, table, np.array(lengths, float),
                                                              [float("inf")] * P, transfer)
            for row, makespan, peak in zip(orders, makespans, peaks):
                plan = Plan(tuple(int(x) for x in row), extras)
                per_rank = [plan_order(shape, rank, plan) for rank in range(P)]
                assert makespan == pytest.approx(predicted_makespan(shape, per_rank, durations, transfer))
                assert list(peak) == pytest.approx([order_peak_size(o, lengths) for o in per_rank])


def test_plans_whose_warmups_wait_on_each_other_are_rejected():
    shape = PipelineShape(2, 1, 4)
    # A later rank warming up deeper than its predecessor can wait for a forward that waits for its own backward:
    # the graph must flag exactly the combinations whose orders do not complete.
    for extras in [(a, b) for a in range(4) for b in range(4)]:
        graph = _graph(shape, extras)
        orders = [plan_order(shape, rank, Plan((0, 1, 2, 3), extras)) for rank in range(2)]
        complete = predicted_makespan(shape, orders, [[[1.0] * 4], [[2.0] * 4]]) < float("inf")
        assert graph.acyclic == complete


def test_plan_checks_its_warmups():
    shape = PipelineShape(4, 2, 8)
    Plan(tuple(range(8)), (0, 1, 2, 3)).check(shape)
    for bad in [(0, 1, 2), (0, -1, 0, 0), 1.5, (0, 0, 0, True)]:
        with pytest.raises(ScheduleConfigError, match="extra warm-up"):
            Plan(tuple(range(8)), bad).check(shape)
    order = plan_order(shape, 2, Plan(tuple(range(8)), (0, 0, 2, 0)))
    deeper = plan_order(shape, 2, Plan(tuple(range(8)), 2))
    assert order == deeper


def test_annealing_search_finds_more_than_pair_swaps_at_megatrons_memory():
    # Measured while building it, on these six lognormal(sigma 1) draws: the former search (150 one-at-a-time pair
    # swaps, one warm-up depth for all ranks) found 1.084x over data order on average (1.009x .. 1.165x); the
    # batched annealing over orders and per-rank warm-ups 1.133x (1.052x .. 1.225x).
    shape = PipelineShape(4, 2, 16)
    gains = []
    for seed in range(6):
        lengths = _lognormal_lengths(seed, 16)
        durations = _durations(shape, lengths)
        caps = megatron_peak_sizes(shape, lengths)
        choice = PlanSearch(shape).choose(lengths, caps, durations)
        assert all(need <= cap + 1e-9 for need, cap in zip(choice.admission_needs, caps))
        orders = [plan_order(shape, rank, choice.plan) for rank in range(4)]
        assert predicted_makespan(shape, orders, durations) == pytest.approx(choice.predicted_makespan)
        gains.append(choice.predicted_data_order_makespan / choice.predicted_makespan)
    assert min(gains) >= 1.0 and sum(gains) / len(gains) > 1.11, gains


def test_search_stops_when_told_and_tells_the_predicted_iteration():
    # The runtime's budget is a share of the iteration being planned: stop() gets the data order's prediction.
    shape = PipelineShape(4, 2, 8)
    lengths = _lognormal_lengths(4, 8)
    durations = _durations(shape, lengths)
    caps = megatron_peak_sizes(shape, lengths)
    asked = []
    choice = PlanSearch(shape).choose(lengths, caps, durations, stop=lambda predicted: asked.append(predicted) or True)
    assert asked == [choice.predicted_data_order_makespan]
    assert choice.evaluations == 4 * (MAX_EXTRA_WARMUP + 1)          # the seeded candidates only
    assert choice.predicted_makespan <= choice.predicted_data_order_makespan


def test_warm_up_samples_count_only_until_a_later_iteration_reports():
    """The first iteration's tasks (CUDA and cuBLAS initialisation: on an H200 its first task took 20x the later
    ones) predict until the second iteration's arrive, then drop out of the fit, also when reported by another rank."""
    from megatron_app.schedule.length_costs import LengthCostModel

    model = LengthCostModel()
    for tokens in (100, 200, 300, 400):
        model.observe(Kind.FORWARD, 0, tokens, tokens * 20e-6, warmup=True)
    assert model.seconds(Kind.FORWARD, 0, 200) == pytest.approx(4e-3)
    planner = LengthCostModel()
    planner.observe_reported(model.take_unreported())
    for tokens in (100, 200, 300):
        model.observe(Kind.FORWARD, 0, tokens, tokens * 1e-6)
    assert model.seconds(Kind.FORWARD, 0, 200) == pytest.approx(2e-4)
    planner.observe_reported(model.take_unreported())
    assert planner.seconds(Kind.FORWARD, 0, 200) == pytest.approx(2e-4)
    assert planner.samples(Kind.FORWARD, 0) == 7    # counted, not fitted
    planner.observe_reported([(Kind.FORWARD.index, 0, 0, 500.0, 250000.0, 5e-4)])   # the old six-field form
    assert planner.seconds(Kind.FORWARD, 0, 200) == pytest.approx(2e-4)


def test_the_planned_policy_marks_its_first_iteration_as_warm_up():
    shape = PipelineShape(2, 1, 4)
    policy = make_policy("planned", shape, 0)
    policy.use_plan([100, 200, 300, 400], None)
    for microbatch in range(4):
        policy.observe(Task(Kind.FORWARD, 0, microbatch), 1.0)
    assert all(entry[-1] for entry in policy.costs.take_unreported())
    policy.use_plan([100, 200, 300, 400], None)
    policy.observe(Task(Kind.FORWARD, 0, 0), 0.1)
    assert not any(entry[-1] for entry in policy.costs.take_unreported())


def test_a_second_microbatch_count_is_no_warm_up_when_the_costs_are_shared():
    """The policies of one rank's microbatch counts share the session's cost model (a `balanced` run changes its
    count between iterations): only the rank's first call warms up. Counted per policy, the first call of each new
    count was set aside as a warm-up (an H100 run planned iteration 3 from iteration 1's warm-up alone)."""
    from megatron_app.schedule.length_costs import LengthCostModel

    shared = LengthCostModel()
    sixteen, four = (make_policy("planned", PipelineShape(1, 1, count), 0) for count in (16, 4))
    sixteen.costs = four.costs = shared
    sixteen.use_plan([100] * 16, None)
    sixteen.observe(Task(Kind.FORWARD, 0, 0), 1.0)
    four.use_plan([400] * 4, None)
    four.observe(Task(Kind.FORWARD, 0, 0), 0.1)
    assert [entry[-1] for entry in shared.take_unreported()] == [True, False]
    # another rank's first call in the same model is its own warm-up
    other = make_policy("planned", PipelineShape(2, 1, 4), 1)
    other.costs = shared
    other.use_plan([100] * 4, None)
    other.observe(Task(Kind.FORWARD, 0, 0), 1.0)
    assert [entry[-1] for entry in shared.take_unreported()] == [True]
