"""agree_iteration_plan in one process (no process group): what it hands the next forward_backward call."""

import pytest

from megatron_app.runtime import composition as runtime_composition
from megatron_app.runtime.job import current_job, shutdown
from megatron_app.runtime.microbatch_lengths import take_microbatch_lengths
from megatron_app.schedule.tasks import Kind

LENGTHS = (120, 300, 2048, 90, 410, 150, 1900, 260)


@pytest.fixture(autouse=True)
def fresh_session():
    shutdown()
    yield
    shutdown()
    current_job().next_call.pending = None    # a plan agreed and not taken must not reach another file's call


def _take(count):
    return current_job().next_call.take(count)


@pytest.mark.parametrize("name,packed,count", [("loader", False, 4), ("packed", True, 4)])
def test_loader_compositions_tell_tokens_and_leave_planning_to_the_policy(name, packed, count):
    plan = runtime_composition.agree_iteration_plan(LENGTHS, 2, name)
    chosen = plan.replica(0).composition
    assert chosen.packed is packed and chosen.num_microbatches == count
    call = _take(count)
    assert call.tokens == chosen.microbatch_tokens(LENGTHS)
    assert call.plan is None and call.squared_tokens == chosen.microbatch_squared_tokens(LENGTHS)
    assert call.composition == name


def test_balanced_composition_comes_with_its_plan_before_any_call_and_predicts_once_costs_are_learnt():
    plan = runtime_composition.agree_iteration_plan(LENGTHS, 2, "balanced", document_ids=range(100, 108))
    plan.check()
    m = plan.replica(0).num_microbatches
    call = _take(m)
    assert call.tokens == plan.microbatch_tokens(0)
    assert call.plan is not None and len(call.plan.start_order) == m
    assert call.predicted_s is None and plan.report(0)["predicted_ms"] is None   # the prior is no time in seconds
    costs = current_job().session.shared_costs()
    for kind in (Kind.FORWARD, Kind.BACKWARD):
        for tokens in (100, 500, 2000):
            costs.observe(kind, 0, tokens, 1e-5 * tokens)
    plan = runtime_composition.agree_iteration_plan(LENGTHS, 2, "balanced", document_ids=range(100, 108))
    call = _take(plan.replica(0).num_microbatches)
    assert call.predicted_s == plan.predicted_s > 0 and plan.report(0)["predicted_ms"] == plan.predicted_s * 1e3
    assert {s.document for mb in call.document_segments for s in mb} == set(range(100, 108))
    assert _take(m) is None        # consumed


def test_balanced_grows_its_count_from_the_loaders_by_what_training_calls_ran(monkeypatch):
    """At P=2 V=2 the prior (no per-task cost) prices every microbatch more as a smaller bubble: unbounded, the
    first plan forms one per document. Before any training call it keeps the loader's count; once calls of 8 ran,
    up to 16. What bounds it is what training calls ran (the executor counts them, the gather takes every rank's),
    not what was planned: an evaluation's plan or one made ahead does not raise it."""
    from megatron_app.runtime.layout import JobLayout

    monkeypatch.setattr(runtime_composition, "job_layout", lambda pg_collection=None: JobLayout(0, 1, 2, 2, False))
    lengths = LENGTHS * 4        # 32 documents, the loader's 8 microbatches of 4 (unbounded: 32)
    session = current_job().session
    first = runtime_composition.decide_iteration_plan(lengths, 4, "balanced")
    assert first.replica(0).num_microbatches == 8 and session.microbatches_run == 0
    again = runtime_composition.decide_iteration_plan(lengths, 4, "balanced")   # planned, never run
    assert again.replica(0).num_microbatches == 8
    session.microbatches_run = 8                  # what the executor records after a training call of 8
    second = runtime_composition.decide_iteration_plan(lengths, 4, "balanced")
    assert second.replica(0).num_microbatches == 16


def test_a_call_with_another_count_is_refused():
    plan = runtime_composition.agree_iteration_plan(LENGTHS, 2, "packed")
    with pytest.raises(ValueError, match="planned 4 microbatches, the forward_backward call runs 5"):
        take_microbatch_lengths(plan.replica(0).num_microbatches + 1)
    with pytest.raises(Exception, match="unknown composition"):
        runtime_composition.agree_iteration_plan(LENGTHS, 2, "shuffled")


def test_a_batch_planned_ahead_is_adopted_when_ready_and_planned_in_line_when_not():
    nxt = tuple(reversed(LENGTHS))
    first = runtime_composition.agree_iteration_plan(LENGTHS, 2, "balanced", next_lengths=nxt)
    assert not first.planned_ahead
    _take(first.replica(0).num_microbatches)
    session = current_job().session
    session.plan_ahead._pending[1].result(timeout=120)          # the worker's plan is ready
    second = runtime_composition.agree_iteration_plan(nxt, 2, "balanced", next_lengths=LENGTHS + LENGTHS)
    assert second.planned_ahead and second.planner_s > 0 and session.plan_ahead.adopted == 1
    assert second.lengths == nxt
    second.check()
    _take(second.replica(0).num_microbatches)
    # another batch than the one planned ahead: planned in line
    third = runtime_composition.agree_iteration_plan(LENGTHS, 2, "balanced")
    assert not third.planned_ahead


def test_the_planning_rank_learns_every_pipeline_ranks_tasks_once(monkeypatch):
    """The per-call gather carries each rank's cost samples: rank 0's model then has rank 1's stage, and a sample
    is reported once."""
    session = current_job().session
    costs = session.shared_costs()
    for tokens in (100, 400, 900):
        costs.observe(Kind.FORWARD, 1, tokens, 1e-5 * tokens, rank=0)
    peer = type(costs)()
    for tokens in (100, 400, 900):
        peer.observe(Kind.FORWARD, 1, tokens, 3e-5 * tokens, rank=1)     # the last stage: three times the cost
    sent = {"peer": peer.take_unreported()}

    def gather_object(mine, gathered, dst):
        gathered[0], gathered[1] = mine, (0, None, sent.pop("peer", []), 12)   # the peer's calls ran 12

    monkeypatch.setattr(runtime_composition.dist, "gather_object", gather_object)
    monkeypatch.setattr(runtime_composition.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(runtime_composition.dist, "get_rank", lambda group=None: 0)
    layout = runtime_composition.JobLayout(distributed=True, num_stages=2, num_chunks=2)
    runtime_composition._gather_measurements(session, layout)
    assert costs.ranks_seen() == (0, 1) and costs.samples(Kind.FORWARD, 1, rank=1) == 3
    assert costs.seconds(Kind.FORWARD, 1, 500, rank=1) == pytest.approx(3 * costs.seconds(Kind.FORWARD, 1, 500, rank=0))
    assert costs.take_unreported() == []                 # its own samples went out with the gather
    assert session.microbatches_run == 12                # the most any rank's training call ran
    runtime_composition._gather_measurements(session, layout)
    assert costs.samples(Kind.FORWARD, 1, rank=1) == 3   # nothing learnt twice


def test_the_configs_microbatch_group_size_bounds_the_counts_a_plan_chooses(monkeypatch):
    """With several chunks Megatron accepts a call of m microbatches only when its microbatch_group_size_per_vp_stage
    lies in [P, m]: the plan for a config with a group of 6 at P=2 V=2 chooses among counts >= 6 (the default group,
    P, would allow 2..5 too), and what it chooses is such a count."""
    from megatron_app.runtime.layout import JobLayout

    monkeypatch.setattr(runtime_composition, "job_layout", lambda pg_collection=None: JobLayout(0, 1, 2, 2, False))
    requests = []
    planner = runtime_composition.plan_iteration
    monkeypatch.setattr(runtime_composition, "plan_iteration",
                        lambda request, *a, **k: requests.append(request) or planner(request, *a, **k))
    for group in (None, 6):
        for composition in ("balanced", "packed"):
            plan = runtime_composition.decide_iteration_plan(LENGTHS, 1, composition, microbatch_group_size=group)
            assert plan.replica(0).num_microbatches >= (group or 2)
    default, grouped = requests[0].pipeline, requests[2].pipeline
    assert default.valid_counts(8) == (2, 4, 6, 8) and grouped.valid_counts(8) == (6, 8)
