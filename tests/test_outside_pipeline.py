"""The time an iteration spends outside the pipeline, as the planning rank predicts it (RuntimeSession)."""

from megatron_app.runtime.session import RuntimeSession
from megatron_app.runtime.settings import AppSettings


def _observed(outside_seconds):
    """A session that saw training calls spend these seconds outside their 1-second pipelines."""
    session = RuntimeSession(AppSettings())
    start = 100.0
    for seconds in outside_seconds:
        session.last_call_start = start
        start += 1.0 + seconds
        session.observe_outside_pipeline(start, 1.0)
    return session


def test_nothing_is_predicted_before_a_call_was_seen():
    assert RuntimeSession(AppSettings()).outside_pipeline_s is None
    session = RuntimeSession(AppSettings())
    session.observe_outside_pipeline(5.0, 1.0)   # no call began yet
    assert session.outside_pipeline_s is None


def test_the_first_call_counts_only_until_a_later_one_is_seen():
    # the first call's optimizer step creates the optimizer's state (65 ms against 6 ms later on an H200)
    assert abs(_observed([0.170]).outside_pipeline_s - 0.170) < 1e-9
    assert abs(_observed([0.170, 0.031]).outside_pipeline_s - 0.031) < 1e-9
    assert abs(_observed([0.170, 0.031, 0.045]).outside_pipeline_s - 0.038) < 1e-9


def test_the_median_of_the_last_five_leaves_out_an_evaluation():
    assert abs(_observed([0.5, 0.03, 0.04, 2.0, 0.05, 0.04]).outside_pipeline_s - 0.04) < 1e-9
    assert abs(_observed([0.5, 9.0, 0.03, 0.04, 0.05, 0.06, 0.07]).outside_pipeline_s - 0.05) < 1e-9
