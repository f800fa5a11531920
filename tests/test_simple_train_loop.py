"""A user's own loop in the shape of NVIDIA's examples/run_simple_mcore_train_loop.py (Megatron's DDP and config
hooks, model chunks per virtual stage, one data iterator per chunk, get_forward_backward_func after install(),
optimizer step) at P=2 V=2 gives the losses of Megatron's own schedule at P=1 (Megatron's P > 1 schedules need
CUDA)."""

import json

import pytest

from pipeline_runs import HELPERS, torchrun

WORKER = HELPERS / "simple_train_loop_worker.py"


def _losses(tmp_path, name, nproc, flags):
    out = tmp_path / name
    out.mkdir()
    result = torchrun(nproc, [WORKER, *flags, "--out", out])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "losses.json").read_text()), result.stderr


@pytest.mark.slow
def test_nvidia_shaped_loop_at_p2_v2_matches_megatrons_schedule_at_p1(tmp_path):
    """Also with a split backward, where DDP's overlapped reduction is driven by its own hooks: each weight's
    gradient must be registered ready exactly once, by a chunk's last B (LayerNorm, fused biases) or last W."""
    reference, _ = _losses(tmp_path, "p1", 1, ["--pipeline_parallel", 1, "--reference"])
    for name, extra in (("p2v2", []), ("p2v2-split", ["--split-backward"])):
        pipelined, stderr = _losses(tmp_path, name, 2, ["--pipeline_parallel", 2, "--model_chunks", 2, *extra])
        assert len(reference) == len(pipelined) == 3
        for it, (got, want) in enumerate(zip(pipelined, reference), start=1):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name} iteration {it}: {got} != Megatron's {want}"
        assert stderr.count("megatron_app: rank") == 2, "one line per rank says the schedule is active"
    assert len(reference) == len(set(reference)), "the optimizer step changed nothing"
