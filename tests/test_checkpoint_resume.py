"""End to end on CPU, P=2 V=2 through the app schedule: preprocess a corpus with a BPE trained here -> train 20
iterations with evaluation (a cosine learning rate after a warm-up, clipping, weight decay) -> a second run stops at 10
with a checkpoint -> a third resumes it and must continue exactly like the uninterrupted run (losses, validation loss
and final weights within 1e-6).

One 2-process gloo group runs the three trainings in turn (megatron imported once per process).
"""

from __future__ import annotations

import json
import math
import os
import socket

import pytest
import torch

from test_preprocess_data import build_tiny_corpus

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*not installed")]

ITERS = 20
STOP = 10
EVAL_INTERVAL = 10
TOLERANCE = 1e-6
MODEL = ["--pipeline_parallel", "2", "--model_chunks", "2", "--num-layers", "4", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "5e-3", "--seed", "7", "--iters", str(ITERS), "--eval-interval", str(EVAL_INTERVAL),
         "--eval-iters", "2", "--no-trace",
         # Megatron-LM's optimizer flags: the schedule's place and the clipped AdamW state must resume too
         "--clip-grad", "1.0", "--weight-decay", "0.01", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
         "--min-lr", "5e-4"]


def _fake_crashed_save(save_dir, iteration):
    """What a crash between writing rank files and the manifest leaves behind."""
    from megatron_app.train.checkpoint_manifest import iteration_dir, rank_file_name

    directory = iteration_dir(save_dir, iteration)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, rank_file_name(0, 0)), "wb") as handle:
        handle.write(b"half a file")


def _worker(rank, world, port, out_dir, data_prefix):
    import warnings
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from megatron_app.train.args import parse_args
    from megatron_app.train.loop import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    environ = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}

    def run(name, *extra):
        argv = MODEL + ["--data-path", data_prefix, "--log-json", os.path.join(out_dir, f"{name}.json"), *extra]
        train(parse_args([str(a) for a in argv], environ=environ))

    try:
        run("full", "--save", os.path.join(out_dir, "ckpt_full"), "--save-interval", STOP)
        stopped = os.path.join(out_dir, "ckpt_stopped")
        run("stopped", "--save", stopped, "--exit-interval", STOP)
        if rank == 0:
            _fake_crashed_save(stopped, STOP + 5)
        dist.barrier()
        run("resumed", "--load", stopped, "--save", stopped)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp

    from megatron_app.data.preprocess import TokenizerSpec, preprocess

    data_dir = tmp_path_factory.mktemp("data")
    corpus = build_tiny_corpus(data_dir)
    spec = TokenizerSpec(vocab_file=str(corpus["vocab"]), merge_file=str(corpus["merges"]))
    _, prefixes = preprocess(str(corpus["corpus"]), str(data_dir / "tiny"), spec, append_eod=True, workers=2)
    out_dir = str(tmp_path_factory.mktemp("runs"))
    mp.start_processes(_worker, args=(2, _free_port(), out_dir, prefixes["text"]), nprocs=2, start_method="spawn")
    logs = {name: json.load(open(os.path.join(out_dir, f"{name}.json"))) for name in ("full", "stopped", "resumed")}
    return out_dir, logs


def _losses(log):
    return {entry["iteration"]: entry["loss"] for entry in log["iterations"]}


def _validation(log):
    return {entry["iteration"]: entry["loss"] for entry in log["validation"]}


def test_training_on_preprocessed_data_learns(runs):
    _, logs = runs
    full = logs["full"]
    assert full["config"]["vocab_size"] == 384  # the BPE's 300 ids, padded like Megatron
    losses = [_losses(full)[i] for i in range(1, ITERS + 1)]
    assert losses[0] == pytest.approx(math.log(384), abs=0.1)  # ~uniform at initialisation
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0
    validation = _validation(full)
    assert sorted(validation) == [10, 20]
    assert validation[20] < validation[10] < losses[0]


def test_a_stopped_run_matches_the_full_run_up_to_its_checkpoint(runs):
    out_dir, logs = runs
    full, stopped = _losses(logs["full"]), _losses(logs["stopped"])
    assert sorted(stopped) == list(range(1, STOP + 1))
    assert all(abs(stopped[i] - full[i]) <= TOLERANCE for i in stopped)
    manifest = json.load(open(os.path.join(out_dir, "ckpt_stopped", "iter_0000010", "manifest.json")))
    assert manifest["iteration"] == STOP and manifest["consumed_samples"] == STOP * 8
    assert manifest["layout"] == {"pipeline_parallel": 2, "model_chunks": 2, "tensor_parallel": 1, "data_parallel": 1}


def test_resume_continues_exactly_like_the_uninterrupted_run(runs):
    out_dir, logs = runs
    full, resumed = _losses(logs["full"]), _losses(logs["resumed"])
    assert logs["resumed"]["config"]["start_iteration"] == STOP   # the unfinished save at 15 was passed over
    assert sorted(resumed) == list(range(STOP + 1, ITERS + 1))
    worst = max(abs(resumed[i] - full[i]) for i in resumed)
    assert worst <= TOLERANCE, f"largest loss difference {worst}"
    assert abs(_validation(logs["resumed"])[20] - _validation(logs["full"])[20]) <= TOLERANCE
    # Same final weights and optimizer state as the uninterrupted run's last checkpoint.
    for name in ("model_optim_rng_pp000_tp00.pt", "model_optim_rng_pp001_tp00.pt"):
        a = torch.load(os.path.join(out_dir, "ckpt_full", "iter_0000020", name), weights_only=True)
        b = torch.load(os.path.join(out_dir, "ckpt_stopped", "iter_0000020", name), weights_only=True)
        for chunk_a, chunk_b in zip(a["model"], b["model"]):
            assert chunk_a.keys() == chunk_b.keys()
            for key in chunk_a:
                if torch.is_tensor(chunk_a[key]):
                    assert torch.allclose(chunk_a[key], chunk_b[key], rtol=0, atol=TOLERANCE), key
        steps = {int(state["step"]) for state in b["optimizer"]["state"].values()}
        assert steps == {ITERS}
