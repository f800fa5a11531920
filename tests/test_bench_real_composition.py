"""The real-run composition bench's summary: medians over runs, ratios to the baseline, loss agreement."""

import pytest

from megatron_app.bench.real_composition import CompositionRun, format_table, summarise


def test_summary_takes_medians_across_alternated_runs_and_compares_losses_to_the_baseline():
    runs = [CompositionRun("loader", 0, [2.0, 2.2], [100.0, 90.0], [7.0, 6.5]),
            CompositionRun("balanced", 0, [1.0, 1.1], [200.0, 180.0], [7.0, 6.5 + 1e-6]),
            CompositionRun("balanced", 1, [1.0], [190.0], [7.0]),
            CompositionRun("loader", 1, [2.1], [95.0], [7.0])]
    summaries = {s.composition: s for s in summarise(runs, "loader")}
    assert summaries["loader"].median_tokens_per_s == 95.0
    assert summaries["balanced"].median_tokens_per_s == 190.0
    assert summaries["balanced"].speedup_over_baseline == pytest.approx(2.0)
    assert summaries["balanced"].iterations == 3
    assert summaries["balanced"].max_loss_difference == pytest.approx(1e-6)
    assert "balanced" in format_table(list(summaries.values()), "loader")


def test_prediction_error_is_taken_after_the_cost_models_warm_up():
    runs = [CompositionRun("loader", 0, [2.0, 2.0, 2.0], [1.0] * 3, [7.0] * 3, [900.0, 2100.0, 1900.0]),
            CompositionRun("balanced", 0, [2.0, 2.0, 2.0], [1.0] * 3, [7.0] * 3, [3000.0, 1900.0, 2200.0]),
            CompositionRun("packed", 0, [2.0], [1.0], [7.0], [None])]
    summaries = {s.composition: s for s in summarise(runs, "loader")}
    assert summaries["loader"].prediction_errors == pytest.approx([0.05, -0.05])   # the first measured left out
    assert summaries["balanced"].prediction_errors == pytest.approx([-0.05, 0.10])
    assert summaries["balanced"].median_abs_prediction_error == pytest.approx(0.075)
    assert summaries["balanced"].max_abs_prediction_error == pytest.approx(0.10)
    assert summaries["packed"].median_abs_prediction_error is None
    table = format_table(list(summaries.values()), "loader")
    assert "not predicted" in table and "7.5%, 10.0% (n=2)" in table
