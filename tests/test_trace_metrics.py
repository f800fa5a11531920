"""Pipeline metrics on schedules small enough to work out by hand, and the interval helpers under them."""

from __future__ import annotations

import pytest

from megatron_app.trace import read_trace_dir
from megatron_app.trace.intervals import busy_fraction, concurrency_steps, interval_deltas, max_concurrency, \
    max_level_per_bin, union_length
from megatron_app.trace.metrics import CSV_COLUMNS, csv_rows, host_bound_us, iteration_metrics
from megatron_app.trace.schema import TraceEvent
from test_trace_synthetic import plan_greedy, write_plan


def metrics_of(tmp_path, plan, iteration=0):
    return iteration_metrics(read_trace_dir(write_plan(tmp_path, plan)), iteration)


def test_two_stage_one_f_one_b_with_latency(tmp_path):
    # F=10 B=20, 5 us between ranks. By hand:
    #   rank 0: F0 0-10  F1 10-20                    B0 50-70      B1 80-100
    #   rank 1:      F0 15-25  B0 25-45  F1 45-55  B1 55-75
    plan = plan_greedy(2, 1, 2, forward_us=10, backward_us=20, latency_us=5, optimizer_us=7, start_us=0.0)
    m = metrics_of(tmp_path, plan)
    assert (m.start_us, m.end_us, m.makespan_us) == (0.0, 100.0, 100.0)
    assert m.ideal_us == 60.0
    assert m.makespan_over_ideal == pytest.approx(100 / 60)
    assert m.iteration_time_us == 107.0
    rank0, rank1 = m.ranks
    assert (rank0.compute_us, rank0.forward_us, rank0.backward_us) == (60.0, 20.0, 40.0)
    assert (rank0.idle_us, rank0.bubble_ratio) == (40.0, 0.4)
    assert (rank1.idle_us, rank1.bubble_ratio) == (40.0, 0.4)
    assert m.mean_bubble_ratio == pytest.approx(0.4)
    assert rank0.comm_wait_us == 30.0 + 10.0  # waits 20-50 for B0, 70-80 for B1
    assert rank1.comm_wait_us == 15.0          # waits 0-15 for F0
    assert rank0.optimizer_us == 7.0
    assert (rank0.peak_activations, rank1.peak_activations) == (2, 1)  # rank 1: B0 ends as F1 starts
    assert (rank0.max_sends_in_flight, rank1.max_sends_in_flight) == (1, 1)
    assert (rank0.sent_bytes, rank1.sent_bytes) == (2 * 4096, 2 * 4096)
    assert (rank0.tasks, rank1.tasks) == (4, 4)


def test_exact_bubble_ratio_of_one_f_one_b(tmp_path):
    """No latency: the classic (P-1)/(m+P-1) bubble of 1F1B, here 3/(4+3) with P=4, m=4 and B = 2F."""
    plan = plan_greedy(4, 1, 4, forward_us=10, backward_us=20, start_us=0.0)
    m = metrics_of(tmp_path, plan)
    assert m.makespan_us == (4 + 3) * 30.0
    assert [r.bubble_ratio for r in m.ranks] == [pytest.approx(3 / 7)] * 4
    assert m.makespan_over_ideal == pytest.approx(7 / 4)


def test_sends_overlap_when_the_link_is_slow(tmp_path):
    # latency 15 > forward 10: rank 0's send of F0 (10-25) is still in flight when F1's send starts at 20
    m = metrics_of(tmp_path, plan_greedy(2, 1, 2, forward_us=10, backward_us=20, latency_us=15, start_us=0.0))
    assert m.ranks[0].max_sends_in_flight == 2


def test_slow_rank_sets_the_ideal(tmp_path):
    plan = plan_greedy(3, 1, 3, duration=lambda r, k, c, i: (10.0 if k == "forward" else 20.0) * (2 if r == 1 else 1))
    m = metrics_of(tmp_path, plan)
    assert m.ideal_us == 3 * 60.0
    assert m.ranks[1].compute_us == m.ideal_us
    assert m.ranks[1].bubble_ratio < m.ranks[0].bubble_ratio


def test_csv_rows_have_one_row_per_iteration_and_rank(tmp_path):
    run = read_trace_dir(write_plan(tmp_path, plan_greedy(2, 1, 2, iterations=2)))
    rows = csv_rows([iteration_metrics(run, k) for k in (0, 1)])
    assert [(r["iteration"], r["global_rank"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(list(r) == CSV_COLUMNS for r in rows)


def test_union_length_counts_overlaps_once():
    assert union_length([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert union_length([]) == 0


def test_concurrency_ends_before_starts_at_equal_times():
    assert max_concurrency(interval_deltas([(0, 10), (10, 20)])) == 1
    assert max_concurrency(interval_deltas([(0, 10), (9, 20), (9.5, 9.7)])) == 3
    assert concurrency_steps(interval_deltas([(0, 10), (5, 20)])) == [(0, 1), (5, 2), (10, 1), (20, 0)]


def test_busy_fraction_per_window():
    assert busy_fraction([(0, 10), (5, 12), (30, 40)], [0, 10, 20, 35], 10) == [1.0, 0.2, 0.0, 0.5]


def test_max_level_per_bin_keeps_short_peaks():
    steps = concurrency_steps(interval_deltas([(1.0, 1.1), (5.0, 25.0), (6.0, 7.0)]))
    assert max_level_per_bin(steps, [0, 10, 20, 30, 40]) == [2, 1, 1, 0]
    assert max_level_per_bin([], [0, 1, 2]) == [0, 0]


def test_host_bound_time_counts_the_device_timed_tasks_that_waited_for_the_host():
    """Schema 1.7: a device-timed task whose device end came within 10% of its span after the host's end had caught
    up with the host (it waited for it); one still working through earlier work, or on its own kernels after the
    host returned, was the device's. Host-timed traces have no such figure."""
    def task(start, end, **extra):
        return TraceEvent(rank=0, pp_rank=0, iteration=1, kind="forward", start=start, end=end, chunk=0,
                          microbatch=0, extra=extra)

    events = [task(0.0, 30.0, host_us=29.0, queued_us=0.0),      # ended 1 us after the host: host-bound
              task(30.0, 40.0, host_us=2.0, queued_us=0.0),      # launched in 2 us, kernels ran 8 us more: device's
              task(40.0, 50.0, host_us=9.0, queued_us=0.0),      # ended exactly 10% of its span after: host-bound
              task(50.0, 60.0, host_us=10.0, queued_us=5.0)]     # 5 us behind the host all along: the device's
    assert host_bound_us(events) == 40.0
    assert host_bound_us([task(0.0, 30.0)]) is None


def test_a_host_timed_trace_has_no_host_bound_time(tmp_path):
    m = metrics_of(tmp_path, plan_greedy(2, 1, 2, forward_us=10, backward_us=20, start_us=0.0))
    assert [r.host_bound_us for r in m.ranks] == [None, None]
