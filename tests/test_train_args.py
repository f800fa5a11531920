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


# ---- Megatron-LM's names, --help's defaults, one meaning per flag --------------------------------------------------
def test_megatron_lm_flag_names_are_aliases():
    ours = _parse("--pipeline_parallel", "2", "--tensor_parallel", "2", "--model_chunks", "2", "--iters", "3",
                  world="4")
    megatron = _parse("--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                      "--num-layers-per-virtual-pipeline-stage", "2", "--train-iters", "3", world="4")
    for dest in ("pipeline_parallel", "tensor_parallel", "model_chunks", "iters", "data_parallel"):
        assert getattr(ours, dest) == getattr(megatron, dest), dest
    assert _parse("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                  world="2").model_chunks == 2
    assert _parse("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                  world="2").model_chunks == 2


def test_virtual_stage_flags_that_disagree_are_refused():
    with pytest.raises(UsageError, match="disagree"):
        _parse("--pipeline_parallel", "2", "--model_chunks", "4", "--num-layers-per-virtual-pipeline-stage", "2",
               world="2")


def test_help_shows_every_default():
    from megatron_app.train.args import build_parser

    parser = build_parser()
    text = parser.format_help()
    for fragment in ("(default: 5)", "(default: 1234)", "(default: 0.001)", "(default: planned)", "(default: app)",
                     "(default: 8)", "(default: traces/)"):
        assert fragment in " ".join(text.split()), fragment
    for action in parser._actions:
        if action.nargs == 0 and action.dest not in ("check_for_nan_in_loss_and_grad",):
            continue   # an on/off switch: off unless given
        if action.help == "==SUPPRESS==":
            continue
        assert action.help, f"{action.option_strings} has no help (argparse would show no default)"
        assert "default" in parser._get_formatter()._get_help_string(action), action.option_strings


@pytest.mark.parametrize("argv, world, fragment", [
    (["--pipeline_parallel", "2", "--schedule", "interleaved", "--policy", "dfc"], "2",
     "--policy dfc chooses the task policy of --schedule app; this run follows the fixed order of --schedule "
     "interleaved: drop --policy"),
    (["--pipeline_parallel", "2", "--schedule-file", "x.csv", "--policy", "dfc"], "2",
     "this run follows the action lists of --schedule-file x.csv"),
    (["--slow-link", "0-1:0-1:2"], "1", "--slow-link is the simulator's flag (a slowdown FACTOR)"),
    (["--emulate-compute", "1,2", "--slow-factor", "2"], "1", "--slow-factor needs --slow-rank"),
    (["--emulate-compute", "1,2", "--straggler-factor", "2"], "1", "--straggler-factor needs --straggler-prob"),
    (["--eval-iters", "3"], "1", "--eval-iters needs --eval-interval"),
    (["--split", "90,5,5"], "1", "--split needs --data-path"),
    (["--no-trace", "--trace-dir", "t"], "1", "--no-trace writes no trace: drop --trace-dir"),
    (["--schedule", "megatron", "--trace-dir", "t"], "1", "writes no trace: drop --trace-dir"),
])
def test_an_option_the_mode_ignores_is_refused_in_one_line(argv, world, fragment):
    with pytest.raises(UsageError) as info:
        _parse(*argv, world=world)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_one_policy_name_per_run():
    from megatron_app.runtime.settings import AppSettings
    from megatron_app.schedule.action_lists import ACTION_LISTS

    assert _parse().policy == "planned" and _parse("--policy", "dfc").policy == "dfc"
    assert _parse("--pipeline_parallel", "2", "--schedule", "1f1b", world="2").policy == "1f1b"
    # what the banner and the trace say (the session's policy_name) is the config line's name
    assert AppSettings(schedule="1f1b").validate().policy_name == "1f1b"
    assert AppSettings(schedule="file", schedule_file=__file__).policy_name == ACTION_LISTS


# ---- outputs checked before any rank starts ----------------------------------------------------------------------
@pytest.mark.parametrize("flag, path, fragment", [
    ("--log-json", "/dev/null/x.json", "--log-json /dev/null/x.json: /dev/null is not a directory"),
    ("--save", "/dev/null/ckpt", "--save /dev/null/ckpt: cannot create the directory there: /dev/null is not a dir"),
    ("--trace-dir", "{file}", "exists and is not a directory"),
    ("--dump-grads", "{file}/sub", "is not a directory"),
    ("--dump-weights", "{ro}/w", "is not writable"),
    ("--log-json", "{tmp}", "is a directory, not a file"),
])
def test_an_output_that_cannot_be_written_is_refused_before_the_run(tmp_path, flag, path, fragment):
    (tmp_path / "file").write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if flag == "--dump-weights" and os.access(ro, os.W_OK) and os.geteuid() == 0:
        ro = "/proc"   # root writes anywhere on an ordinary file system; /proc refuses even root
    path = path.format(file=tmp_path / "file", ro=ro, tmp=tmp_path)
    with pytest.raises(UsageError) as info:
        _parse(flag, path)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "ro"]   # the check created nothing


def test_save_needs_room_for_a_checkpoint(tmp_path):
    from megatron_app.train.output_paths import OutputPathError, check_room, checkpoint_bytes

    args = _parse("--num-layers", "2", "--hidden-size", "64")
    needed = checkpoint_bytes(args)
    assert needed > 12 * 2 * 12 * 64 * 64   # the layers' weights and Adam's moments at least
    check_room("--save", str(tmp_path), str(tmp_path), needed, free=needed)
    with pytest.raises(OutputPathError, match=r"needs about .* MiB, and only 0.0 MiB are free"):
        check_room("--save", str(tmp_path), str(tmp_path), needed, free=1000)


def test_writable_outputs_pass_and_nothing_is_created(tmp_path):
    args = _parse("--save", str(tmp_path / "a" / "ckpt"), "--log-json", str(tmp_path / "b" / "log.json"),
                  "--trace-dir", str(tmp_path / "traces"), "--dump-grads", str(tmp_path))
    assert args.save.endswith("ckpt") and list(tmp_path.iterdir()) == []


def test_planned_composition_options_are_refused_where_nothing_reads_them():
    with pytest.raises(UsageError, match="--no-replica-speeds applies to --composition balanced only"):
        parse_args(["--pipeline_parallel", "1", "--no-replica-speeds"], environ={})
    with pytest.raises(UsageError, match="--plan-ahead applies to --composition balanced or balanced-local only"):
        parse_args(["--pipeline_parallel", "1", "--plan-ahead"], environ={})
