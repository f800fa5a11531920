"""Predicted against measured in a trace (trace/prediction.py): per (kind, chunk), the makespan, the worst tasks."""

import pytest

from megatron_app.trace.prediction import format_report, prediction_report
from megatron_app.trace.schema import TraceEvent


def _event(rank, kind, chunk, mb, start, end, predicted_start=None, predicted=None):
    extra = {} if predicted is None else {"predicted_start_us": predicted_start, "predicted_us": predicted}
    return TraceEvent(rank=rank, pp_rank=rank, iteration=3, kind=kind, start=start, end=end, chunk=chunk,
                      microbatch=mb, extra=extra)


def test_errors_per_kind_and_chunk_the_makespan_and_the_worst_task():
    events = [_event(0, "forward", 0, 0, 0, 100, 0, 100), _event(0, "forward", 0, 1, 100, 220, 100, 100),
              _event(1, "backward", 0, 0, 220, 420, 200, 200), _event(1, "send", None, None, 0, 5)]
    report = prediction_report(3, events)
    rows = {(r.kind, r.chunk): r for r in report.per_kind_chunk}
    assert rows[("forward", 0)].tasks == 2 and rows[("forward", 0)].bias == pytest.approx(0.1)
    assert rows[("backward", 0)].median_abs_error == 0.0
    assert report.predicted_makespan_us == 400 and report.measured_makespan_us == 420
    assert report.makespan_error == pytest.approx(0.05)
    assert (report.worst[0].kind, report.worst[0].microbatch) == ("forward", 1)
    text = format_report(report)
    assert "+5.0%" in text and "rank 0 forward 0-1" in text


def test_no_prediction_no_report():
    assert prediction_report(0, [_event(0, "forward", 0, 0, 0, 10)]) is None
