"""--composition packed end to end on CPU (P=2 V=2, our runtime, evaluation included), and balanced across two
data-parallel replicas (P=1 D=2: documents move between replicas): a run that stops with a checkpoint and resumes
continues exactly like the uninterrupted run. The data position is whole global batches (consumed samples),
whatever the composition does inside each batch or across replicas.
"""

from __future__ import annotations

import json
import os

import pytest

from test_checkpoint_resume import _free_port, _losses, _validation
from test_preprocess_data import build_tiny_corpus

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*not installed")]

ITERS = 4
STOP = 2
TOLERANCE = 1e-6
MODEL = ["--num-layers", "4", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "5e-3", "--seed", "7", "--iters", str(ITERS), "--eval-interval", str(STOP), "--eval-iters", "1",
         "--no-trace", "--variable-seq-lengths"]
LAYOUTS = {"packed": ["--pipeline_parallel", "2", "--model_chunks", "2", "--composition", "packed"],
           "balanced-D2": ["--pipeline_parallel", "1", "--data_parallel", "2", "--composition", "balanced"]}


def _worker(rank, world, port, out_dir, data_prefix, layout):
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from megatron_app.train.args import parse_args
    from megatron_app.train.loop import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    environ = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}

    def run(name, *extra):
        argv = LAYOUTS[layout] + MODEL + ["--data-path", data_prefix, "--log-json", os.path.join(out_dir, f"{name}.json"), *extra]
        train(parse_args([str(a) for a in argv], environ=environ))

    try:
        run("full")
        stopped = os.path.join(out_dir, "ckpt")
        run("stopped", "--save", stopped, "--exit-interval", STOP)
        run("resumed", "--load", stopped)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, tmp_path_factory):
    import torch.multiprocessing as mp

    from megatron_app.data.preprocess import TokenizerSpec, preprocess

    data_dir = tmp_path_factory.mktemp("data")
    corpus = build_tiny_corpus(data_dir)
    spec = TokenizerSpec(vocab_file=str(corpus["vocab"]), merge_file=str(corpus["merges"]))
    _, prefixes = preprocess(str(corpus["corpus"]), str(data_dir / "tiny"), spec, append_eod=True, workers=2)
    out_dir = str(tmp_path_factory.mktemp("runs"))
    mp.start_processes(_worker, args=(2, _free_port(), out_dir, prefixes["text"], request.param), nprocs=2,
                       start_method="spawn")
    loaded = {name: json.load(open(os.path.join(out_dir, f"{name}.json"))) for name in ("full", "stopped", "resumed")}
    loaded["layout"] = request.param
    return loaded


def test_a_composed_run_resumes_exactly_where_it_stopped(runs):
    full, resumed = _losses(runs["full"]), _losses(runs["resumed"])
    assert runs["full"]["config"]["composition"] == runs["layout"].split("-")[0]
    if runs["layout"] == "balanced-D2":   # one plan for both replicas (documents move when that pays: the
        # equality grid's D=2 rows check they do; these short documents are alike and may stay)
        assert all(len(it["composed"]["replica_microbatches"]) == 2 for it in runs["full"]["iterations"])
    assert runs["resumed"]["config"]["start_iteration"] == STOP
    assert sorted(resumed) == list(range(STOP + 1, ITERS + 1))
    assert all(abs(resumed[i] - full[i]) <= TOLERANCE for i in resumed), (resumed, full)
    assert all(abs(_losses(runs["stopped"])[i] - full[i]) <= TOLERANCE for i in range(1, STOP + 1))
    assert abs(_validation(runs["resumed"])[ITERS] - _validation(runs["full"])[ITERS]) <= TOLERANCE
    assert sorted(_validation(runs["full"])) == [STOP, ITERS]
