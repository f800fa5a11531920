"""End-to-end runs of megatron_app.train on CPU with gloo (world sizes 1 and 2).

The reference is Megatron's own forward_backward_no_pipelining (--schedule megatron, P=1). Other
layouts must reproduce its losses and gradients; initial weights must be bit-identical.
"""

import json
import os
import re
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small enough for 2 cores; P*V = 4 divides the layers and P = 2 divides m = 8 / 2 = 4.
MODEL_FLAGS = {
    "--num-layers": 4, "--hidden-size": 32, "--num-attention-heads": 4, "--seq-length": 32,
    "--vocab-size": 256, "--micro-batch-size": 2, "--global-batch-size": 8, "--seed": 7,
}
ITERS = 10
LR = 5e-3


def _flags(extra=()):
    argv = [str(item) for pair in MODEL_FLAGS.items() for item in pair]
    return argv + ["--iters", str(ITERS), "--lr", str(LR), "--schedule", "megatron", *map(str, extra)]


def _run_cli(out_dir):
    """One-process CLI run (no launcher): returns (JSON log, grads dir, weights dir, stdout)."""
    log, grads, weights = out_dir / "log.json", out_dir / "grads", out_dir / "weights"
    argv = _flags() + ["--log-json", log, "--dump-grads", grads, "--dump-weights", weights, "--no-trace"]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    for launcher_variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(launcher_variable, None)
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", *map(str, argv)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(log.read_text()), str(grads), str(weights), result.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """P=1 through Megatron's forward_backward_no_pipelining: (log, grads dir, weights dir, stdout)."""
    return _run_cli(tmp_path_factory.mktemp("reference"))


def _losses(payload):
    return [entry["loss"] for entry in payload["iterations"]]


def _assert_same_losses(got, want, rel=1e-5):
    assert len(got) == len(want) == ITERS
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rel * abs(b), f"iteration {i + 1}: {a} vs {b}"


def _assert_same_grads(got, want, rel=1e-4):
    from megatron_app.train.dumps import load_full_grads

    got, want = load_full_grads(got), load_full_grads(want)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        scale = want[name].abs().max().item()
        assert scale > 0, f"{name} has an all-zero gradient"
        assert (got[name] - want[name]).abs().max().item() <= rel * scale, name


def test_reference_loss_falls_and_log_is_complete(reference):
    payload, _, _, stdout = reference
    assert payload["schema"] == "megatron_app.train.log/1"
    lines = [line for line in stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == ITERS
    assert re.fullmatch(r"iter 3/10 \| loss \d+\.\d{4} \| \d+\.\d ms \| \d+ tokens/s", lines[2])
    losses = _losses(payload)
    assert payload["config"]["num_microbatches"] == 4
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.1)  # ~uniform at init
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    assert losses[-1] < losses[0]
    assert len([line for line in stdout.splitlines() if "peak memory in iteration 1:" in line]) == 1
    for entry in payload["iterations"]:
        assert entry["time_ms"] > 0 and entry["peak_memory_mib"] > 0
        assert entry["tokens_per_s"] == pytest.approx(8 * 32 / (entry["time_ms"] / 1e3))


# ----------------------------------------------------------------------------------------------
# One 2-process gloo group (megatron imported once) runs: initial weights of three layouts, chunk
# structure, one pipelined iteration (P=2, V=2) driven through Megatron's forward_step/backward_step
# with our forward_step, and full training runs at T=2 and at D=2 through train() with CLI flags.

LAYOUTS = {  # name: (P, V, T)
    "p2v2": (2, 2, 1),
    "t2": (1, 1, 2),
    "d2": (1, 1, 1),
}


def _model_args(P, V, T, D):
    return SimpleNamespace(
        num_layers=MODEL_FLAGS["--num-layers"], hidden_size=MODEL_FLAGS["--hidden-size"],
        num_attention_heads=MODEL_FLAGS["--num-attention-heads"], seq_length=MODEL_FLAGS["--seq-length"],
        vocab_size=MODEL_FLAGS["--vocab-size"], micro_batch_size=MODEL_FLAGS["--micro-batch-size"],
        global_batch_size=MODEL_FLAGS["--global-batch-size"], seed=MODEL_FLAGS["--seed"],
        pipeline_parallel=P, model_chunks=V, tensor_parallel=T, data_parallel=D, iters=1,
        data_path=None, device="cpu",
        num_microbatches=MODEL_FLAGS["--global-batch-size"] // (MODEL_FLAGS["--micro-batch-size"] * D),
    )


def _pipelined_iteration(chunks, args, out_dir):
    """All forwards then all backwards over virtual stages s = chunk * P + pp_rank (blocking p2p)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.enums import ModelType

    from megatron_app.megatron_compat import backward_step
    from megatron_app.train.data import build_data_iterators
    from megatron_app.train.dumps import dump_grads
    from megatron_app.train.optim import finalize_model_grads
    from megatron_app.train.step import forward_step

    P, V, m = args.pipeline_parallel, args.model_chunks, args.num_microbatches
    rank, stages = parallel_state.get_pipeline_model_parallel_rank(), P * V
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    data = build_data_iterators(args, V, dp_rank=0)
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    store, saved = [], {}
    for mb in range(m):
        for s in range(stages):
            if s % P != rank:
                continue
            chunk = s // P
            inp = None
            if s > 0:
                inp = torch.empty(shape)
                dist.recv(inp, src=(s - 1) % P)
                inp.requires_grad_()
            out, _ = schedules.forward_step(forward_step, data[chunk], chunks[chunk], m, inp, store, config, 1,
                                            vp_stage=chunk, is_last_stage=s == stages - 1)
            if s < stages - 1:
                dist.send(out.detach().contiguous(), dst=(s + 1) % P)
            saved[(s, mb)] = (inp, out)
    for mb in reversed(range(m)):
        for s in reversed(range(stages)):
            if s % P != rank:
                continue
            inp, out = saved.pop((s, mb))
            grad = None
            if s < stages - 1:
                grad = torch.empty(shape)
                dist.recv(grad, src=(s + 1) % P)
            in_grad = backward_step(inp, out, grad, ModelType.encoder_or_decoder, config)   # 0.16's or 0.17+'s
            if s > 0:
                dist.send(in_grad.contiguous(), dst=(s - 1) % P)
    config.finalize_model_grads_func(chunks)
    dump_grads(chunks, os.path.join(out_dir, "grads"))
    if store:
        total = torch.stack([entry["lm loss"] for entry in store]).sum(dim=0)
        with open(os.path.join(out_dir, "loss.json"), "w") as handle:
            json.dump({"loss": (total[0] / total[1]).item(), "microbatches": len(store)}, handle)


# Embedding and output weights are tied by default (Megatron-LM's rule): at P=2 V=2 the last stage holds a copy.
PIPELINED = ["--pipeline_parallel", 2, "--model_chunks", 2, "--schedule", "app"]
TRAINED_LAYOUTS = {"t2": ["--tensor_parallel", 2], "d2": ["--data_parallel", 2], "p2v2": PIPELINED,
                   "p2v2_untied": PIPELINED + ["--untie-embeddings-and-output-weights"]}


def _finalize_grads_check(chunks, rank, out_dir):
    """finalize_model_grads over D=2: mean of the replicas, or sum / global tokens for per-token loss."""
    from megatron_app.train.optim import finalize_model_grads

    params = [p for chunk in chunks for p in chunk.parameters()]
    for p in params:
        p.grad = torch.full_like(p, float(rank + 1))
    finalize_model_grads(chunks)
    averaged = sorted({p.grad.unique().item() for p in params})
    for p in params:
        p.grad = torch.full_like(p, float(rank + 1))
    num_tokens = torch.tensor(rank + 3)
    finalize_model_grads(chunks, num_tokens)
    per_token = sorted({round(p.grad.unique().item(), 6) for p in params})
    with open(os.path.join(out_dir, f"finalize_rank{rank}.json"), "w") as handle:
        json.dump({"averaged": averaged, "per_token": per_token, "num_tokens": int(num_tokens)}, handle)


def _layout_worker(rank, world, port, out_dir):
    import warnings
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_app.train.args import parse_args
    from megatron_app.train.dumps import dump_weights
    from megatron_app.train.init import init_model_parallel, seed_all
    from megatron_app.train.loop import train
    from megatron_app.train.model import build_model_chunks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name, (P, V, T) in LAYOUTS.items():
            args = _model_args(P, V, T, world // (P * T))
            init_model_parallel(T, P, V, "cpu")
            seed_all(args.seed, "cpu")
            chunks = build_model_chunks(args)
            layout_dir = os.path.join(out_dir, name)
            os.makedirs(layout_dir, exist_ok=True)
            dump_weights(chunks, layout_dir)
            structure = [{"pre_process": c.pre_process, "post_process": c.post_process,
                          "layers": [layer.layer_number for layer in c.decoder.layers]} for c in chunks]
            with open(os.path.join(layout_dir, f"structure_rank{rank}.json"), "w") as handle:
                json.dump(structure, handle)
            if name == "p2v2":
                _pipelined_iteration(chunks, args, layout_dir)
            if name == "d2":
                _finalize_grads_check(chunks, rank, layout_dir)
            parallel_state.destroy_model_parallel()
        for name, extra in TRAINED_LAYOUTS.items():
            argv = _flags(extra) + ["--no-trace", "--log-json", os.path.join(out_dir, f"train_{name}.json"),
                                    "--dump-grads", os.path.join(out_dir, f"train_{name}_grads"),
                                    "--dump-weights", os.path.join(out_dir, f"train_{name}_weights")]
            train(parse_args([str(a) for a in argv], environ={"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}))
            assert dist.is_initialized()  # train() leaves a caller's process group open
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    import torch.multiprocessing as mp

    out_dir = str(tmp_path_factory.mktemp("layouts"))
    mp.start_processes(_layout_worker, args=(2, _free_port(), out_dir), nprocs=2, start_method="spawn")
    return out_dir


def test_initial_weights_identical_across_layouts(layouts):
    from megatron_app.train.dumps import load_full_weights

    reference = load_full_weights(os.path.join(layouts, "d2"))  # D=2: each rank holds the whole model
    assert len(reference) == 4 * 12 + 2 + 2  # per layer 12 tensors; 2 embeddings (one is the output's); final norm
    for name in ("p2v2", "t2"):
        weights = load_full_weights(os.path.join(layouts, name))
        assert set(weights) == set(reference), name
        for key, value in reference.items():
            assert torch.equal(weights[key], value), f"{name}: {key} differs"
    # Distributions are Megatron's: biases zero, norms one, output projections scaled down by depth.
    assert torch.count_nonzero(reference["decoder.layers.0.self_attention.linear_qkv.bias"]) == 0
    assert torch.all(reference["decoder.final_layernorm.weight"] == 1)
    qkv_std = reference["decoder.layers.0.self_attention.linear_qkv.weight"].std().item()
    proj_std = reference["decoder.layers.0.self_attention.linear_proj.weight"].std().item()
    assert qkv_std == pytest.approx(0.02, rel=0.1)
    assert proj_std == pytest.approx(0.02 / (2 * 4) ** 0.5, rel=0.1)


def test_virtual_chunks_get_megatron_stage_structure(layouts):
    structure = [json.load(open(os.path.join(layouts, "p2v2", f"structure_rank{r}.json"))) for r in range(2)]
    # Virtual stage s = chunk * P + rank holds global layer s + 1 (4 layers over 4 virtual stages).
    for rank in range(2):
        for chunk in range(2):
            entry = structure[rank][chunk]
            stage = chunk * 2 + rank
            assert entry["layers"] == [stage + 1]
            assert entry["pre_process"] == (stage == 0)
            assert entry["post_process"] == (stage == 3)


def test_pipelined_p2_v2_iteration_matches_reference(layouts, reference):
    result = json.load(open(os.path.join(layouts, "p2v2", "loss.json")))
    assert result["microbatches"] == 4
    assert result["loss"] == pytest.approx(_losses(reference[0])[0], rel=1e-5)
    _assert_same_grads(os.path.join(layouts, "p2v2", "grads"), reference[1])


def _trained(layouts, name):
    payload = json.load(open(os.path.join(layouts, f"train_{name}.json")))
    return payload, os.path.join(layouts, f"train_{name}_grads")


def test_tensor_parallel_2_matches_reference(layouts, reference):
    payload, grads = _trained(layouts, "t2")
    assert payload["config"]["tensor_parallel"] == 2
    _assert_same_losses(_losses(payload), _losses(reference[0]))
    _assert_same_grads(grads, reference[1])


def test_data_parallel_2_matches_reference(layouts, reference):
    payload, grads = _trained(layouts, "d2")
    assert payload["config"]["data_parallel"] == 2 and payload["config"]["num_microbatches"] == 2
    _assert_same_losses(_losses(payload), _losses(reference[0]))
    _assert_same_grads(grads, reference[1])


def test_final_weights_dump_shows_every_parameter_trained(layouts, reference):
    from megatron_app.train.dumps import load_full_weights

    initial = load_full_weights(os.path.join(layouts, "d2"))
    final = load_full_weights(reference[2])
    assert set(final) == set(initial)
    for name, value in initial.items():
        assert not torch.equal(final[name], value), f"{name} did not change"


def test_finalize_model_grads_reduces_over_data_parallel_replicas(layouts):
    for rank in range(2):
        result = json.load(open(os.path.join(layouts, "d2", f"finalize_rank{rank}.json")))
        assert result["averaged"] == [1.5]  # (1 + 2) / 2
        assert result["per_token"] == [round(3 / 7, 6)]  # (1 + 2) / (3 + 4 tokens)
        assert result["num_tokens"] == 7  # the global count is handed back, as Megatron does


def _rank_weights(layouts, name):
    """Each pipeline rank's own dump (global name -> tensor), before the loaders merge them by name."""
    directory = os.path.join(layouts, f"train_{name}_weights")
    return [{key: record["tensor"] for key, record in torch.load(os.path.join(directory, f"weights_rank{rank:05d}.pt"),
                                                                  weights_only=True).items()} for rank in range(2)]


def test_tied_embedding_copies_stay_one_weight_through_pipelined_training(layouts, reference):
    """P=2 V=2, tied (the default): the last stage's copy of the word embedding is drawn equal to the first stage's,
    both take the summed gradient, and after 10 steps they are still bit-equal; losses and gradients are P=1's,
    whose output layer uses the embedding itself."""
    payload, grads = _trained(layouts, "p2v2")
    _assert_same_losses(_losses(payload), _losses(reference[0]))
    _assert_same_grads(grads, reference[1])
    first, last = _rank_weights(layouts, "p2v2")
    word = "embedding.word_embeddings.weight"
    assert word in first and word in last and "output_layer.weight" not in {*first, *last}
    assert torch.equal(first[word], last[word])
    initial = load_initial(layouts)
    assert not torch.equal(first[word], initial[word])   # trained, not merely left alone


def test_untied_output_layer_is_a_weight_of_its_own(layouts, reference):
    payload, _ = _trained(layouts, "p2v2_untied")
    first, last = _rank_weights(layouts, "p2v2_untied")
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
    assert first["embedding.word_embeddings.weight"].shape == last["output_layer.weight"].shape
    assert not torch.equal(first["embedding.word_embeddings.weight"], last["output_layer.weight"])
    assert _losses(payload)[0] != pytest.approx(_losses(reference[0])[0], rel=1e-5)   # another model than P=1's
    assert _losses(payload)[-1] < _losses(payload)[0]


def load_initial(layouts):
    from megatron_app.train.dumps import load_full_weights

    return load_full_weights(os.path.join(layouts, "d2"))
