"""The equality grid's P=2 V=2 rows on CUDA: padded (loader), packed and balanced, dropout 0.1, fp32 and bf16, and
full activation recomputation at P=2 V=2 against P=1 without it; the ranks share one GPU (gloo). Same rows, flags
and tolerances as tools/gpu_check.py's equality step, which states how each tolerance was derived; skipped without
CUDA."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
gpu_check = sys.modules.setdefault("gpu_check", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(gpu_check)

ROWS = ["loader-fp32-dropout", "packed-fp32-dropout", "balanced-fp32-dropout", "balanced-bf16-dropout",
        "balanced-bf16-dropout-recompute"]


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    return gpu_check.Check(tmp_path_factory.mktemp("cuda_equality"), gpu_check.GPU, sys.executable)


@pytest.mark.cuda
@pytest.mark.training
@pytest.mark.parametrize("row", ROWS)
def test_pipelined_training_on_cuda_equals_unpipelined(check, row):
    reference_flags = check.sizes.equality_model + gpu_check.equality_flags(gpu_check.reference_row(row),
                                                                             check.corpus())
    reference = check.train(f"{row}-p1", 1, 1, reference_flags, check.sizes.equality_iters)
    flags = check.sizes.equality_model + gpu_check.equality_flags(row, check.corpus())
    pipelined = check.train(f"{row}-p2v2", 2, 2, flags, check.sizes.equality_iters)
    assert reference["rc"] == 0 and pipelined["rc"] == 0, (reference["tail"], pipelined["tail"])
    a = [it["loss"] for it in reference["json"]["iterations"]]
    b = [it["loss"] for it in pipelined["json"]["iterations"]]
    tolerance = gpu_check.tolerance_of(row, "cuda")
    assert len(a) == len(b) == check.sizes.equality_iters
    assert all(abs(x - y) <= tolerance * abs(x) for x, y in zip(a, b)), (a, b, tolerance)


@pytest.mark.cuda
@pytest.mark.training
def test_the_distributed_optimizer_on_cuda_equals_unpipelined(check):
    """--use-distributed-optimizer at D=2, both replicas on the one GPU (gloo: the shards' all-gather and the
    checkpoint's gather of device tensors), bf16 with Megatron-LM's optimizer defaults, against P=1 without it
    (dropout off: the replicas' microbatches are not P=1's)."""
    flags = [*check.sizes.equality_model, *gpu_check.equality_flags("mock-bf16-optim", check.corpus()),
             "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
    iters = check.sizes.equality_iters
    reference = check.train("distributed-optimizer-p1", 1, 1, flags, iters)
    sharded = check.train("distributed-optimizer-d2", 1, 1, [
        *flags, "--data_parallel", "2", "--use-distributed-optimizer",
        "--save", str(check.work / "distributed-optimizer-checkpoint"), "--save-interval", str(iters)], iters)
    assert reference["rc"] == 0 and sharded["rc"] == 0, (reference["tail"], sharded["tail"])
    a = [it["loss"] for it in reference["json"]["iterations"]]
    b = [it["loss"] for it in sharded["json"]["iterations"]]
    tolerance = gpu_check.tolerance_of("mock-bf16-optim", "cuda")
    assert len(a) == len(b) == iters
    assert all(abs(x - y) <= tolerance * abs(x) for x, y in zip(a, b)), (a, b, tolerance)
