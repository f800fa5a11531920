"""The issue's scenarios (P=4, V=2, m=8, f=10 ms, b=20 ms) on every policy: the product targets that hold are
asserted; for the ones that cannot hold, the test asserts why (the lower bound leaves no room for them)."""

import pytest

from megatron_app.schedule import policies_for
from megatron_app.sim.scenarios import ISSUE_SHAPE, SCENARIOS, format_rows, main, run_scenarios

APP = ("dfc", "bfc", "adaptive")
STATIC = ("interleaved",)


@pytest.fixture(scope="module")
def table():
    rows = run_scenarios(seeds=range(3))
    return {(row.scenario, row.policy): row for row in rows}


def makespan(table, scenario, policy):
    return table[(scenario, policy)].makespan_ms


def bound(table, scenario):
    return table[(scenario, "interleaved")].lower_bound_ms


def test_every_policy_of_every_scenario_ran_above_the_bound(table):
    assert {scenario for scenario, _ in table} == set(SCENARIOS)
    for (scenario, policy), row in table.items():
        assert row.makespan_ms >= row.lower_bound_ms - 1e-9, (scenario, policy)
        assert row.lower_bound_ms == bound(table, scenario)          # paired draws: one bound per scenario


def test_homogeneous_best_app_policy_matches_the_best_static_one(table):
    best_app = min(makespan(table, "homogeneous", p) for p in APP)
    best_static = min(makespan(table, "homogeneous", p) for p in STATIC)
    assert best_app <= 1.03 * best_static
    assert makespan(table, "homogeneous", "adaptive") == best_static == bound(table, "homogeneous") == 570.0


def test_slow_rank_adaptive_meets_the_bound_and_never_loses_to_static(table):
    adaptive = makespan(table, "slow rank 1.5x", "adaptive")
    assert adaptive <= 1.05 * bound(table, "slow rank 1.5x")
    assert adaptive <= min(makespan(table, "slow rank 1.5x", p) for p in STATIC)


def test_adaptive_is_never_slower_than_interleaved(table):
    for scenario in SCENARIOS:
        assert makespan(table, scenario, "adaptive") <= makespan(table, scenario, "interleaved") + 1e-9, scenario


def test_jitter_and_slow_link_leave_no_room_for_a_1_15x_speedup_over_interleaved(table):
    """No schedule beats the lower bound, and interleaved is already within 1.15x of it here."""
    for scenario in ("jitter +-30%", "slow link 1-2"):
        assert makespan(table, scenario, "interleaved") / bound(table, scenario) < 1.15, scenario


def test_app_policies_hold_no_more_activations_than_interleaved(table):
    for scenario in SCENARIOS:
        reference = table[(scenario, "interleaved")].peak_activations
        for policy in APP:
            assert all(a <= b for a, b in zip(table[(scenario, policy)].peak_activations, reference))


def test_scenarios_command_prints_the_table(capsys, table):
    assert main(["--seeds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["scenario", "policy", "makespan"] and len(out) == 1 + len(SCENARIOS) * len(policies_for(ISSUE_SHAPE))
    assert "homogeneous          adaptive" in "\n".join(out)
    assert format_rows(list(table.values())).count("\n") == len(table)
