"""PipelineShape: validation messages (Megatron-Core's interleaving rules) and the dependency graph incl. the wrap."""

import pytest

from megatron_app.schedule import Kind, PipelineShape, ScheduleConfigError, Task

F, B = Kind.FORWARD, Kind.BACKWARD


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_stages=0, num_chunks=1, num_microbatches=4), "num_stages must be >= 1, got 0"),
    (dict(num_stages=2, num_chunks=0, num_microbatches=4), "num_chunks must be >= 1, got 0"),
    (dict(num_stages=2, num_chunks=1, num_microbatches=0), "num_microbatches must be >= 1, got 0"),
    (dict(num_stages=2.0, num_chunks=1, num_microbatches=4), "num_stages must be an int, got 2.0"),
    (dict(num_stages=True, num_chunks=1, num_microbatches=4), "num_stages must be an int, got True"),
    (dict(num_stages=2, num_chunks=1, num_microbatches=4, forward_only="no"), "forward_only must be a bool"),
    (dict(num_stages=1, num_chunks=2, num_microbatches=4),
     "num_chunks=2 needs num_stages > 1: Megatron-Core's interleaved schedule requires"),
    (dict(num_stages=4, num_chunks=2, num_microbatches=3),
     "num_microbatches=3 must be >= num_stages=4 when num_chunks > 1"),
    (dict(num_stages=4, num_chunks=2, num_microbatches=6),
     "num_microbatches=6 leaves a last group of 2 microbatches"),
    (dict(num_stages=2, num_chunks=2, num_microbatches=5, microbatch_group_size=1),
     "microbatch_group_size=1 must lie in [num_stages=2, num_microbatches=5]"),
    (dict(num_stages=2, num_chunks=2, num_microbatches=5, microbatch_group_size=6),
     "microbatch_group_size=6 must lie in [num_stages=2, num_microbatches=5]"),
    (dict(num_stages=3, num_chunks=2, num_microbatches=7, microbatch_group_size=5),
     "num_microbatches=7 leaves a last group of 2 microbatches (num_microbatches % microbatch_group_size=5)"),
    (dict(num_stages=2, num_chunks=1, num_microbatches=4, microbatch_group_size=0),
     "microbatch_group_size must be >= 1, got 0"),
])
def test_bad_shapes_raise_one_clear_sentence(kwargs, message):
    with pytest.raises(ScheduleConfigError) as info:
        PipelineShape(**kwargs)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def _megatron_accepts(P, V, m, N):
    """Megatron-Core 0.16's checks, restated: P > 1 for interleaving, N in [P, m], m % N == 0 or >= P."""
    if V == 1:
        return True
    return P > 1 and P <= N <= m and not (0 < m % N < P)


@pytest.mark.parametrize("P", range(1, 6))
@pytest.mark.parametrize("V", range(1, 4))
def test_acceptance_matches_megatron_rules(P, V):
    for m in range(1, 4 * P + 2):
        for N in [None] + list(range(1, m + 2)):
            expected = _megatron_accepts(P, V, m, P if N is None else N)
            try:
                shape = PipelineShape(P, V, m, microbatch_group_size=N)
            except ScheduleConfigError:
                assert not expected, (P, V, m, N)
            else:
                assert expected, (P, V, m, N)
                assert shape.microbatch_group_size == (P if N is None else N)


def test_non_multiple_microbatches_allowed_with_a_larger_group():
    # Megatron's own docstring example: PP2, VP2, N3, M5.
    shape = PipelineShape(2, 2, 5, microbatch_group_size=3)
    assert shape.num_virtual_stages == 4
    # V == 1 (plain 1F1B) has no microbatch rule at all, even m < P.
    assert PipelineShape(4, 1, 3).num_microbatches == 3


def test_virtual_stage_and_task_lists():
    shape = PipelineShape(4, 3, 8)
    assert [shape.virtual_stage(1, c) for c in range(3)] == [1, 5, 9]
    tasks = shape.tasks(2)
    assert len(tasks) == len(set(tasks)) == 2 * 3 * 8
    assert {t.kind for t in tasks} == {F, B}
    eval_tasks = PipelineShape(4, 3, 8, forward_only=True).tasks(2)
    assert len(eval_tasks) == 3 * 8 and all(t.kind is F for t in eval_tasks)
    with pytest.raises(ScheduleConfigError, match="rank 4 is outside 0..3"):
        shape.tasks(4)
    with pytest.raises(ScheduleConfigError, match="chunk 3 is outside 0..2"):
        shape.virtual_stage(0, 3)


def test_input_sources_follow_the_virtual_stage_chain_with_wrap():
    shape = PipelineShape(3, 2, 6)   # virtual stages 0..5: rank = vs % 3, chunk = vs // 3
    assert shape.input_source(0, Task(F, 0, 1)) is None                  # data
    assert shape.input_source(1, Task(F, 0, 1)) == (0, Task(F, 0, 1))
    assert shape.input_source(0, Task(F, 1, 1)) == (2, Task(F, 0, 1))     # wrap: rank P-1 chunk c-1
    assert shape.input_source(2, Task(F, 1, 3)) == (1, Task(F, 1, 3))
    assert shape.input_source(2, Task(B, 1, 0)) is None                   # loss, computed locally
    assert shape.input_source(1, Task(B, 1, 0)) == (2, Task(B, 1, 0))
    assert shape.input_source(2, Task(B, 0, 0)) == (0, Task(B, 1, 0))     # wrap: rank 0 chunk c+1
    assert shape.output_target(2, Task(F, 0, 2)) == (0, Task(F, 1, 2))
    assert shape.output_target(2, Task(F, 1, 2)) is None
    assert shape.output_target(0, Task(B, 0, 2)) is None
    assert shape.output_target(0, Task(B, 1, 2)) == (2, Task(B, 0, 2))


def test_single_stage_has_no_remote_inputs():
    shape = PipelineShape(1, 1, 3)
    for task in shape.tasks(0):
        assert shape.input_source(0, task) is None
        assert shape.output_target(0, task) is None


@pytest.mark.parametrize("P, V, m, forward_only", [(1, 1, 2, False), (2, 2, 2, False), (4, 3, 4, False),
                                                   (3, 2, 3, True), (8, 4, 8, False)])
def test_output_target_is_the_inverse_of_input_source(P, V, m, forward_only):
    shape = PipelineShape(P, V, m, forward_only=forward_only)
    sources = {}
    for rank in range(P):
        for task in shape.tasks(rank):
            source = shape.input_source(rank, task)
            if source is not None:
                sources[source] = (rank, task)
                assert shape.output_target(*source) == (rank, task)
    targets = {(rank, task) for rank in range(P) for task in shape.tasks(rank)
               if shape.output_target(rank, task) is not None}
    assert targets == set(sources)
    # Every microbatch has exactly one data input (F on vs 0) and, when training, one loss (B on the last vs).
    roots = [(r, t) for r in range(P) for t in shape.tasks(r) if shape.input_source(r, t) is None]
    assert len(roots) == m * (1 if forward_only else 2)


def test_tasks_outside_the_shape_are_rejected():
    shape = PipelineShape(2, 1, 2, forward_only=True)
    with pytest.raises(ScheduleConfigError, match="forward-only shape has no backward"):
        shape.input_source(0, Task(B, 0, 0))
    with pytest.raises(ScheduleConfigError, match="microbatch outside 0..1"):
        shape.output_target(0, Task(F, 0, 2))
    with pytest.raises(ScheduleConfigError, match="chunk outside 0..0"):
        shape.input_source(1, Task(F, 1, 0))
