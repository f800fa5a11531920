"""Simulator cost model: task durations and perturbations, links (latency, bandwidth, FIFO serialisation, slow
windows), and the lower bounds."""

import math

import numpy as np
import pytest

from megatron_app.schedule import PipelineShape, ScheduleConfigError
from megatron_app.sim import (ComputeCosts, ComputePerturbations, LinkCosts, Network, SimConfig, SlowLink,
                              draw_durations, lower_bounds, pipeline_links, simulate)

SHAPE = PipelineShape(4, 2, 8)
COSTS = ComputeCosts.uniform(SHAPE, 10_000, 20_000)


def as_array(durations):
    return np.asarray(durations)            # (P, kind, V, m)


# ---- compute costs --------------------------------------------------------------------------------------------
def test_uniform_costs_and_slow_rank():
    times = as_array(draw_durations(SHAPE, COSTS, ComputePerturbations(slow_rank=2, slow_factor=1.5), 0, 0))
    assert times.shape == (4, 3, 2, 8)      # forward, backward, weight (0 without a split backward)
    assert (times[:, 2] == 0).all()
    assert (times[[0, 1, 3], 0] == 10_000).all() and (times[[0, 1, 3], 1] == 20_000).all()
    assert (times[2, 0] == 15_000).all() and (times[2, 1] == 30_000).all()


def test_per_chunk_and_per_rank_tables():
    per_chunk = ComputeCosts.per_chunk(SHAPE, [1.0, 3.0], [2.0, 6.0])
    times = as_array(draw_durations(SHAPE, per_chunk, ComputePerturbations(), 0, 0))
    assert (times[:, 0, 1] == 3.0).all() and (times[:, 1, 0] == 2.0).all()
    table = ComputeCosts(((1, 2), (3, 4)), ((5, 6), (7, 8)))
    times = as_array(draw_durations(PipelineShape(2, 2, 2), table, ComputePerturbations(), 0, 0))
    assert times[1, 1, 0, 1] == 7 and times[0, 0, 1, 0] == 2
    with pytest.raises(ScheduleConfigError, match="cost tables are 2 ranks x 2 chunks, the pipeline is 4 x 2"):
        draw_durations(SHAPE, table, ComputePerturbations(), 0, 0)


def test_jitter_and_stragglers_are_seeded_and_bounded():
    jitter = ComputePerturbations(jitter=0.3)
    times = as_array(draw_durations(SHAPE, COSTS, jitter, seed=7, iteration=0))
    ratio = times[:, 0] / 10_000
    assert ratio.min() >= 0.7 and ratio.max() <= 1.3 and ratio.std() > 0.1
    assert (times == as_array(draw_durations(SHAPE, COSTS, jitter, seed=7, iteration=0))).all()
    assert (times != as_array(draw_durations(SHAPE, COSTS, jitter, seed=8, iteration=0))).any()
    assert (times != as_array(draw_durations(SHAPE, COSTS, jitter, seed=7, iteration=1))).any()
    big = PipelineShape(4, 4, 256)
    stragglers = as_array(draw_durations(big, ComputeCosts.uniform(big, 1.0, 2.0),
                                         ComputePerturbations(straggler_prob=0.1, straggler_factor=3.0), 0, 0))
    slow = stragglers[:, 0] == 3.0
    assert set(np.unique(stragglers[:, 0])) == {1.0, 3.0} and 0.08 < slow.mean() < 0.12


def test_draws_of_one_perturbation_do_not_depend_on_the_other():
    # Adding stragglers must not reshuffle the jitter each task got (policies are compared on the same draws).
    jitter_only = as_array(draw_durations(SHAPE, COSTS, ComputePerturbations(jitter=0.2), 3, 0))
    both = as_array(draw_durations(SHAPE, COSTS, ComputePerturbations(jitter=0.2, straggler_prob=0.5,
                                                                      straggler_factor=2.0), 3, 0))
    assert np.isin(both[:, :2] / jitter_only[:, :2], [1.0, 2.0]).all()


def test_a_split_backward_shares_each_drawn_backward_between_b_and_w():
    # B + W is the whole backward's draw, so split and whole runs are compared on the same durations.
    split = PipelineShape(4, 2, 8, split_backward=True)
    perturbed = ComputePerturbations(jitter=0.2, straggler_prob=0.3, straggler_factor=2.0)
    whole = as_array(draw_durations(SHAPE, COSTS, perturbed, 5, 1))
    for share in (0.5, 0.3):
        costs = ComputeCosts(COSTS.forward_us, COSTS.backward_us, weight_share=share)
        times = as_array(draw_durations(split, costs, perturbed, 5, 1))
        assert np.allclose(times[:, 0], whole[:, 0]) and np.allclose(times[:, 1] + times[:, 2], whole[:, 1])
        assert np.allclose(times[:, 2], share * whole[:, 1])
    with pytest.raises(ScheduleConfigError, match="weight_share must be >= 0 and <= 1"):
        ComputeCosts(COSTS.forward_us, COSTS.backward_us, weight_share=1.5)


def test_with_lengths_w_grows_linearly_and_attention_stays_in_b():
    # A long microbatch's extra (quadratic) cost is attention, which has no weights: its W share shrinks.
    from megatron_app.sim.lengths import MicrobatchLengths

    lengths = MicrobatchLengths(median_tokens=100, sigma=0.5)
    mean = lengths.mean_tokens
    tokens = [mean / 4, mean, 4 * mean, mean, mean, mean, mean, mean]
    factors = [lengths.cost_factor(n) for n in tokens]
    weight_factors = [lengths.weight_share_factor(n) for n in tokens]
    assert weight_factors[1] == pytest.approx(1.0)
    split = PipelineShape(4, 2, 8, split_backward=True)
    whole = as_array(draw_durations(SHAPE, COSTS, ComputePerturbations(), 0, 0, factors))
    times = as_array(draw_durations(split, COSTS, ComputePerturbations(), 0, 0, factors, weight_factors))
    assert np.allclose(times[:, 1] + times[:, 2], whole[:, 1])
    for microbatch, n in enumerate(tokens):     # W = 0.5 x the mean-length backward x (tokens / mean)
        assert np.allclose(times[:, 2, :, microbatch], 0.5 * 20_000 * n / mean)
    shares = times[0, 2, 0, :3] / whole[0, 1, 0, :3]
    assert shares[0] > 0.5 > shares[2] and shares[2] == pytest.approx(0.5 * 4 / (0.7 * 4 + 0.3 * 16))


@pytest.mark.parametrize("kwargs, message", [
    (dict(slow_factor=0.5), "slow_factor must be >= 1, got 0.5"),
    (dict(jitter=1.0), "jitter must be >= 0 and < 1, got 1.0"),
    (dict(straggler_prob=1.5), "straggler_prob must be >= 0 and <= 1, got 1.5"),
    (dict(straggler_factor=float("nan")), "straggler_factor must be a finite number"),
    (dict(slow_rank=-1), "slow_rank must be a rank number >= 0, got -1"),
])
def test_perturbation_errors(kwargs, message):
    with pytest.raises(ScheduleConfigError, match=message):
        ComputePerturbations(**kwargs)


def test_cost_errors():
    with pytest.raises(ScheduleConfigError, match=r"forward_us\[0\]\[1\] must be >= 0, got -1"):
        ComputeCosts(((1, -1),), ((1, 1),))
    with pytest.raises(ScheduleConfigError, match="same shape"):
        ComputeCosts(((1, 1),), ((1,),))
    with pytest.raises(ScheduleConfigError, match="slow_rank 4 is outside 0..3"):
        draw_durations(SHAPE, COSTS, ComputePerturbations(slow_rank=4), 0, 0)


# ---- links ----------------------------------------------------------------------------------------------------
def test_a_link_serialises_its_transmissions_and_overlaps_latency():
    costs = LinkCosts(latency_us=5.0, gbps=8.0, tensor_bytes=1000)      # 8000 bits at 8000 bits/us -> 1 us
    assert costs.transmit_us == 1.0 and costs.min_transfer_us == 6.0
    network = Network(costs)
    assert [network.send(0, 1, 0.0) for _ in range(3)] == [(0.0, 6.0), (1.0, 7.0), (2.0, 8.0)]
    assert network.send(1, 0, 0.0) == (0.0, 6.0)        # the other direction is another link
    assert network.send(0, 1, 10.0) == (10.0, 16.0)     # idle again: no queueing
    assert network.send(2, 2, 3.0) == (3.0, 3.0)        # same rank: local hand-over


def test_free_links_cost_nothing():
    network = Network(LinkCosts())
    assert network.send(0, 1, 4.0) == (4.0, 4.0) and LinkCosts().min_transfer_us == 0.0


def test_slow_link_window_applies_to_transfers_starting_inside_it_both_directions():
    slow = SlowLink.parse("1-2:1-2:4")                  # 1 ms .. 2 ms, 4x slower
    assert (slow.start_us, slow.end_us, slow.factor, str(slow)) == (1000.0, 2000.0, 4.0, "1-2:1-2:4")
    network = Network(LinkCosts(latency_us=10.0, gbps=8.0, tensor_bytes=1000, slow_links=(slow,)))
    assert network.send(1, 2, 999.0) == (999.0, 1010.0)
    assert network.send(2, 1, 1000.0) == (1000.0, 1044.0)   # (10 + 1) * 4
    assert network.send(1, 2, 1999.0) == (1999.0, 2043.0)
    assert network.send(1, 2, 2000.0) == (2003.0, 2014.0)   # queued behind the slow one, then normal speed
    assert network.send(0, 1, 1500.0) == (1500.0, 1511.0)   # other links unaffected


@pytest.mark.parametrize("text, message", [
    ("1-2", "is not A-B:START_MS-END_MS:FACTOR"),
    ("1-1:0-5:2", "joins a rank to itself"),
    ("1-2:5-3:2", "the window must end after it starts"),
    ("1-2:0-5:0.5", "slow link factor must be >= 1, got 0.5"),
])
def test_slow_link_parse_errors(text, message):
    with pytest.raises(ScheduleConfigError, match=message):
        SlowLink.parse(text)


def test_links_that_carry_traffic():
    assert pipeline_links(PipelineShape(1, 1, 2)) == set()
    assert pipeline_links(PipelineShape(3, 1, 2)) == {(0, 1), (1, 2), (1, 0), (2, 1)}
    assert pipeline_links(PipelineShape(3, 2, 3)) == {(0, 1), (1, 2), (2, 0), (1, 0), (2, 1), (0, 2)}
    LinkCosts(slow_links=(SlowLink.parse("2-0:0-1:2"),)).check_shape(PipelineShape(3, 2, 3))
    with pytest.raises(ScheduleConfigError, match="carries no pipeline traffic"):
        LinkCosts(slow_links=(SlowLink.parse("2-0:0-1:2"),)).check_shape(PipelineShape(3, 1, 3))
    with pytest.raises(ScheduleConfigError, match="names a rank outside 0..2"):
        LinkCosts(slow_links=(SlowLink.parse("2-3:0-1:2"),)).check_shape(PipelineShape(3, 1, 3))
    with pytest.raises(ScheduleConfigError, match="link gbps must be a number > 0"):
        LinkCosts(gbps=0)


# ---- lower bounds ---------------------------------------------------------------------------------------------
def test_bounds_for_uniform_costs_are_the_static_closed_forms():
    f, b, P, m = 10.0, 20.0, 4, 8
    one = PipelineShape(P, 1, m)
    bounds = lower_bounds(one, draw_durations(one, ComputeCosts.uniform(one, f, b), ComputePerturbations(), 0, 0),
                          0.0)
    assert bounds.work_us == m * (f + b) and bounds.path_us == (m + P - 1) * (f + b) == bounds.best_us
    times = draw_durations(SHAPE, COSTS, ComputePerturbations(), 0, 0)
    assert lower_bounds(SHAPE, times, 0.0).path_us == 2 * 8 * 30_000 + 3 * 30_000
    assert lower_bounds(SHAPE, times, 100.0).path_us == 2 * 8 * 30_000 + 3 * 30_000 + 2 * 3 * 100.0


def test_bounds_follow_the_slowest_rank_and_the_single_microbatch_chain():
    times = draw_durations(SHAPE, COSTS, ComputePerturbations(slow_rank=3, slow_factor=2.0), 0, 0)
    bounds = lower_bounds(SHAPE, times, 0.0)
    assert bounds.work_us == 2 * 8 * 60_000
    assert bounds.path_us == 3 * 10_000 + 2 * 8 * 60_000 + 3 * 20_000   # head + rank 3's work + tail
    single = PipelineShape(3, 1, 1)
    times = draw_durations(single, ComputeCosts.uniform(single, 1.0, 2.0), ComputePerturbations(), 0, 0)
    assert lower_bounds(single, times, 0.5).path_us == 3 * 3.0 + 4 * 0.5      # one chain, 4 hops
    assert math.isclose(lower_bounds(single, times, 0.5).work_us, 3.0)


@pytest.mark.parametrize("P, V, m", [(4, 1, 8), (4, 2, 8)])
def test_simulated_zb_h1_meets_its_closed_form_and_the_path_bound(P, V, m, tmp_path):
    """F = B = W = 10 ms, free links: ZB-H1 takes (3mV + P - 1) x 10 ms (bubble (P-1)(F+B-W)), which is the split
    backward's path bound; W events land in the trace."""
    shape = PipelineShape(P, V, m, split_backward=True)
    config = SimConfig(shape, ComputeCosts.uniform(shape, 10_000.0, 20_000.0))   # weight_share 0.5: B = W = 10 ms
    result = simulate(config, "zb-h1", trace_dir=tmp_path)
    assert result.makespan_us == (3 * m * V + P - 1) * 10_000.0 == result.bounds[0].best_us
    assert simulate(config, "interleaved").makespan_us > result.makespan_us
    weights = [line for line in (tmp_path / "trace_rank0.jsonl").read_text().splitlines() if '"weight"' in line]
    assert len(weights) == V * m
