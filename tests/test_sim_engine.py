"""Simulator semantics: the schedule package's own policies on the event loop, exact closed forms for Megatron's
static schedules, link costs, iterations, learning hooks, determinism and stall/protocol errors."""

import pytest

from megatron_app.schedule import (Kind, PipelineShape, Policy, ScheduleConfigError, ScheduleStallError,
                                   ScheduleStateError, make_policy, megatron_order)
from megatron_app.sim import (ComputeCosts, ComputePerturbations, LinkCosts, SimConfig, SlowLink, draw_durations,
                              simulate)

F_US, B_US = 10_000.0, 20_000.0


def config(shape, **kwargs):
    return SimConfig(shape, ComputeCosts.uniform(shape, F_US, B_US), **kwargs)


class Recording(Policy):
    """Wraps a policy and records what the simulator tells it."""

    def __init__(self, inner):
        super().__init__(inner.shape, inner.rank, inner.memory_cap)
        self.inner, self.name, self.observed = inner, inner.name, []

    def next(self, state):
        return self.inner.next(state)

    def observe(self, task, duration_s):
        self.observed.append((task, duration_s))
        self.inner.observe(task, duration_s)


# ---- closed forms ---------------------------------------------------------------------------------------------
def test_1f1b_makespan_is_m_plus_p_minus_1_times_f_plus_b():
    for P in range(1, 6):
        for m in range(1, 10):
            result = simulate(config(PipelineShape(P, 1, m)), "1f1b")
            assert result.makespan_us == (m + P - 1) * (F_US + B_US), (P, m)
            assert result.lower_bound_us == result.makespan_us


def test_interleaved_makespan_is_v_m_f_plus_b_plus_p_minus_1_f_plus_b():
    """Per-chunk f, b: the bubble is (P-1)(f+b), a fraction (P-1)/(V*m) of the V*m*(f+b) of work per rank."""
    checked = 0
    for P in range(2, 6):
        for V in range(2, 5):
            for m in range(P, 3 * P + 1):
                try:
                    shape = PipelineShape(P, V, m)
                except ScheduleConfigError:    # a group size Megatron rejects
                    continue
                result = simulate(config(shape), "interleaved")
                work = V * m * (F_US + B_US)
                assert result.makespan_us == work + (P - 1) * (F_US + B_US), (P, V, m)
                assert result.bubble_ratio == pytest.approx((P - 1) / (V * m + P - 1))
                checked += 1
    assert checked > 30


def test_uniform_costs_make_adaptive_and_interleaved_identical():
    shape = PipelineShape(4, 2, 8)
    interleaved, adaptive = simulate(config(shape), "interleaved"), simulate(config(shape), "adaptive")
    assert adaptive.makespan_us == interleaved.makespan_us == 570_000.0
    assert adaptive.iterations[0].orders == interleaved.iterations[0].orders == [
        list(megatron_order(shape, r)) for r in range(4)]
    assert adaptive.peak_activations == interleaved.peak_activations == [11, 9, 7, 5]


def test_single_rank_hands_over_locally():
    result = simulate(config(PipelineShape(1, 1, 5), links=LinkCosts(latency_us=1e6)), "dfc")
    assert result.makespan_us == 5 * (F_US + B_US) and result.bubble_ratio == 0.0


# ---- communication --------------------------------------------------------------------------------------------
def test_every_hop_pays_latency_plus_transmission():
    links = LinkCosts(latency_us=5.0, gbps=8.0, tensor_bytes=1000)          # 6 us per message
    result = simulate(config(PipelineShape(2, 1, 1), links=links), "1f1b")
    assert result.makespan_us == 2 * F_US + 2 * B_US + 2 * 6.0
    assert result.lower_bound_us == result.makespan_us


def test_slow_link_costs_only_inside_its_window():
    links = dict(latency_us=100.0, gbps=10.0, tensor_bytes=10**6)            # 900 us per message
    shape = PipelineShape(4, 2, 8)
    base = simulate(config(shape, links=LinkCosts(**links)), "interleaved").makespan_us
    late = LinkCosts(**links, slow_links=(SlowLink.parse("1-2:5000-6000:10"),))
    assert simulate(config(shape, links=late), "interleaved").makespan_us == base
    early = LinkCosts(**links, slow_links=(SlowLink.parse("1-2:0-300:10"),))
    assert simulate(config(shape, links=early), "interleaved").makespan_us > base + 8000


# ---- perturbations, determinism, pairing ------------------------------------------------------------------------
def test_runs_are_deterministic_and_policies_meet_the_same_durations():
    shape = PipelineShape(4, 2, 8)
    noisy = config(shape, perturbations=ComputePerturbations(jitter=0.3, straggler_prob=0.1, straggler_factor=3),
                   seed=11)
    first, again = simulate(noisy, "adaptive"), simulate(noisy, "adaptive")
    assert first.makespan_us == again.makespan_us and first.iterations[0].orders == again.iterations[0].orders
    results = [simulate(noisy, name) for name in ("dfc", "bfc", "interleaved", "adaptive")]
    for other in results[1:]:        # the same work per rank, summed in another order
        assert other.iterations[0].busy_us == pytest.approx(results[0].iterations[0].busy_us, rel=1e-12)
    assert len({r.lower_bound_us for r in results}) == 1
    assert all(r.makespan_us >= r.lower_bound_us for r in results)
    other_seed = simulate(config(shape, perturbations=noisy.perturbations, seed=12), "adaptive")
    assert other_seed.makespan_us != first.makespan_us


def test_static_policies_keep_their_order_under_perturbations():
    shape = PipelineShape(3, 2, 6)
    noisy = config(shape, perturbations=ComputePerturbations(jitter=0.5, slow_rank=0, slow_factor=2.0))
    result = simulate(noisy, "interleaved")
    assert result.iterations[0].orders == [list(megatron_order(shape, r)) for r in range(3)]


def test_policies_observe_every_task_in_seconds_and_live_across_iterations():
    shape = PipelineShape(3, 1, 4)
    noisy = config(shape, perturbations=ComputePerturbations(jitter=0.2), iterations=3, seed=5)
    policies = [Recording(make_policy("adaptive", shape, r)) for r in range(3)]
    result = simulate(noisy, policies)
    assert result.policy == "adaptive"
    for rank, policy in enumerate(policies):
        assert len(policy.observed) == 3 * 2 * 4
        durations = draw_durations(shape, noisy.compute, noisy.perturbations, 5, 2)[rank]
        for task, seconds in policy.observed[-8:]:
            kind = 0 if task.kind is Kind.FORWARD else 1
            assert seconds == pytest.approx(durations[kind][task.chunk][task.microbatch] / 1e6)
    outcomes = result.iterations
    assert [o.iteration for o in outcomes] == [0, 1, 2] and outcomes[0].start_us == 0.0
    assert all(later.start_us == earlier.end_us for earlier, later in zip(outcomes, outcomes[1:]))
    assert result.makespan_us == pytest.approx(outcomes[-1].end_us / 3)


# ---- errors ---------------------------------------------------------------------------------------------------
class Never(Policy):
    name = "never"

    def next(self, state):
        return None


class Reckless(Policy):
    name = "reckless"

    def next(self, state):
        return self.shape.tasks(self.rank)[-1]      # a backward that cannot be ready


def test_a_policy_that_never_runs_is_reported_as_a_stall():
    shape = PipelineShape(2, 1, 2)
    with pytest.raises(ScheduleStallError, match="schedule stalled") as info:
        simulate(config(shape), [Never(shape, r, 2) for r in range(2)])
    assert "rank 1: done 0/4" in str(info.value)


def test_a_policy_that_breaks_the_protocol_is_reported():
    shape = PipelineShape(2, 1, 2)
    with pytest.raises(ScheduleStateError, match="cannot start B"):
        simulate(config(shape), [Reckless(shape, r, 2) for r in range(2)])


@pytest.mark.parametrize("kwargs, message", [
    (dict(iterations=0), "iterations must be an int >= 1, got 0"),
    (dict(seed=-1), "seed must be an int >= 0, got -1"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ScheduleConfigError, match=message):
        config(PipelineShape(2, 1, 2), **kwargs)


def test_shape_mismatches_are_rejected():
    with pytest.raises(ScheduleConfigError, match="forward_only shapes are not supported"):
        config(PipelineShape(2, 1, 2, forward_only=True))
    with pytest.raises(ScheduleConfigError, match="need one policy per rank \\(2\\), got 1"):
        simulate(config(PipelineShape(2, 1, 2)), [make_policy("dfc", PipelineShape(2, 1, 2), 0)])
    with pytest.raises(ScheduleConfigError, match="slow_rank 5 is outside 0..1"):
        config(PipelineShape(2, 1, 2), perturbations=ComputePerturbations(slow_rank=5))
