"""Flag validation of megatron_app.train: every user mistake is one clear line and exit status 2."""

import os
import subprocess
import sys

import pytest

from megatron_app.train.args import UsageError, parse_args

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse(*argv, world="1", master_addr="127.0.0.1"):
    environ = {"WORLD_SIZE": world}
    if master_addr:
        environ["MASTER_ADDR"] = master_addr
    return parse_args(list(argv), environ=environ)


def test_defaults_derive_layout_and_microbatches():
    args = _parse("--schedule", "megatron", "--tensor_parallel", "2", world="4")
    assert (args.pipeline_parallel, args.tensor_parallel, args.data_parallel) == (1, 2, 2)
    assert args.world_size == 4
    assert args.global_batch_size == 8 * args.micro_batch_size * 2
    assert args.num_microbatches == 8
    assert args.device in ("cpu", "cuda")


def test_dash_and_underscore_spellings_are_equivalent():
    a = _parse("--num-layers", "4", "--pipeline-parallel", "2", "--schedule", "app", world="2")
    b = _parse("--num_layers", "4", "--pipeline_parallel", "2", "--schedule", "app", world="2")
    assert (a.num_layers, a.pipeline_parallel) == (b.num_layers, b.pipeline_parallel) == (4, 2)


def test_dropout_flags_reach_the_model_config():
    from megatron_app.train.model import build_transformer_config

    config = build_transformer_config(parse_args(["--hidden-dropout", "0.1", "--attention_dropout", "0.2"]))
    assert (config.hidden_dropout, config.attention_dropout) == (0.1, 0.2)


def test_microbatches_from_global_batch():
    args = _parse("--global-batch-size", "24", "--micro-batch-size", "3", "--data_parallel", "2", world="2")
    assert args.num_microbatches == 4


@pytest.mark.parametrize("argv, world, fragment", [
    (["--pipeline_parallel", "2"], "3", "WORLD_SIZE=3 is not divisible by pipeline_parallel(2)"),
    (["--pipeline_parallel", "2", "--data_parallel", "1"], "4", "WORLD_SIZE=4 does not match"),
    (["--num-layers", "6", "--pipeline_parallel", "2", "--model_chunks", "2"], "2",
     "--num-layers 6 is not divisible by pipeline_parallel(2) x model_chunks(2) = 4"),
    (["--model_chunks", "2"], "1", "--model_chunks 2 needs --pipeline_parallel > 1"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"], "1", "--global-batch-size 10 is not a positive multiple"),
    (["--pipeline_parallel", "4", "--model_chunks", "2", "--global-batch-size", "12", "--micro-batch-size", "2"],
     "4", "number of microbatches"),
    (["--hidden-size", "66", "--num-attention-heads", "4"], "1", "--hidden-size 66 is not divisible"),
    (["--num-attention-heads", "4", "--hidden-size", "64", "--tensor_parallel", "3"], "3",
     "--num-attention-heads 4 is not divisible by tensor_parallel(3)"),
    (["--vocab-size", "1001", "--tensor_parallel", "2"], "2", "--vocab-size 1001 is not divisible"),
    (["--iters", "0"], "1", "--iters must be a positive integer"),
    (["--distributed-timeout-minutes", "0"], "1", "--distributed-timeout-minutes must be a positive integer"),
    (["--lr", "-1"], "1", "--lr must be positive"),
    (["--hidden-dropout", "1.5"], "1", "--hidden-dropout must be in [0, 1), got 1.5"),
    (["--attention-dropout", "-0.1"], "1", "--attention-dropout must be in [0, 1), got -0.1"),
    (["--schedule", "megatron", "--pipeline_parallel", "2", "--device", "cpu"], "2", "needs CUDA"),
    (["--data-path", "/nonexistent/prefix"], "1", "/nonexistent/prefix.bin does not exist"),
    (["--schedule", "gpipe"], "1", "invalid choice"),
    (["--policy", "planned", "--memory-factor", "0.5"], "1", "--memory-factor must be >= 1"),
    (["--policy", "adaptive", "--memory-factor", "1.1"], "1", "--memory-factor applies to --policy planned"),
    (["--schedule", "zb-h1", "--pipeline_parallel", "2"], "2", "--schedule zb-h1 needs --split-backward"),
    (["--num-layers", "many"], "1", "invalid int value"),
    (["--no-such-flag"], "1", "unrecognized arguments"),
    ([], "zero", "WORLD_SIZE='zero' is not an integer"),
])
def test_bad_flags_raise_one_line(argv, world, fragment):
    with pytest.raises(UsageError) as info:
        _parse(*argv, world=world)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_multi_rank_world_without_launcher_is_rejected():
    with pytest.raises(UsageError, match="MASTER_ADDR is not set: launch one process per rank with torchrun"):
        _parse(world="2", master_addr=None)
    assert _parse(world="1", master_addr=None).world_size == 1


def _cli(argv, world="1"):
    env = dict(os.environ, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "megatron_app.train", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv, world", [
    (["--num-layers", "6", "--pipeline_parallel", "4"], "4"),
    (["--pipeline_parallel", "2", "--tensor_parallel", "2"], "2"),
    (["--schedule", "nope"], "1"),
])
def test_cli_bad_flag_exits_2_with_one_stderr_line(argv, world):
    result = _cli(argv, world)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("megatron_app.train: error: ")
    assert result.stdout == ""
