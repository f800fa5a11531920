"""Megatron-Core's own schedule unit tests (tests/unit_tests/pipeline_parallel/test_schedules.py, core_v0.19.0),
their calls and expectations, made against megatron_app.install() on 8 gloo ranks (one spawn,
tests/helpers/megatron_schedule_tests_worker.py): the function get_forward_backward_func returns, the forward-only
losses, interleaving with even and uneven chunks, explicit process groups whose pipeline group is not
parallel_state's, and every refusal of the three schedule functions, each also made to Megatron's own function.
tools/run_tests.sh runs this file under megatron-core 0.16.1 and, in its second environment, 0.19.2."""

import json

import pytest

from pipeline_runs import HELPERS, forked_ranks

WORKER = HELPERS / "megatron_schedule_tests_worker.py"
WORLD = 8


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("schedule_tests")
    result = forked_ranks(WORLD, [WORKER, out], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [json.loads((out / f"schedule_tests_rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.slow
def test_get_forward_backward_func_returns_our_entry_point_for_each_layout(reports):
    for rank, report in enumerate(reports):
        assert report["installed"], "install() left one of Megatron's schedule functions in place"
        assert report["selection"] and all(report["selection"].values()), (rank, report["selection"])


CALLS = {   # name: number of microbatches (Megatron's tests: one loss dict per microbatch, {'loss_reduced': rank})
    "no pipelining T=2": 4, "no pipelining, explicit groups": 4, "no pipelining, p2p_communicator alone (unused)": 4,
    "1F1B T=2 P=4": 8, "1F1B T=2 P=4, explicit groups": 8,
    "interleaved P=4 V=2": 8, "interleaved P=4 V=2, after the refusal": 8,
    "uneven interleaved P=4 V=2": 8, "uneven interleaved P=4 V=2, after the refusal": 8,
    "interleaved P=4 V=2, explicit groups": 8, "interleaved P=4 V=2, parallel_state's groups again": 8,
}


@pytest.mark.slow
@pytest.mark.parametrize("call", sorted(CALLS))
def test_forward_only_losses_are_the_last_stages_rank_per_microbatch(reports, call):
    last_stages = []
    for rank, report in enumerate(reports):
        got = report["calls"][call]
        if got["last_stage"]:
            last_stages.append(rank)
            assert got["losses"] == [rank] * CALLS[call], (rank, got)
        else:
            assert got["losses"] == [], (rank, got)
    assert len(last_stages) == (WORLD if call.startswith("no pipelining") else 2), last_stages


@pytest.mark.slow
def test_explicit_groups_give_the_default_calls_losses(reports):
    assert all(report["1F1B explicit equals default"] for report in reports)


@pytest.mark.slow
def test_one_process_serves_calls_on_two_pipeline_groups(reports):
    """The grid's pipeline group is another set of ranks than parallel_state's: each has its own transport."""
    for rank, report in enumerate(reports):
        groups = report["pipeline groups"]
        assert rank in groups["grid"] and rank in groups["parallel_state"]
        assert set(groups["grid"]) != set(groups["parallel_state"]), groups
        assert report["open transports"] == 2, (rank, report["open transports"])


def _refusal_cases():
    return [
        "no pipelining: two model chunks", "no pipelining: two data iterators",
        "no pipelining: adjust_tensor_shapes_fn", "no pipelining: pg_collection without tp",
        "1F1B: two model chunks", "1F1B: two data iterators", "1F1B: overlap_p2p_comm",
        "1F1B: p2p_communicator alone", "1F1B: pg_collection alone", "1F1B: a communicator without config",
        "1F1B: a pg_collection of another type without tp", "1F1B: two model chunks before the groups",
        "interleaved P=4 V=2: 7 microbatches, 2 data iterator(s)",
        "uneven interleaved P=4 V=2: 7 microbatches, 1 data iterator(s)",
        "interleaved: group size above the microbatches", "interleaved: group size below the pipeline",
        "interleaved: fewer microbatches than stages, one chunk", "interleaved: adjust_tensor_shapes_fn",
        "interleaved: model chunks as a tuple", "interleaved: a chunk that is no Module",
        "interleaved: one data iterator, not a list", "interleaved: overlap_p2p_comm with batch_p2p_comm",
        "interleaved: p2p_communicator alone", "interleaved: pg_collection alone",
        "interleaved: groups before adjust_tensor_shapes_fn", "interleaved: adjust_tensor_shapes_fn before the counts",
        "interleaved: pg_collection without tp", "interleaved: pg_collection without embd, 7 microbatches",
    ]


@pytest.mark.slow
def test_every_refusal_case_was_made(reports):
    assert sorted(reports[0]["refusals"]) == sorted(_refusal_cases())


@pytest.mark.slow
@pytest.mark.parametrize("case", _refusal_cases())
def test_we_refuse_what_megatron_refuses_with_its_exception_type(reports, case):
    """Megatron's function refuses the call in its own check (not deeper, not by accident of the CPU); ours refuses
    it with an exception of that class, in one line, that is also a ValueError (our AppConfigError)."""
    for rank, report in enumerate(reports):
        made = report["refusals"][case]
        megatron, ours = made["megatron"], made["ours"]
        assert megatron is not None, f"rank {rank}: Megatron accepted {case!r}"
        assert megatron["raised_in"] == ["schedules.py", made["function"]], (rank, megatron)
        assert ours is not None, f"rank {rank}: ours accepted {case!r}; Megatron raised {megatron}"
        assert megatron["type"] in ours["classes"], (rank, case, megatron["type"], ours)
        assert "ValueError" in ours["classes"] and "AppConfigError" in ours["classes"], ours
        assert ours["message"] and "\n" not in ours["message"], ours
