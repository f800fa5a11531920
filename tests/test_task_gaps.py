"""The time a rank spends between its tasks (taking an input, deciding, posting a send, tracing): learnt per pipeline
rank from each call and added to every task of the planner's tables, never to a task's own predicted duration."""

import numpy as np
import pytest

from megatron_app.schedule import PipelineShape, ScheduleConfigError
from megatron_app.schedule.composition_plan import PLANNED_KINDS
from megatron_app.schedule.length_costs import LengthCostModel
from megatron_app.schedule.planned import PlannedPolicy
from megatron_app.schedule.tasks import Kind
from pipeline_runs import REPO, run_env


def _trained(model: LengthCostModel, ranks=(0, 1)) -> LengthCostModel:
    for rank in ranks:
        for tokens in (100, 200, 400, 800):
            model.observe(Kind.FORWARD, 0, tokens, 1e-3 + 1e-6 * tokens, rank=rank)
            model.observe(Kind.BACKWARD, 0, tokens, 2e-3 + 2e-6 * tokens, rank=rank)
    return model


def test_a_ranks_gap_is_the_median_of_its_recent_calls_and_the_warm_up_call_is_left_out():
    model = LengthCostModel()
    assert model.gap_seconds() == 0.0 and model.gap_seconds(1) == 0.0           # nothing learnt: no gap
    model.observe_gap(5e-3, rank=0, warmup=True)                                   # first-call costs
    assert model.gap_seconds(0) == 0.0
    for seconds in (1e-4, 1.2e-4, 9e-3, 1.1e-4):                                   # one slow call moves it little
        model.observe_gap(seconds, rank=0)
    assert model.gap_seconds(0) == pytest.approx(1.15e-4)
    for seconds in [1.0] * 3 + [2e-4] * 8:                                          # the 8 most recent calls
        model.observe_gap(seconds, rank=1)
    assert model.gap_seconds(1) == pytest.approx(2e-4)
    assert model.gap_seconds(3) == model.gap_seconds() == pytest.approx((1.15e-4 + 2e-4) / 2)   # unseen: the mean
    assert LengthCostModel(task_gaps=False).gap_seconds() == 0.0
    with pytest.raises(ScheduleConfigError, match="gap between tasks must be >= 0"):
        model.observe_gap(-1e-6)


def test_the_tables_hold_each_ranks_gap_and_a_tasks_own_duration_does_not():
    model = _trained(LengthCostModel())
    before = model.duration_table(PLANNED_KINDS, 1, [300.0], [90000.0], num_stages=2)
    pooled_before = model.duration_table(PLANNED_KINDS, 1, [300.0], [90000.0])
    own = model.seconds(Kind.FORWARD, 0, 300, rank=1)
    model.observe_gap(1e-4, rank=0)
    model.observe_gap(3e-4, rank=1)
    after = model.duration_table(PLANNED_KINDS, 1, [300.0], [90000.0], num_stages=2)
    # rows (kind * P + rank) * V + chunk: forward rank 0, forward rank 1, backward rank 0, backward rank 1
    assert np.allclose(after - before, [[1e-4], [3e-4], [1e-4], [3e-4]])
    assert model.seconds(Kind.FORWARD, 0, 300, rank=1) == own
    pooled = model.duration_table(PLANNED_KINDS, 1, [300.0], [90000.0])     # every rank alike: the mean gap
    assert np.allclose(pooled - pooled_before, 2e-4)
    no_gaps = _trained(LengthCostModel(task_gaps=False))
    no_gaps.observe_gap(1e-4, rank=0)
    assert np.allclose(no_gaps.duration_table(PLANNED_KINDS, 1, [300.0], [90000.0], num_stages=2), before)


def test_gaps_travel_to_the_planning_rank_with_the_task_samples():
    measured = LengthCostModel()
    measured.observe(Kind.FORWARD, 0, 100, 1e-3, rank=1)
    measured.observe_gap(7e-5, rank=1, warmup=True)
    measured.observe_gap(8e-5, rank=1)
    planning = LengthCostModel()
    planning.observe_reported(measured.take_unreported())
    assert planning.gap_seconds(1) == pytest.approx(8e-5) and planning.samples(Kind.FORWARD, 0, 1) == 1
    assert measured.take_unreported() == []


def test_a_planned_ranks_predicted_tasks_start_after_the_gaps_and_last_their_own_time():
    shape = PipelineShape(2, 1, 4)
    policy = PlannedPolicy(shape, 0)
    lengths = [100, 200, 400, 800]
    _trained(policy.costs)
    policy.use_plan(lengths, None)
    plain = dict(policy.predicted)
    policy.costs.observe_gap(5e-4, rank=0)
    policy.costs.observe_gap(5e-4, rank=1)
    policy.use_plan(lengths, None)
    for task, (start, duration) in policy.predicted.items():
        assert duration == pytest.approx(plain[task][1])             # a task's own time, as its span measures it
        assert start >= plain[task][0]
    last = max(policy.predicted.values())
    assert last[0] > max(plain.values())[0] + 5e-4                    # the gaps before it moved it later


@pytest.mark.slow
def test_the_runtime_traces_the_gap_it_learns_as_the_replay_measures_it(tmp_path, real_corpus):
    """Each training call's task_gap_us (iteration event) is the trace's own mean gap between tasks run without a
    wait between them: the runtime and bench/cost_model_replay.py measure the same thing."""
    import subprocess

    from megatron_app.bench.cost_model_replay import _gap_seconds, _iteration_tasks
    from megatron_app.trace.reader import read_trace_dir

    result = subprocess.run(["bash", "run_single.sh", "--pipeline_parallel", "2", "--model_chunks", "2",
                             "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                             "--seq-length", "96", "--global-batch-size", "16", "--iters", "3",
                             "--variable-seq-lengths", "--data-path", real_corpus["data_path"],
                             "--tokenizer-json", real_corpus["tokenizer_json"], "--trace-dir", str(tmp_path)],
                            cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run = read_trace_dir(str(tmp_path / "latest"))
    ranks = run.pipelines()[0]
    compared = 0
    for iteration in run.complete_iterations():
        for rank, tasks in zip(ranks, _iteration_tasks(ranks, iteration)):
            traced = [e for e in rank.events_of(iteration) if e.kind == "iteration"][0].extra["task_gap_us"]
            assert traced == pytest.approx(_gap_seconds(rank, iteration, tasks) * 1e6, abs=1e-3)
            assert traced > 0
            compared += 1
    assert compared == 2 * 3
