"""forward_backward_app called exactly as megatron/training/training.py calls it (train_step and evaluate, both
megatron-core ends), and Megatron's rules for the optional arguments. tools/run_tests.sh runs this file under
megatron-core 0.16.1 and, in its second environment, 0.19.2."""

import json

import pytest

from pipeline_runs import HELPERS, forked_ranks

WORKER = HELPERS / "forward_backward_contract_worker.py"
SITES = ("0.16 train_step", "0.16 evaluate", "0.19 train_step", "0.19 evaluate")

# Megatron's choice per "chunk:microbatch" for P=2, m=4, num_microbatches_with_partial_activation_checkpoints=1,
# worked out by hand from schedules.py: forwards numbered k in Megatron's order, full checkpoint iff
# k % (warm-up + 1) >= 1. V=1: warm-up P-rank-1. V=2: warm-up (P-rank-1)*2 + (V-1)*group, order from the table
# (mb0 c0, mb1 c0, mb0 c1, mb1 c1, mb2 c0, mb3 c0, mb2 c1, mb3 c1).
EXPECTED_CHECKPOINT = {
    ("V1", 0): {"0:0": False, "0:1": True, "0:2": False, "0:3": True},
    ("V1", 1): {"0:0": False, "0:1": False, "0:2": False, "0:3": False},
    ("V2", 0): {"0:0": False, "0:1": True, "1:0": True, "1:1": True, "0:2": True, "0:3": False, "1:2": True,
                "1:3": True},
    ("V2", 1): {"0:0": False, "0:1": True, "1:0": True, "1:1": False, "0:2": True, "0:3": True, "1:2": False,
                "1:3": True},
}


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    out = tmp_path_factory.mktemp("contract")
    result = forked_ranks(2, [WORKER, out])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads((out / f"contract_rank{rank}.json").read_text()) for rank in (0, 1)]
    return reports, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["V1", "V2"])
def test_training_py_keyword_sets_train_and_evaluate(contract, layout):
    reports, _ = contract
    for rank, report in enumerate(reports):
        for site in SITES:
            got = report[layout][site]
            if site.endswith("evaluate"):
                assert got["params_with_grad"] == 0, f"rank {rank} {site}: evaluation produced gradients"
            else:
                assert got["params_with_grad"] > 0, f"rank {rank} {site}: training produced no gradients"
    last = reports[1][layout]
    assert all(last[site]["losses"] == 4 for site in SITES), last   # one loss dict per microbatch, last stage


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["V1", "V2"])
def test_megatrons_rules_for_the_optional_arguments(contract, layout):
    reports, _ = contract
    for rank, report in enumerate(reports):
        rules = report[f"{layout} rules"]
        for half in ("only p2p_communicator", "only pg_collection"):
            assert rules[half].endswith("Provide both p2p_communicator and pg_collection, or neither"), rules[half]
        if rules["multi-module"] != "not in this megatron-core" and layout == "V1":
            # Megatron's 1F1B runs it (with variable_seq_lengths); ours does not schedule it, and says so
            assert "multi-module" in rules["multi-module"] and "uninstall" in rules["multi-module"]
        elif rules["multi-module"] != "not in this megatron-core":
            # Megatron's interleaved schedule asserts the collection's tp group first, and so do we
            assert rules["multi-module"] == "ContractAssertionError: pg_collection must have tp", rules
        hook = rules["adjust_tensor_shapes_fn"]
        if layout == "V1":   # Megatron's 1F1B calls it with (recv, send) shapes [(seq, mbs, hidden)]
            assert hook["accepted"] and hook["calls"] == [[[[16, 1, 32]], [[16, 1, 32]]]], hook
        else:                # and its interleaved schedule refuses it
            assert not hook["accepted"] and "interleaved" in hook["error"], hook
        assert rules["checkpoint_activations_microbatch"] == EXPECTED_CHECKPOINT[(layout, rank)]


@pytest.mark.slow
def test_one_line_per_rank_says_the_schedule_is_active(contract):
    _, stderr = contract
    lines = [line for line in stderr.splitlines() if line.startswith("megatron_app: rank")]
    # the worker shuts the runtime down between its two layouts, so each layout announces itself once per rank
    assert len(lines) == 4, lines
    for rank in (0, 1):
        for V, cap in ((1, 2 - rank), (2, 5 - 2 * rank)):
            assert any(f"rank {rank} (pipeline rank {rank}): schedule policy=planned P=2 V={V} memory_cap={cap}" in line
                       for line in lines), lines
