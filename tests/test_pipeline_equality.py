"""The test that matters most: pipelined training gives the same losses and gradients as unpipelined training.

Same seed, dropout off. Reference: P=1 through Megatron-Core's own forward_backward_no_pipelining. Each layout
(P, V, T) runs every policy and static order in one process group, one after the other, from the same initial
weights; losses of 3 iterations must match within 1e-5 relative and the first iteration's gradients closely.
"""

import json

import pytest
import torch

from megatron_app.train.dumps import load_full_grads
from pipeline_runs import HELPERS, torchrun

ITERS = 3
WORKER = HELPERS / "schedule_equality_worker.py"


def _run(tmp_path, P, V, T, schedules, *extra):
    out = tmp_path / f"p{P}v{V}t{T}"
    out.mkdir()
    result = torchrun(P * T, [WORKER, "--pipeline_parallel", P, "--model_chunks", V, "--tensor_parallel", T,
                              "--iters", ITERS, "--schedules", ",".join(schedules), "--out", out, *extra])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = _run(tmp_path_factory.mktemp("reference"), 1, 1, 1, ["megatron"])
    losses = json.loads((out / "losses_megatron.json").read_text())
    return losses, load_full_grads(str(out / "grads_megatron"))


LAYOUTS = [(2, 1, 1), (2, 2, 1), (4, 1, 1), (4, 2, 1), (2, 1, 2), (2, 2, 2), (4, 1, 2), (4, 2, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T", LAYOUTS, ids=[f"P{p}-V{v}-T{t}" for p, v, t in LAYOUTS])
def test_every_schedule_matches_unpipelined_training(tmp_path, reference, P, V, T):
    ref_losses, ref_grads = reference
    schedules = ["app:dfc", "app:bfc", "app:adaptive", "app:planned", "interleaved"] + (["1f1b"] if V == 1 else [])
    out = _run(tmp_path, P, V, T, schedules)
    _check_against_reference(out, schedules, reference)


PLANNED_LAYOUTS = [(2, 2, 1), (4, 2, 1), (2, 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T", PLANNED_LAYOUTS, ids=[f"P{p}-V{v}-T{t}" for p, v, t in PLANNED_LAYOUTS])
def test_planned_reordering_by_told_lengths_matches_unpipelined_training(tmp_path, reference, P, V, T):
    """The loop tells uneven lengths, so `planned` runs the microbatches in another order (and warm-up depth):
    losses and gradients must not change."""
    out = _run(tmp_path, P, V, T, ["app:planned"], "--tell-lengths")
    _check_against_reference(out, ["app:planned"], reference)
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
    ref_losses, ref_grads = reference
    for spec in schedules:
        name = spec.replace(":", "-")
        losses = json.loads((out / f"losses_{name}.json").read_text())
        assert len(losses) == ITERS
        for it, (got, want) in enumerate(zip(losses, ref_losses), start=1):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name} iteration {it}: loss {got} != reference {want}"
        grads = load_full_grads(str(out / f"grads_{name}"))
        assert grads.keys() == ref_grads.keys(), f"{name}: parameter sets differ"
        for param, want in ref_grads.items():
            got = grads[param]
            assert got.shape == want.shape, f"{name} {param}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            scale = want.abs().max().item() + 1e-12
            err = (got - want).abs().max().item() / scale
            assert err <= 1e-5, f"{name} {param}: gradient differs by {err:.2e} of its max"
