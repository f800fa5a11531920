"""--synthetic-microbatches: real compute on documents of random tokens whose microbatches a file gives (what a cost
curve needs: a range of tokens and of documents per microbatch that a corpus composed by `balanced` never spans)."""

import json

import pytest

from megatron_app.data.synthetic_documents import (SyntheticDocuments, SyntheticPlanError, parse_plan, read_plan,
                                                   sweep_iterations)
from megatron_app.schedule import ScheduleConfigError
from megatron_app.schedule.iteration_plan import PlanRequest, plan_iteration
from megatron_app.train.args import parse_args
from megatron_app.train.flags import UsageError
from pipeline_runs import HELPERS, forked_ranks

PLAN = {"iterations": [[[5, 3], [9], [2, 2]], [[21], [1], [4], [3, 2]], [[6, 6, 6, 3, 1]]]}


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    return path


@pytest.mark.parametrize("data,said", [
    ([], "non-empty list of iterations"),
    ({"iterations": [[]]}, "iteration 1 is not a non-empty list"),
    ({"iterations": [[[3, 0]]]}, "positive integer document lengths"),
    ({"iterations": [[[3, 2.5]]]}, "positive integer document lengths"),
    ({"iterations": [[[3, True]]]}, "positive integer document lengths"),
    ({"iterations": [[[3], [4]], [[5]]]}, "the same number of documents"),
])
def test_a_plan_that_cannot_be_trained_on_says_why(data, said):
    with pytest.raises(SyntheticPlanError, match=said):
        parse_plan(data)


def test_a_bare_list_of_iterations_reads_like_the_object(tmp_path):
    path = tmp_path / "bare.json"
    path.write_text(json.dumps(PLAN["iterations"]))
    assert read_plan(str(path)) == parse_plan(PLAN)
    path.write_text("{not json")
    with pytest.raises(SyntheticPlanError, match="not JSON"):
        read_plan(str(path))


def test_the_sweep_spans_its_token_range_and_every_document_count_with_the_same_batch():
    plan = sweep_iterations(128, 8192, 16, iterations=10, documents_per_iteration=16, seed=3)
    assert plan == sweep_iterations(128, 8192, 16, iterations=10, documents_per_iteration=16, seed=3)
    assert plan.documents_per_iteration == 16 and len(plan.iterations) == 10
    assert {sum(len(m) for m in iteration) for iteration in plan.iterations} == {16}
    low, high = plan.tokens_range
    assert 128 <= low < 400 and 4000 < high <= 8192
    assert {len(m) for iteration in plan.iterations for m in iteration} == {1, 2, 4, 8, 16}
    # equal documents counts come with different squared tokens for the same tokens: the fit can tell them apart
    eights = [m for iteration in plan.iterations for m in iteration if len(m) == 8]
    assert len({round(sum(d * d for d in m) / sum(m) ** 2, 3) for m in eights}) == len(eights)


def test_documents_follow_the_plan_and_every_global_batch_is_grouped_as_given():
    plan = parse_plan(PLAN)
    dataset = SyntheticDocuments(plan, seed=7, vocab_size=50, num_samples=5 * 4)
    assert [dataset.sample_length(i) for i in range(20)] == [5, 3, 9, 2, 2, 21, 1, 4, 3, 2, 6, 6, 6, 3, 1,
                                                              5, 3, 9, 2, 2]
    assert dataset.groups_at(0) == ((0, 1), (2,), (3, 4))
    assert dataset.groups_at(5) == ((0,), (1,), (2,), (3, 4))
    assert dataset.groups_at(15) == ((0, 1), (2,), (3, 4))        # the file's iterations repeat
    with pytest.raises(ValueError):
        dataset.groups_at(3)
    sample = dataset[5]
    assert sample["tokens"].shape == (21,) and sample["labels"][:-1].tolist() == sample["tokens"][1:].tolist()
    assert int(sample["tokens"].max()) < 49                       # below the end-of-document id, as a corpus's
    again = SyntheticDocuments(plan, seed=7, vocab_size=50, num_samples=20)[5]
    other = SyntheticDocuments(plan, seed=8, vocab_size=50, num_samples=20)[5]
    assert again["tokens"].tolist() == sample["tokens"].tolist() != other["tokens"].tolist()


def test_given_microbatches_are_planned_as_given_and_ordered_by_the_planned_policy():
    request = PlanRequest((5, 3, 9, 2, 2), "packed", 1, groups=((0, 1), (2,), (3, 4)), plan_order=True)
    plan = plan_iteration(request)
    assert plan.replica(0).composition.groups == ((0, 1), (2,), (3, 4)) and plan.replica(0).composition.packed
    assert plan.microbatch_tokens(0) == (8, 9, 4) and plan.replica(0).plan is not None
    for wrong in (dict(composition="loader"), dict(num_replicas=5)):
        with pytest.raises(ScheduleConfigError, match="given microbatches are packed on one replica"):
            plan_iteration(PlanRequest((5, 3, 9, 2, 2), wrong.get("composition", "packed"), 1,
                                       num_replicas=wrong.get("num_replicas", 1), groups=((0, 1), (2,), (3, 4))))
    with pytest.raises(ScheduleConfigError, match="once each"):
        plan_iteration(PlanRequest((5, 3, 9, 2, 2), "packed", 1, groups=((0, 1), (2,), (3,))))


def test_the_flag_takes_its_batch_from_the_file_and_implies_packed_variable_lengths(plan_file):
    args = parse_args(["--synthetic-microbatches", str(plan_file), "--micro-batch-size", "1"])
    assert args.global_batch_size == 5 and args.variable_seq_lengths and args.composition == "packed"
    assert args.calculate_per_token_loss and args.synthetic_plan.documents_per_iteration == 5


@pytest.mark.parametrize("flags,world,said", [
    (["--global-batch-size", "10"], 1, "hold 5 documents, not --global-batch-size 10"),
    (["--seq-length", "16"], 1, "a document of 21 tokens is longer than --seq-length 16"),
    (["--data-path", "corpus"], 1, "drop --data-path"),
    (["--composition", "balanced"], 1, "drop --composition balanced"),
    (["--eval-interval", "2"], 1, "drop --eval-interval"),
    (["--pipeline_parallel", "4", "--model_chunks", "2", "--num-layers", "8"], 4, "iteration 1's 3 microbatches"),
    ([], 2, "one replica's microbatches: run it with data_parallel 1 \\(got 2\\)"),
])
def test_a_flag_the_file_contradicts_is_refused_in_one_line(plan_file, flags, world, said):
    with pytest.raises(UsageError, match=said):
        parse_args(["--synthetic-microbatches", str(plan_file), "--micro-batch-size", "1", *flags],
                   environ={"WORLD_SIZE": str(world), "MASTER_ADDR": "x"} if world > 1 else {})


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="cannot read it"):
        parse_args(["--synthetic-microbatches", str(tmp_path / "absent.json")])


@pytest.mark.slow
def test_pipelined_training_on_given_microbatches_equals_unpipelined_with_dropout(tmp_path):
    """P=2 V=2 under our runtime (the planned policy orders the given microbatches) against P=1 under Megatron's
    schedule, dropout 0.1, three iterations of 1..4 documents a microbatch: the same losses and gradients."""
    from test_pipeline_equality import _assert_same, _losses_and_grads

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"iterations": [[[40, 3], [64], [9, 9, 9, 9], [17]],
                                               [[2, 2], [50, 14], [30], [7, 7, 8]],
                                               [[61], [1], [33, 3, 3], [20, 20, 3]]]}))
    extra = f"--synthetic-microbatches {path} --seq-length 64 --micro-batch-size 1"
    outs = {}
    for P, V, schedule in ((1, 1, "megatron"), (2, 2, "app:planned")):
        outs[P] = tmp_path / f"p{P}"
        outs[P].mkdir()
        result = forked_ranks(P, [HELPERS / "schedule_equality_worker.py", "--pipeline_parallel", P, "--model_chunks",
                                  V, "--iters", 3, "--schedules", schedule, "--out", outs[P], "--dropout", 0.1,
                                  f"--extra={extra}"])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reference = _losses_and_grads(outs[1], "megatron")
    _assert_same("synthetic P=2 V=2", _losses_and_grads(outs[2], "app-planned"), reference)
    plans = [json.loads(line) for line in (outs[2] / "plans_app-planned.jsonl").read_text().splitlines()]
    assert [plan["microbatch_tokens"] for plan in plans] == [[43, 64, 36, 17], [4, 64, 30, 22], [61, 1, 39, 43]]
