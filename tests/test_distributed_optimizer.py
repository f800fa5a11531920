"""--use-distributed-optimizer (train/distributed_optimizer.py): the shards, and a checkpoint that resumes under the
same and under another data-parallel size. Its equality with unpipelined training (fp32 with clipping and weight
decay, bf16, fp16's skipped step) is in tests/test_pipeline_equality.py.

One 2-process gloo group (D=2, P=1) trains 8 iterations straight, then 4 with a checkpoint, then resumes it; one
process (D=1) resumes the same checkpoint. Both resumed runs must continue like the uninterrupted one.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers.fork_ranks import free_port
from megatron_app.train.distributed_optimizer import shard_pieces

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")

ITERS, STOP = 8, 4
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "256", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "5e-3", "--seed", "7",
         "--iters", str(ITERS), "--no-trace", "--use-distributed-optimizer",
         "--clip-grad", "1.0", "--weight-decay", "0.01", "--lr-decay-style", "cosine", "--min-lr", "5e-4"]


def test_the_shards_cover_every_element_once_in_order():
    numels = [7, 1, 12, 5, 3]   # 28 elements over 3 ranks: shards of 10, the last padded by 2
    covered = []
    for rank in range(3):
        pieces, size = shard_pieces(numels, rank, 3)
        assert size == 10
        offsets = [piece.offset for piece in pieces]
        assert offsets == sorted(offsets) and offsets[0] == 0
        for piece, following in zip(pieces, pieces[1:]):
            assert following.offset == piece.offset + piece.end - piece.start   # contiguous within the shard
        covered += [(piece.index, element) for piece in pieces for element in range(piece.start, piece.end)]
    assert covered == [(index, element) for index, numel in enumerate(numels) for element in range(numel)]
    assert shard_pieces([3], 3, 4) == ([], 1)   # more replicas than elements: the last holds nothing


def _step_worker(rank, world, port, out_dir):
    """Three clipped AdamW steps of a small module by a DistributedOptimizer over D=2 whose all-gather windows (3
    elements) cut through parameters and whose last shard is padded, against torch's AdamW on the whole module in
    this process."""
    import warnings
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import megatron_app.train.distributed_optimizer as sharded
    from megatron_app.train.init import init_model_parallel
    from megatron_app.train.optim import AdamSettings, Fp32Optimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    init_model_parallel(1, 1, 1, "cpu")
    sharded._WINDOW = 3
    try:
        torch.manual_seed(0)
        modules = [torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3),
                                       torch.nn.Linear(3, 1, bias=False)) for _ in range(2)]
        modules[1].load_state_dict(modules[0].state_dict())
        settings = AdamSettings(lr=0.05, weight_decay=0.1, clip_grad=0.5)
        ours, theirs = sharded.DistributedOptimizer([modules[0]], settings, None), Fp32Optimizer([modules[1]], settings)
        for step in range(3):
            for module in modules:
                for index, param in enumerate(module.parameters()):   # the same gradients on both replicas
                    param.grad = torch.sin(torch.arange(param.numel(), dtype=torch.float32) + step + index
                                           ).reshape(param.shape)
            assert ours.step() and theirs.step()
        worst = max((a - b).abs().max().item() for a, b in zip(modules[0].parameters(), modules[1].parameters()))
        with open(os.path.join(out_dir, f"step_rank{rank}.json"), "w") as handle:
            json.dump({"worst": worst, "held": ours.held_elements(), "numel": ours.numel,
                       "norms": [ours.grad_norm, theirs.grad_norm]}, handle)
    finally:
        dist.destroy_process_group()


def test_the_sharded_step_is_adamws_step_with_the_windows_cutting_through_parameters(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_step_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    results = [json.load(open(tmp_path / f"step_rank{rank}.json")) for rank in range(2)]
    # 18 + 6 + 3 = 27 elements: shards of 14, the second padded by one
    assert [result["held"] for result in results] == [14, 13] and results[0]["numel"] == 27
    for result in results:
        assert result["worst"] <= 1e-7, result
        assert result["norms"][0] == pytest.approx(result["norms"][1], rel=1e-6) and result["norms"][1] > 0.5


def _worker(rank, world, port, out_dir, runs):
    import warnings
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from megatron_app.train.args import parse_args
    from megatron_app.train.loop import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    environ = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    try:
        for name, *extra in runs:
            argv = MODEL + ["--log-json", os.path.join(out_dir, f"{name}.json"),
                            *[os.path.join(out_dir, a[1:]) if str(a).startswith("@") else a for a in extra]]
            train(parse_args([str(a) for a in argv], environ=environ))
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp

    out_dir = str(tmp_path_factory.mktemp("runs"))
    two = [("full", "--save", "@full", "--save-interval", STOP),
           ("stopped", "--save", "@stopped", "--exit-interval", STOP),
           ("resumed", "--load", "@stopped")]
    mp.start_processes(_worker, args=(2, free_port(), out_dir, two), nprocs=2, start_method="spawn")
    one = [("resumed_d1", "--load", "@stopped")]
    mp.start_processes(_worker, args=(1, free_port(), out_dir, one), nprocs=1, start_method="spawn")
    logs = {name: json.load(open(os.path.join(out_dir, f"{name}.json")))
            for name in ("full", "stopped", "resumed", "resumed_d1")}
    return out_dir, logs


def _losses(log):
    return {entry["iteration"]: entry["loss"] for entry in log["iterations"]}


@pytest.mark.slow
def test_the_checkpoint_holds_the_optimizer_unsharded(runs):
    out_dir, logs = runs
    assert logs["full"]["config"]["data_parallel"] == 2
    payload = torch.load(os.path.join(out_dir, "stopped", "iter_0000004", "model_optim_rng_pp000_tp00.pt"),
                         weights_only=True)
    saved = payload["optimizer"]["distributed"]
    numel = sum(value.numel() for value in payload["model"][0].values() if torch.is_tensor(value)
                and torch.is_floating_point(value))
    assert saved["numel"] <= numel and saved["step"] == STOP
    assert "main_params" not in saved   # fp32: the model's own parameters are the main ones, saved with the model
    for name in ("exp_avg", "exp_avg_sq"):
        assert saved[name].shape == (saved["numel"],) and saved[name].dtype == torch.float32
    half = saved["numel"] // 2   # both replicas' shards were gathered: each half has moments
    assert saved["exp_avg_sq"][:half].abs().sum() > 0 and saved["exp_avg_sq"][half:].abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("name,tolerance", [("resumed", 1e-6), ("resumed_d1", 1e-5)])
def test_resume_continues_like_the_uninterrupted_run_under_either_data_parallel_size(runs, name, tolerance):
    """D=2 resumes exactly; D=1 sums each gradient over one replica's microbatches instead of two, so its losses
    differ in the last bits (fp32)."""
    _, logs = runs
    full, stopped, resumed = _losses(logs["full"]), _losses(logs["stopped"]), _losses(logs[name])
    assert sorted(stopped) == list(range(1, STOP + 1)) and all(stopped[i] == full[i] for i in stopped)
    assert logs[name]["config"]["start_iteration"] == STOP
    assert sorted(resumed) == list(range(STOP + 1, ITERS + 1))
    worst = max(abs(resumed[i] - full[i]) / abs(full[i]) for i in resumed)
    assert worst <= tolerance, f"{name}: largest relative loss difference {worst:.2e}"
    assert full[ITERS] < full[1]


def test_a_checkpoint_resumes_only_with_the_optimizer_that_saved_it(tmp_path):
    from megatron_app.train.args import UsageError, parse_args
    from megatron_app.train.checkpoint_manifest import commit, iteration_dir, manifest_for

    world = {"WORLD_SIZE": "1"}
    os.makedirs(iteration_dir(str(tmp_path), 2))
    commit(str(tmp_path), manifest_for(parse_args(["--iters", "2", "--use-distributed-optimizer"], world), 2, 16,
                                       files=[]))
    assert parse_args(["--iters", "4", "--use-distributed-optimizer", "--load", str(tmp_path)], world).load
    with pytest.raises(UsageError, match="was saved with --use-distributed-optimizer; resume with it"):
        parse_args(["--iters", "4", "--load", str(tmp_path)], world)
