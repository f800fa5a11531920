"""The test that matters most: pipelined training gives the same losses and gradients as unpipelined training.

Same seed. Reference: P=1 through Megatron-Core's own forward_backward_no_pipelining. Each layout (P, V, T) runs
every policy and static order in one process group, one after the other, from the same initial weights; losses of
3 iterations must match within 1e-5 relative and the first iteration's gradients closely. With dropout 0.1 too:
the masks are keyed by (seed, iteration, microbatch, layer) (runtime/keyed_randomness.py), so no schedule, P, V or
T changes them.
"""

import json

import pytest
import torch

from megatron_app.train.dumps import load_full_grads
from pipeline_runs import HELPERS, torchrun

ITERS = 3
WORKER = HELPERS / "schedule_equality_worker.py"


def _run(tmp_path, P, V, T, schedules, dropout=0.0):
    out = tmp_path / f"p{P}v{V}t{T}"
    out.mkdir()
    result = torchrun(P * T, [WORKER, "--pipeline_parallel", P, "--model_chunks", V, "--tensor_parallel", T,
                              "--iters", ITERS, "--schedules", ",".join(schedules), "--out", out,
                              "--dropout", dropout])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _reference(tmp_path_factory, dropout):
    out = _run(tmp_path_factory.mktemp("reference"), 1, 1, 1, ["megatron"], dropout)
    losses = json.loads((out / "losses_megatron.json").read_text())
    return losses, load_full_grads(str(out / "grads_megatron"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory, 0.0)


DROPOUT = 0.1


@pytest.fixture(scope="module")
def dropout_reference(tmp_path_factory):
    return _reference(tmp_path_factory, DROPOUT)


LAYOUTS = [(2, 1, 1), (2, 2, 1), (4, 1, 1), (4, 2, 1), (2, 1, 2), (2, 2, 2), (4, 1, 2), (4, 2, 2)]


def _check_layout(tmp_path, reference, P, V, T, dropout=0.0):
    ref_losses, ref_grads = reference
    schedules = ["app:dfc", "app:bfc", "app:adaptive", "interleaved"] + (["1f1b"] if V == 1 else [])
    out = _run(tmp_path, P, V, T, schedules, dropout)
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


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T", LAYOUTS, ids=[f"P{p}-V{v}-T{t}" for p, v, t in LAYOUTS])
def test_every_schedule_matches_unpipelined_training(tmp_path, reference, P, V, T):
    _check_layout(tmp_path, reference, P, V, T)


DROPOUT_LAYOUTS = [(2, 2, 2), (4, 1, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("P,V,T", DROPOUT_LAYOUTS, ids=[f"P{p}-V{v}-T{t}" for p, v, t in DROPOUT_LAYOUTS])
def test_with_dropout_every_schedule_matches_unpipelined_training(tmp_path, dropout_reference, P, V, T):
    _check_layout(tmp_path, dropout_reference, P, V, T, DROPOUT)


@pytest.mark.slow
def test_dropout_is_really_on_in_the_dropout_grid(reference, dropout_reference):
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(dropout_reference[0], reference[0])), \
        (dropout_reference[0], reference[0])
