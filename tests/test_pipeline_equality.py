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


# Megatron-LM's optimizer flags: clipping (every step clipped here: the norms are ~1), decoupled weight decay and a
# cosine decay of the learning rate. The clip needs the norm over every pipeline and tensor-parallel rank, a
# tensor-parallel duplicate counted once, after the data-parallel all-reduce: each step's norm must be P=1's.
OPTIMIZER_FLAGS = ("--clip-grad 0.3 --weight-decay 0.1 --lr 3e-3 --lr-decay-style cosine --min-lr 3e-4 "
                   "--global-batch-size 16")   # the same global batch at D=2
# The last two: --use-distributed-optimizer (each replica steps its shard of the main parameters, then all-gathers
# them; the norm adds up the shards' squares), at D=2 alone and with the tied embedding split over two stages.
DISTRIBUTED = " --use-distributed-optimizer"
OPTIMIZER_LAYOUTS = [(2, 2, 1, 1, ""), (2, 1, 2, 1, ""), (2, 1, 1, 2, ""), (1, 1, 1, 2, DISTRIBUTED),
                     (2, 1, 1, 2, DISTRIBUTED)]


@pytest.fixture(scope="module")
def optimizer_reference(tmp_path_factory):
    out = _run(tmp_path_factory.mktemp("optimizer_reference"), 1, 1, 1, ["megatron"], extra=OPTIMIZER_FLAGS)
    return _losses_and_grads(out), json.loads((out / "steps_megatron.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T,D,distributed", OPTIMIZER_LAYOUTS,
                         ids=[f"P{p}-V{v}-T{t}-D{d}{'-distributed' if x else ''}"
                              for p, v, t, d, x in OPTIMIZER_LAYOUTS])
def test_clipping_weight_decay_and_lr_schedule_match_unpipelined_training(tmp_path, optimizer_reference, P, V, T, D,
                                                                         distributed):
    (reference, ref_steps) = optimizer_reference
    assert [step["lr"] for step in ref_steps] == pytest.approx([3e-3, 3e-4 + 2.7e-3 * 0.75, 3e-4 + 2.7e-3 * 0.25])
    assert all(step["grad_norm"] > 0.3 for step in ref_steps), ref_steps   # every step clipped
    out = _run(tmp_path, P, V, T, ["app:planned"], D=D, extra=OPTIMIZER_FLAGS + distributed)
    _assert_same(f"P{P} V{V} T{T} D{D} with {OPTIMIZER_FLAGS}{distributed}", _losses_and_grads(out, "app-planned"),
                 reference)
    steps = json.loads((out / "steps_app-planned.json").read_text())
    for it, (step, want) in enumerate(zip(steps, ref_steps), start=1):
        assert step["lr"] == want["lr"], f"iteration {it}: lr {step['lr']} != {want['lr']}"
        assert abs(step["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"], \
            f"iteration {it}: grad norm {step['grad_norm']} != P=1's {want['grad_norm']}"


@pytest.fixture(scope="module")
def optimizer_bf16_reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("optimizer_bf16_reference"), 1, 1, 1, ["megatron"],
                extra=OPTIMIZER_FLAGS + " --bf16")


BF16_OPTIMIZER_LAYOUTS = [(2, 2, 1, ""), (2, 1, 2, DISTRIBUTED)]


@pytest.mark.slow
@pytest.mark.parametrize("P,V,D,distributed", BF16_OPTIMIZER_LAYOUTS,
                         ids=[f"P{p}-V{v}-D{d}{'-distributed' if x else ''}" for p, v, d, x in BF16_OPTIMIZER_LAYOUTS])
def test_bf16_with_clipping_and_a_schedule_matches_unpipelined_bf16(tmp_path, optimizer_bf16_reference,
                                                                    optimizer_reference, P, V, D, distributed):
    """--bf16 with the same optimizer flags, against P=1 in bf16 within the tolerance derived for bf16 below (the
    layouts accumulate main_grad in another order, a few fp32 main parameters then round to other bf16 values). Each
    step's norm: the first within 1e-5 (the same parameters); later ones within 2 E, E = |bf16 - fp32| at P=1 that
    step (the triangle argument of the bf16 section). With --use-distributed-optimizer the bf16 parameters come back
    from the replicas' fp32 shards by the all-gather."""
    extra = OPTIMIZER_FLAGS + " --bf16" + distributed
    bf16_reference = optimizer_bf16_reference
    out = _run(tmp_path, P, V, 1, ["app:planned"], D=D, extra=extra)
    (fp32_losses_and_grads, fp32_steps) = optimizer_reference
    _assert_bf16_close(f"bf16 P{P} V{V} D{D} with " + extra, _losses_and_grads(out, "app-planned"),
                       _losses_and_grads(bf16_reference), fp32_losses_and_grads)
    ref_steps = json.loads((bf16_reference / "steps_megatron.json").read_text())
    steps = json.loads((out / "steps_app-planned.json").read_text())
    assert all(step["grad_norm"] > 0.3 for step in ref_steps), ref_steps   # every step clipped
    for it, (step, want, fp32) in enumerate(zip(steps, ref_steps, fp32_steps), start=1):
        bound = 1e-5 * want["grad_norm"] if it == 1 else 2 * abs(want["grad_norm"] - fp32["grad_norm"])
        assert abs(step["grad_norm"] - want["grad_norm"]) <= bound, \
            f"iteration {it}: grad norm {step['grad_norm']} != P=1's {want['grad_norm']} within {bound:.2e}"


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


# Activation recomputation (Megatron-LM's --recompute-* flags): a layer, or its core attention, rerun in the backward
# pass redraws its forward's dropout (runtime/recompute_randomness.py), so the gradients are those without it. Packed
# and `balanced` microbatches key the masks by document, so a rerun must also know its layer and documents.
# With --split-backward a chunk holding a reentrant checkpoint runs its whole backward as B (runtime/split_backward.py).
RECOMPUTE_ROWS = {"full": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                  "selective": "--recompute-activations",
                  "selective-split-backward": "--recompute-activations --split-backward"}


@pytest.mark.slow
@pytest.mark.parametrize("recompute", RECOMPUTE_ROWS)
def test_recomputed_activations_match_unpipelined_training_without_recomputation(tmp_path, real_corpus,
                                                                                 varlen_dropout_reference, recompute):
    compositions = ["packed", "balanced"]
    out = _run(tmp_path, 2, 2, 1, ["app:planned"], "--compositions", ",".join(compositions), "--dropout", DROPOUT,
               extra=f"{_varlen_flags(real_corpus)} {RECOMPUTE_ROWS[recompute]}")
    for composition in compositions:
        _assert_same(f"recompute {recompute} {composition}", _losses_and_grads(out, f"app-planned_{composition}"),
                     varlen_dropout_reference)


@pytest.mark.slow
def test_recomputation_with_tensor_parallelism_matches_unpipelined_training(tmp_path, real_corpus,
                                                                            varlen_dropout_reference):
    """P=2 T=2: the rerun layers' tensor-parallel collectives run again in the backward pass, and each rank's share of
    the attention dropout must be redrawn as its forward drew it."""
    out = _run(tmp_path, 2, 1, 2, ["app:planned"], "--compositions", "balanced", "--dropout", DROPOUT,
               extra=f"{_varlen_flags(real_corpus)} {RECOMPUTE_ROWS['full']}")
    _assert_same("recompute full P2 T2 balanced", _losses_and_grads(out, "app-planned_balanced"),
                 varlen_dropout_reference)


# A Llama-shaped model (Megatron-LM's flags): RMSNorm, SwiGLU (its fc1 split with stride 2 across tensor-parallel
# ranks), no biases, grouped-query attention and rotary embeddings. The reference pads each document into its own row
# (positions from 0); packed and `balanced` rows hold several documents, so they equal it only if the rotary
# positions restart at every document, and T=2 only if the gated and grouped weights are split as Megatron splits them.
# Its output layer is untied from the embedding, as Llama's is (every other row ties them, Megatron-LM's default).
LLAMA_FLAGS = ("--normalization RMSNorm --swiglu --disable-bias-linear --group-query-attention --num-query-groups 2 "
               "--position-embedding-type rope --untie-embeddings-and-output-weights")
LLAMA_ROWS = [(2, 2, 1, ["packed", "balanced"]), (2, 1, 2, ["balanced"])]


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory, real_corpus):
    out = _run(tmp_path_factory.mktemp("llama_reference"), 1, 1, 1, ["megatron"], "--dropout", DROPOUT,
               extra=f"{_varlen_flags(real_corpus)} {LLAMA_FLAGS}")
    return _losses_and_grads(out)


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T,compositions", LLAMA_ROWS, ids=[f"P{p}-V{v}-T{t}" for p, v, t, _ in LLAMA_ROWS])
def test_a_llama_shaped_model_matches_unpipelined_training(tmp_path, real_corpus, llama_reference, P, V, T,
                                                         compositions):
    out = _run(tmp_path, P, V, T, ["app:planned"], "--compositions", ",".join(compositions), "--dropout", DROPOUT,
               extra=f"{_varlen_flags(real_corpus)} {LLAMA_FLAGS}")
    for composition in compositions:
        _assert_same(f"Llama-shaped P{P} V{V} T{T} {composition}", _losses_and_grads(out, f"app-planned_{composition}"),
                     llama_reference)


# bf16 (--bf16: bf16 parameters, activations and pipeline tensors; fp32 main parameters, main_grad accumulation and
# all-reduce, as Megatron's mixed-precision optimizer does). Pipelining itself changes no arithmetic here but for the
# tied output layer: the same microbatches at P=1 and P=2 V=2 give the same bits untied (measured: identical losses,
# gradients within 3e-8 of their largest entry, fp32 accumulation order); tied, P=1 sums the weight's two uses in bf16
# each microbatch (losses within 4e-6 measured). What changes the bits more is the composition: packed and `balanced` group the
# documents into other microbatches than the P=1 loader's padded ones, so bf16 rounds other partial results.
#
# The tolerance, derived. Let X be the fp32 result (the fp32 reference fixture: exact to ~1e-7), A the bf16 result at
# P=2 V=2 and B the bf16 result at P=1. Both are bf16 evaluations of the same sums that round at different places, so
# |A - B| <= |A - X| + |X - B| (triangle inequality), and each term is what bf16 itself costs: E, measured in the same
# test as |B - X|. Gradients (each tensor's largest difference over its largest entry, as in the fp32 grid): every
# tensor within 2 x E_max, E_max the worst tensor's bf16-vs-fp32 difference; and the median tensor within
# 2 x E_median (so weight matrices, 10x tighter than LayerNorm's, are held to their own scale). Where E comes from:
# the worst tensors are LayerNorm gamma/beta gradients, a sum over every token of the microbatch that torch's CPU
# kernel accumulates in bf16 (measured alone: error 0.65 u x the sum of the terms' magnitudes, u = 2^-8 bf16's unit
# roundoff), with terms that cancel 10-20x, so 6-15 u = 0.025-0.06 of the largest entry; every microbatch's
# gradient is also rounded to bf16 once before the fp32 accumulation, and another grouping rounds other partial sums.
# E itself is bounded, so the tolerance cannot grow with a bf16 bug: E_max <= 2^-3 (32 u).
# The loss is a mean over N >= 512 tokens of fp32 cross-entropies of bf16 logits; one bf16 rounding moves a token's
# loss by at most 2u relative, and independent roundings average: |A - B| / B <= 2u / sqrt(512) = 3.5e-4 (|B - X|
# itself is too small and noisy to scale by: 4e-6..2e-5).
# Measured (2026-11-26, this 2-core CPU, seeds 1234, 7, 99, 2024, and 1234 with dropout 0.1): losses within 2e-7..1.2e-5
# (>= 30x margin); the worst gradient tensor 0.022-0.048 against 2 E_max = 0.051-0.118 (0.27-0.50 of the tolerance),
# the median tensor 4e-5..3.2e-3 against 2 E_median = 0.013-0.016 (<= 0.23); E_max 0.025-0.059 (<= 15 u).
BF16_UNIT_ROUNDOFF = 2.0 ** -8
BF16_LOSS_RTOL = 2 * BF16_UNIT_ROUNDOFF / 512 ** 0.5
BF16_E_MAX_CEILING = 2.0 ** -3


def _grad_errors(got, want):
    """Each tensor's largest difference over its largest entry, by name."""
    return {name: (got[name] - ref).abs().max().item() / (ref.abs().max().item() + 1e-12) for name, ref in want.items()}


def _assert_bf16_close(name, got, reference, fp32_reference):
    """got and reference: bf16 (losses, grads); fp32_reference: the same P=1 run in fp32 (see above)."""
    (losses, grads), (ref_losses, ref_grads), (_, fp32_grads) = got, reference, fp32_reference
    assert len(losses) == ITERS and grads.keys() == ref_grads.keys() == fp32_grads.keys()
    for it, (value, want) in enumerate(zip(losses, ref_losses), start=1):
        assert abs(value - want) <= BF16_LOSS_RTOL * abs(want), \
            f"{name} iteration {it}: loss {value} != bf16 reference {want} within {BF16_LOSS_RTOL:.1e}"
    cost = _grad_errors(ref_grads, fp32_grads)          # E: what bf16 costs at P=1
    e_max, e_median = max(cost.values()), sorted(cost.values())[len(cost) // 2]
    assert 0 < e_max <= BF16_E_MAX_CEILING, f"bf16 P=1 against fp32: worst gradient {e_max:.2e} (ceiling 2^-3)"
    errors = _grad_errors(grads, ref_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2 * e_max, f"{name} {worst}: gradient differs by {errors[worst]:.2e} > 2 E_max {e_max:.2e}"
    median = sorted(errors.values())[len(errors) // 2]
    assert median <= 2 * e_median, f"{name}: median tensor differs by {median:.2e} > 2 E_median {e_median:.2e}"


def _assert_mixed_precision_state(out, name, ranks):
    """Every rank kept bf16 parameters with fp32 main_grad, fp32 main parameters and fp32 Adam state."""
    for rank in range(ranks):
        report = json.loads((out / f"precision_{name}_rank{rank}.json").read_text())
        assert report["model_params"] == ["torch.bfloat16"], report
        for kind in ("main_grads", "main_params", "optimizer_state"):
            assert report[kind] == ["torch.float32"], (kind, report)
        assert report["count"]["main_params"] == report["count"]["model_params"] > 0
        assert report["count"]["optimizer_state"] == 2 * report["count"]["main_params"]   # exp_avg, exp_avg_sq


@pytest.fixture(scope="module")
def varlen_bf16_reference(tmp_path_factory, real_corpus):
    out = _run(tmp_path_factory.mktemp("varlen_bf16_reference"), 1, 1, 1, ["megatron"], "--precision-report",
               extra=_varlen_flags(real_corpus) + " --bf16")
    _assert_mixed_precision_state(out, "megatron", 1)
    return _losses_and_grads(out)


@pytest.fixture(scope="module")
def varlen_bf16_dropout_reference(tmp_path_factory, real_corpus):
    out = _run(tmp_path_factory.mktemp("varlen_bf16_dropout_reference"), 1, 1, 1, ["megatron"], "--dropout", DROPOUT,
               extra=_varlen_flags(real_corpus) + " --bf16")
    return _losses_and_grads(out)


BF16_ROWS = [(["packed", "balanced"], 0.0), (["balanced"], 0.1)]


@pytest.mark.slow
@pytest.mark.parametrize("compositions,dropout", BF16_ROWS,
                         ids=[f"P2-V2-{'+'.join(c)}-dropout{d}" for c, d in BF16_ROWS])
def test_bf16_composed_microbatches_match_unpipelined_bf16_training(request, tmp_path, real_corpus, compositions,
                                                                    dropout):
    """--bf16 at P=2 V=2, packed and `balanced`, against P=1 in bf16 within the tolerance derived above."""
    suffix = "_dropout" if dropout else ""
    reference = request.getfixturevalue(f"varlen_bf16{suffix}_reference")
    fp32_reference = request.getfixturevalue(f"varlen{suffix}_reference")
    out = _run(tmp_path, 2, 2, 1, ["app:planned"], "--compositions", ",".join(compositions), "--dropout", dropout,
               "--precision-report", extra=_varlen_flags(real_corpus) + " --bf16")
    for composition in compositions:
        name = f"app-planned_{composition}"
        _assert_mixed_precision_state(out, name, 2)
        _assert_bf16_close(f"bf16 composition {name} dropout {dropout}", _losses_and_grads(out, name), reference,
                           fp32_reference)


# --fp16 with Megatron's dynamic loss scale, set so that iteration 1 steps (scale 2^18 -> 2^19), iteration 2's
# gradients overflow (skipped everywhere; 2^19 -> 2^18, hysteresis 1) and iteration 3 steps: iteration 3's loss shows
# whether every pipeline rank skipped the same step. Fixed-length microbatches are the same at every layout, so
# pipelining changes no bit and the fp32 grid's tolerance holds. Gradients are dumped before unscaling (x 2^18).
# Untied: with the output layer tied to the embedding, P=1 sums both uses' gradients in one fp16 tensor each
# microbatch and P=2 sums each copy's over the microbatches, then the copies, so fp16 accumulation (Megatron-LM's
# default under --fp16) rounds that one gradient otherwise (8.8e-4 of its largest entry, measured); bf16's rows, whose
# main_grad is fp32, run tied.
FP16_FLAGS = ("--fp16 --initial-loss-scale 262144 --loss-scale-window 1 --hysteresis 1 "
              "--untie-embeddings-and-output-weights")


@pytest.mark.slow
def test_fp16_loss_scaled_pipeline_matches_unpipelined_fp16_training(tmp_path):
    reference = _run(tmp_path, 1, 1, 1, ["megatron"], "--precision-report", extra=FP16_FLAGS)
    out = _run(tmp_path, 2, 2, 1, ["app:planned"], "--precision-report", extra=FP16_FLAGS)
    _assert_same("fp16 app-planned", _losses_and_grads(out, "app-planned"), _losses_and_grads(reference))
    for directory, name, ranks in ((reference, "megatron", 1), (out, "app-planned", 2)):
        for rank in range(ranks):
            report = json.loads((directory / f"precision_{name}_rank{rank}.json").read_text())
            assert report["model_params"] == ["torch.float16"] and report["main_params"] == ["torch.float32"]
            assert report["main_grads"] == ["torch.float16"]     # fp16 accumulates in fp16 unless told (Megatron-LM)
            assert report["skipped_iterations"] == 1 and report["loss_scale"] == 2.0 ** 19, report


@pytest.mark.slow
def test_fp16_distributed_optimizer_replicas_skip_the_same_overflowing_step(tmp_path):
    """D=2 with --use-distributed-optimizer under fp16's dynamic loss scale (FP16_FLAGS: iteration 2 overflows): each
    replica checks only its shard of the gradients, so iteration 3 equals P=1's only if both replicas skipped
    iteration 2. Accumulated and reduced in fp32 here: in fp16 two replicas' sums of 4 microbatches round otherwise
    than one sum of 8 (6.5e-4 of the word embedding's largest gradient, measured), with or without the option."""
    flags = FP16_FLAGS + " --accumulate-allreduce-grads-in-fp32 --global-batch-size 16"
    reference = _run(tmp_path, 1, 1, 1, ["megatron"], "--precision-report", extra=flags)
    out = _run(tmp_path, 1, 1, 1, ["app:planned"], "--precision-report", D=2, extra=flags + DISTRIBUTED)
    _assert_same("fp16 D2 distributed", _losses_and_grads(out, "app-planned"), _losses_and_grads(reference))
    for rank in range(2):
        report = json.loads((out / f"precision_app-planned_rank{rank}.json").read_text())
        assert report["model_params"] == ["torch.float16"] and report["main_params"] == ["torch.float32"]
        assert report["skipped_iterations"] == 1 and report["loss_scale"] == 2.0 ** 19, report


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
    # Beyond three times the grid's tolerance (1e-5), so the grid would fail a layout that dropped dropout. The first
    # iteration's loss moves least: 4.5e-5 with tied embeddings (their initial logits are near zero), 1e-4 untied.
    assert all(abs(a - b) > 3e-5 * abs(b) for a, b in zip(dropout_reference[0], reference[0])), \
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
