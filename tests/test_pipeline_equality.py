"""The test that matters most: pipelined training gives the same losses and gradients as unpipelined training.

Same seed, dropout off unless said. Reference: P=1 through Megatron-Core's own forward_backward_no_pipelining. Each layout
(P, V, T) runs every policy and static order in one process group, one after the other, from the same initial
weights; losses of 3 iterations must match within 1e-5 relative and the first iteration's gradients closely.

Variable lengths (--variable-seq-lengths on tools/make_corpus.py's real corpus: one document per sample, each
microbatch padded to its own longest sample, per-token loss): the same comparison at P=2 V=2 and at P=2 with two
data-parallel ranks, and the P=1 result must not depend on how the global batch is cut into microbatches.

Dropout 0.1 too: the masks are keyed by (seed, iteration, microbatch, layer) (runtime/keyed_randomness.py), so no
schedule, P, V or T changes them.
"""

import json

import pytest
import torch

from megatron_app.train.dumps import load_full_grads
from pipeline_runs import HELPERS, forked_ranks

ITERS = 3
WORKER = HELPERS / "schedule_equality_worker.py"


def _run(tmp_path, P, V, T, schedules, *worker_flags, D=1, extra=""):
    out = tmp_path / f"p{P}v{V}t{T}d{D}"
    out.mkdir()
    result = forked_ranks(P * T * D, [WORKER, "--pipeline_parallel", P, "--model_chunks", V, "--tensor_parallel", T,
                                      "--iters", ITERS, "--schedules", ",".join(schedules), "--out", out,
                                      f"--extra={extra}", *worker_flags])   # "=": extra may start with "--"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _losses_and_grads(out, name="megatron"):
    return json.loads((out / f"losses_{name}.json").read_text()), load_full_grads(str(out / f"grads_{name}"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses_and_grads(_run(tmp_path_factory.mktemp("reference"), 1, 1, 1, ["megatron"]))


def _assert_same(name, got, reference):
    (losses, grads), (ref_losses, ref_grads) = got, reference
    assert len(losses) == ITERS
    for it, (value, want) in enumerate(zip(losses, ref_losses), start=1):
        assert abs(value - want) <= 1e-5 * abs(want), f"{name} iteration {it}: loss {value} != reference {want}"
    assert grads.keys() == ref_grads.keys(), f"{name}: parameter sets differ"
    for param, want in ref_grads.items():
        value = grads[param]
        assert value.shape == want.shape, f"{name} {param}: shape {tuple(value.shape)} != {tuple(want.shape)}"
        scale = want.abs().max().item() + 1e-12
        err = (value - want).abs().max().item() / scale
        assert err <= 1e-5, f"{name} {param}: gradient differs by {err:.2e} of its max"


# Tensor parallelism is orthogonal to the order: with it, one non-interleaved and one interleaved layout.
LAYOUTS = [(2, 1, 1), (2, 2, 1), (4, 1, 1), (4, 2, 1), (2, 1, 2), (2, 2, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T", LAYOUTS, ids=[f"P{p}-V{v}-T{t}" for p, v, t in LAYOUTS])
def test_every_schedule_matches_unpipelined_training(tmp_path, reference, P, V, T):
    schedules = ["app:dfc", "app:bfc", "app:adaptive", "app:planned", "interleaved"] + (["1f1b"] if V == 1 else [])
    out = _run(tmp_path, P, V, T, schedules)
    _check_against_reference(out, schedules, reference)


PLANNED_LAYOUTS = [(2, 2, 1), (4, 2, 1), (2, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T", PLANNED_LAYOUTS, ids=[f"P{p}-V{v}-T{t}" for p, v, t in PLANNED_LAYOUTS])
def test_planned_reordering_by_told_lengths_matches_unpipelined_training(tmp_path, reference, P, V, T):
    """The loop tells uneven lengths, so `planned` runs the microbatches in another order (and warm-up depth):
    losses and gradients must not change."""
    schedules = ["app:planned", "app:planned-fixed"]      # with run-time reordering, and the same plans without it
    out = _run(tmp_path, P, V, T, schedules, "--tell-lengths")
    _check_against_reference(out, schedules, reference)
    plans = [line for path in out.glob("plans_app-planned_rank*.jsonl") for line in path.read_text().splitlines()]
    assert len(plans) == P * T * ITERS
    assert any(json.loads(line)[0] != sorted(json.loads(line)[0]) for line in plans), "no iteration was reordered"
    by_iteration = {}
    for path in out.glob("plans_app-planned_rank*.jsonl"):
        for it, line in enumerate(path.read_text().splitlines()):
            by_iteration.setdefault(it, set()).add(line)
    if T == 1:   # with T > 1 each tensor-parallel rank's pipeline plans; its TP leader's decisions are followed
        assert all(len(v) == 1 for v in by_iteration.values()), f"ranks ran different plans: {by_iteration}"


def _check_against_reference(out, schedules, reference):
    for spec in schedules:
        name = spec.replace(":", "-")
        _assert_same(name, _losses_and_grads(out, name), reference)


# Longer than most documents (median 51 tokens) but not all: about a quarter are truncated.
VARLEN_SEQ_LENGTH = 96
VARLEN_GLOBAL_BATCH = 16


def _varlen_flags(corpus, micro_batch_size=2):
    return (f"--variable-seq-lengths --seq-length {VARLEN_SEQ_LENGTH} --global-batch-size {VARLEN_GLOBAL_BATCH} "
            f"--micro-batch-size {micro_batch_size} --data-path {corpus['data_path']} "
            f"--tokenizer-json {corpus['tokenizer_json']}")


@pytest.fixture(scope="module")
def varlen_reference(tmp_path_factory, real_corpus):
    out = _run(tmp_path_factory.mktemp("varlen_reference"), 1, 1, 1, ["megatron"], extra=_varlen_flags(real_corpus))
    return _losses_and_grads(out)


@pytest.mark.slow
def test_variable_length_result_does_not_depend_on_microbatch_size(tmp_path, real_corpus, varlen_reference):
    """Per-token loss: 16 microbatches of one document give what 8 microbatches of two padded documents give."""
    out = _run(tmp_path, 1, 1, 1, ["megatron"], extra=_varlen_flags(real_corpus, micro_batch_size=1))
    _assert_same("P=1 micro-batch-size 1", _losses_and_grads(out), varlen_reference)


VARLEN_LAYOUTS = [(2, 2, 1, 1), (2, 1, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T,D", VARLEN_LAYOUTS, ids=[f"P{p}-V{v}-T{t}-D{d}" for p, v, t, d in VARLEN_LAYOUTS])
def test_variable_length_schedules_match_unpipelined_training(tmp_path, real_corpus, varlen_reference, P, V, T, D):
    schedules = ["app:dfc", "app:bfc", "app:adaptive", "app:planned", "interleaved"] + (["1f1b"] if V == 1 else [])
    out = _run(tmp_path, P, V, T, schedules, D=D, extra=_varlen_flags(real_corpus))
    for spec in schedules:
        name = spec.replace(":", "-")
        _assert_same(f"variable length {name}", _losses_and_grads(out, name), varlen_reference)


# Composition: which documents form each microbatch (--composition; regrouped = this test's own grouping, injected
# by the worker). Per-token loss: any grouping of the global batch's documents, padded or packed, must give P=1's
# losses and gradients on the loader's own padded microbatches; with dropout too, whose masks are keyed by document
# and position (runtime/keyed_randomness.py, train/document_dropout.py), so regrouping moves none.
# With data parallelism `balanced` moves documents between replicas (schedule/iteration_plan.py) and dp-balanced
# deals Megatron-LM's packs across them: the per-token loss over the global batch is the same sum. With tensor
# parallelism every rank must run the one plan the job agreed (runtime/composition.agree_iteration_plan).
# Rows: (P, V, T, D, schedules, compositions, dropout).
COMPOSITION_ROWS = [
    (2, 2, 1, 1, ["app:planned"], ["packed", "balanced", "regrouped", "regrouped-padded"], 0.0),
    (2, 2, 1, 1, ["app:planned"], ["packed", "balanced", "regrouped"], 0.1),
    (4, 2, 1, 1, ["app:planned"], ["balanced"], 0.1),
    (2, 2, 1, 2, ["app:planned"], ["balanced", "dp-balanced"], 0.1),
    (2, 2, 2, 1, ["app:planned"], ["balanced"], 0.1),
    (2, 1, 2, 2, ["app:planned"], ["balanced"], 0.1),
]


@pytest.fixture(scope="module")
def varlen_dropout_reference(tmp_path_factory, real_corpus):
    out = _run(tmp_path_factory.mktemp("varlen_dropout_reference"), 1, 1, 1, ["megatron"], "--dropout", DROPOUT,
               extra=_varlen_flags(real_corpus))
    return _losses_and_grads(out)


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T,D,schedules,compositions,dropout", COMPOSITION_ROWS,
                         ids=[f"P{p}-V{v}-T{t}-D{dp}-{'+'.join(c)}-dropout{d}"
                              for p, v, t, dp, _, c, d in COMPOSITION_ROWS])
def test_composed_microbatches_match_unpipelined_training(request, tmp_path, real_corpus, P, V, T, D, schedules,
                                                          compositions, dropout):
    reference = request.getfixturevalue("varlen_dropout_reference" if dropout else "varlen_reference")
    out = _run(tmp_path, P, V, T, schedules, "--compositions", ",".join(compositions), "--dropout", dropout, D=D,
               extra=_varlen_flags(real_corpus))
    for spec in schedules:
        for composition in compositions:
            name = f"{spec.replace(':', '-')}_{composition}"
            _assert_same(f"composition {name} dropout {dropout}", _losses_and_grads(out, name), reference)
            if D > 1 and composition in ("balanced", "dp-balanced"):   # documents really moved between replicas
                plans = [json.loads(line) for line in (out / f"plans_{name}.jsonl").read_text().splitlines()]
                assert any(plan["cross_replica"] for plan in plans), plans


@pytest.mark.slow
def test_dropout_is_really_on_in_the_composition_grid(varlen_reference, varlen_dropout_reference):
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(varlen_dropout_reference[0], varlen_reference[0]))


DROPOUT = 0.1


@pytest.fixture(scope="module")
def dropout_reference(tmp_path_factory):
    out = _run(tmp_path_factory.mktemp("dropout_reference"), 1, 1, 1, ["megatron"], "--dropout", DROPOUT)
    return _losses_and_grads(out)


DROPOUT_LAYOUTS = [(2, 2, 2)]  # keyed masks: no layout changes them; this one has every dimension but depth


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T", DROPOUT_LAYOUTS, ids=[f"P{p}-V{v}-T{t}" for p, v, t in DROPOUT_LAYOUTS])
def test_with_dropout_every_schedule_matches_unpipelined_training(tmp_path, dropout_reference, P, V, T):
    schedules = ["app:dfc", "app:bfc", "app:adaptive", "interleaved"] + (["1f1b"] if V == 1 else [])
    out = _run(tmp_path, P, V, T, schedules, "--dropout", DROPOUT)
    _check_against_reference(out, schedules, dropout_reference)


@pytest.mark.slow
def test_dropout_is_really_on_in_the_dropout_grid(reference, dropout_reference):
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(dropout_reference[0], reference[0])), \
        (dropout_reference[0], reference[0])


# bfc and Megatron's order with W right after B use no split code that dfc and zb-h1 do not (CI budget)
SPLIT_SCHEDULES = ["app:dfc", "app:adaptive", "app:planned", "zb-h1"]


@pytest.mark.slow
def test_split_backward_every_schedule_matches_unpipelined_training(tmp_path, reference):
    """--split-backward (B now, W later: runtime/split_backward.py) under the policies and ZB-H1, at P=2 V=2 T=2 only:
    the split is per chunk, so one interleaved layout covers it without multiplying the grid; T=2 runs the
    tensor-parallel all-reduce of a deferring linear layer's input gradient."""
    traces = tmp_path / "traces"
    # and torch's interleaved zero-bubble order, run by our runtime from its action lists (--schedule-file)
    from megatron_app.bench.torch_action_lists import action_lists
    from megatron_app.train.args import parse_args

    zero_bubble = tmp_path / "torch_zb.csv"
    microbatches = parse_args(["--pipeline_parallel", "2", "--model_chunks", "2", "--tensor_parallel", "2"],
                              {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}).num_microbatches
    zero_bubble.write_text("\n".join(",".join(row) for row in action_lists("InterleavedZeroBubble", 2, 2,
                                                                            microbatches)) + "\n")
    out = _run(tmp_path, 2, 2, 2, SPLIT_SCHEDULES + [f"file={zero_bubble}"], "--trace-dir", traces,
               extra="--split-backward")
    _check_against_reference(out, SPLIT_SCHEDULES, reference)
    _assert_same("torch's zero-bubble action lists", _losses_and_grads(out, "file"), reference)
    kinds = [json.loads(line).get("kind") for path in traces.rglob("trace_rank*.jsonl")
             for line in path.read_text().splitlines()[1:]]
    assert kinds.count("weight") == kinds.count("backward") > 0     # every B's W ran and was traced
