"""Megatron-LM's own command lines: the logging and model flags its example scripts pass (--log-interval,
--max-position-embeddings, --attention-softmax-in-fp32, --attention-backend) mean here what they mean there."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_app.train import report
from megatron_app.train.args import UsageError, parse_args

ENV = {"WORLD_SIZE": "1"}


@pytest.fixture
def reporter(monkeypatch, tmp_path):
    monkeypatch.setattr(report, "is_reporting_rank", lambda: True)

    def make(iters, log_interval, shows_lr=False):
        return report.IterationReporter({}, iters, 1000, str(tmp_path / "log.json"), shows_lr=shows_lr,
                                        log_interval=log_interval)
    return make


def _lines(capsys):
    return capsys.readouterr().out.strip().splitlines()


def test_log_interval_prints_every_nth_iteration_with_the_intervals_means_and_the_last_step(reporter, capsys,
                                                                                            tmp_path):
    log = reporter(7, 3, shows_lr=True)
    for iteration in range(1, 8):   # losses 7, 6, ..., 1; times 0.1 s, 0.2 s, ...; lr falls
        log.record(iteration, 8.0 - iteration, 0.1 * iteration, tokens=1000 * iteration,
                   optimizer={"lr": 1e-3 / iteration, "grad_norm": float(iteration)})
    assert _lines(capsys) == [
        # losses 7, 6, 5 -> 6; times 100, 200, 300 ms -> 200; tokens 6,000 in 0.6 s; the 3rd step's lr and norm
        "iter 3/7 | loss 6.0000 (mean of 3) | 200.0 ms | 10000 tokens/s | lr 3.333e-04 | grad norm 3",
        "iter 6/7 | loss 3.0000 (mean of 3) | 500.0 ms | 10000 tokens/s | lr 1.667e-04 | grad norm 6",
        "iter 7/7 | loss 1.0000 | 700.0 ms | 10000 tokens/s | lr 1.429e-04 | grad norm 7",   # the last, alone
    ]
    assert [entry["iteration"] for entry in json.loads((tmp_path / "log.json").read_text())["iterations"]] == \
        list(range(1, 8))   # the JSON log keeps every iteration


def test_a_run_stopped_inside_an_interval_shows_its_last_iterations_once(reporter, capsys):
    log = reporter(10, 4)
    for iteration in range(1, 7):   # --exit-interval 6
        log.record(iteration, 2.0, 0.5)
    log.flush()
    log.flush()
    assert [line.split(" | ")[:2] for line in _lines(capsys)] == [["iter 4/10", "loss 2.0000 (mean of 4)"],
                                                                 ["iter 6/10", "loss 2.0000 (mean of 2)"]]


def test_an_interval_counts_its_skipped_iterations_and_leaves_their_loss_out(reporter, capsys):
    log = reporter(4, 4)
    for iteration, skipped, loss in zip(range(1, 5), (False, True, True, False), (2.0, float("inf"), 9.0, 4.0)):
        log.record(iteration, loss, 0.5, optimizer={"loss_scale": 1024.0, "skipped_iterations": 2 if iteration > 2
                                                    else int(skipped), "skipped": skipped})
    line = _lines(capsys)[-1]
    assert "| loss 3.0000 (mean of 2) |" in line   # the two that stepped, as Megatron-LM averages
    assert line.endswith("| loss scale 1024 | skipped iterations 2 (2 of these 4: gradients overflowed)")


def test_every_iteration_has_its_line_by_default(reporter, capsys):
    log = reporter(3, 1)
    for iteration in range(1, 4):
        log.record(iteration, 2.0, 0.5)
    assert [line.split(" | ")[:2] for line in _lines(capsys)] == [[f"iter {i}/3", "loss 2.0000"] for i in (1, 2, 3)]


def test_the_trainer_logs_at_the_interval_and_after_an_early_exit(tmp_path):
    """And Megatron-LM's `--save DIR --load DIR` on a first run: DIR does not exist yet, the run starts fresh."""
    import subprocess
    import sys

    checkpoints = str(tmp_path / "checkpoints")
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", "--iters", "10", "--log-interval", "4",
                             "--exit-interval", "6", "--no-trace", "--num-layers", "2", "--hidden-size", "32",
                             "--seq-length", "32", "--log-json", str(tmp_path / "log.json"), "--save", checkpoints,
                             "--load", checkpoints], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("iter ")]
    assert [line.split(" | ")[0] for line in lines] == ["iter 4/10", "iter 6/10"], result.stdout
    assert len(json.loads((tmp_path / "log.json").read_text())["iterations"]) == 6
    assert f"no checkpoint in {checkpoints} yet: starting from iteration 0" in result.stdout
    assert (tmp_path / "checkpoints" / "latest_iteration.txt").read_text().strip() == "6"


@pytest.mark.parametrize("flags,line", [
    ("--log-interval 0", "--log-interval must be a positive integer"),
    ("--max-position-embeddings 32", "--max-position-embeddings 32 must be at least --seq-length 64"),
    ("--attention-backend flash", "Transformer Engine's kernels"),
    ("--attention-backend fused", "Transformer Engine's kernels"),
])
def test_megatron_lm_flags_we_cannot_honour_are_refused_in_one_line(flags, line):
    with pytest.raises(UsageError, match=line):
        parse_args(flags.split(), ENV)


def test_max_position_embeddings_defaults_to_the_sequence_and_sizes_the_position_table(megatron_single_rank):
    from megatron_app.train.model import build_model_chunks

    assert parse_args([], ENV).max_position_embeddings == 64
    assert parse_args(["--max-position-embeddings", "256"], ENV).max_position_embeddings == 256
    args = SimpleNamespace(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                           tensor_parallel=1, pipeline_parallel=1, model_chunks=1, seed=1234, device="cpu",
                           max_position_embeddings=48)
    chunk = build_model_chunks(args)[0]
    assert chunk.embedding.position_embeddings.weight.shape == (48, 32)


def test_a_checkpoint_with_another_position_table_is_refused(tmp_path):
    from megatron_app.train.checkpoint_manifest import (CheckpointError, FoundCheckpoint, check_compatible,
                                                        manifest_for)

    saved = parse_args(["--max-position-embeddings", "128"], ENV)
    manifest = manifest_for(saved, 1, 8, [])
    check_compatible(FoundCheckpoint(str(tmp_path), manifest), saved)
    with pytest.raises(CheckpointError, match="max_position_embeddings=128 but this run has --max-position-embeddings"):
        check_compatible(FoundCheckpoint(str(tmp_path), manifest), parse_args([], ENV))
    del manifest["model"]["max_position_embeddings"]   # from before it was recorded: --seq-length's
    check_compatible(FoundCheckpoint(str(tmp_path), manifest), parse_args([], ENV))
    with pytest.raises(CheckpointError, match="max_position_embeddings=64 but this run has --max-position-embeddings"):
        check_compatible(FoundCheckpoint(str(tmp_path), manifest), parse_args(["--max-position-embeddings", "96"], ENV))


# examples/gpt3/train_gpt3_175b_distributed.sh of Megatron-LM, its flags as written but for the sizes (and the data,
# mock here), --rampup-batch-size (batch-size ramp-up is not supported) and --tensorboard-dir (it needs the optional
# tensorboard package: tests/test_tensorboard_scalars.py).
GPT3_EXAMPLE = """
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128
    --attention-backend auto
    --micro-batch-size 1 --global-batch-size 8 --train-iters 3 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
    --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6
    --lr-warmup-fraction .001 --lr-decay-iters 430000
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save CKPT --load CKPT
"""


def test_megatron_lms_gpt3_example_flags_parse_as_megatron_reads_them(tmp_path):
    flags = GPT3_EXAMPLE.replace("CKPT", str(tmp_path / "checkpoints")).split()
    args = parse_args(flags + ["--attention-softmax-in-fp32"],
                      {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert (args.pipeline_parallel, args.iters, args.precision, args.max_position_embeddings) == (2, 3, "fp16", 128)
    assert (args.log_interval, args.lr_decay_style, args.clip_grad, args.adam_beta2) == (100, "cosine", 1.0, 0.95)


@pytest.mark.parametrize("flags,line", [
    ("--train-samples 80 --train-iters 10", "both give the run's length"),
    ("--lr-decay-samples 64", "counts the schedule in samples: give --train-samples"),
    ("--train-samples 80 --lr-warmup-iters 2", "give --lr-warmup-samples instead of --lr-warmup-iters"),
    ("--train-samples 4 --global-batch-size 8", "less than one global batch"),
    ("--train-samples 80 --lr-decay-style cosine --lr-decay-samples 0", "--lr-decay-samples must be a positive"),
    # the schedule's refusals name the flags of the run's unit
    ("--train-samples 80 --lr-decay-style WSD", "WSD needs --lr-wsd-decay-samples N"),
    ("--train-samples 80 --lr-decay-samples 50", "--lr-decay-samples shapes a decay; --lr-decay-style constant"),
    ("--train-samples 80 --lr-warmup-samples 8 --lr-warmup-fraction 0.1", "--lr-warmup-samples and --lr-warmup-"),
    ("--train-samples 80 --lr-decay-style cosine --lr-warmup-samples 80",
     r"warm-up \(80 samples\) must end before --lr-decay-samples \(80, default --train-samples\)"),
])
def test_sample_based_training_flags_are_megatron_lms_rules(flags, line):
    with pytest.raises(UsageError, match=line):
        parse_args(flags.split(), ENV)


def test_sample_counts_megatron_lm_accepts_are_accepted():
    """Counts that are no whole number of iterations (Megatron's scheduler counts samples), and an explicit zero
    warm-up in the other unit (Megatron-LM's default)."""
    args = parse_args("--train-samples 100 --global-batch-size 8 --lr-decay-style cosine --lr-decay-samples 4 "
                      "--lr-warmup-samples 0 --lr-warmup-iters 0".split(), ENV)
    assert args.iters == 12
    parse_args("--train-samples 100 --global-batch-size 8 --lr-decay-style cosine --lr-warmup-samples 98".split(), ENV)
    parse_args("--train-iters 10 --lr-warmup-samples 0".split(), ENV)


def test_a_constant_lr_counted_in_samples_warms_up_over_its_share_of_the_samples():
    from megatron_app.train.flags import lr_schedule_samples

    args = parse_args("--train-samples 100 --global-batch-size 8 --lr-warmup-fraction 0.5".split(), ENV)
    assert lr_schedule_samples(args) == (50.0, 100, None, 100)   # Megatron-LM's: half of the 100 samples, not 96


def test_a_sample_based_schedule_is_megatron_lms_counted_in_samples():
    """--train-samples 84 at global batch 8: 10 iterations (Megatron-LM floors), and a warm-up of 12 samples (an
    iteration and a half) and a cosine decay over 60, exactly as Megatron's scheduler steps through them by samples."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_app.train.lr_schedule import build_scheduler, current_lr

    args = parse_args("--train-samples 84 --global-batch-size 8 --lr 1e-3 --min-lr 1e-5 --lr-decay-style cosine "
                      "--lr-warmup-samples 12 --lr-decay-samples 60".split(), ENV)
    assert args.iters == 10

    def optimizer():
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.0)

    ours = build_scheduler(optimizer(), args)
    megatron = OptimizerParamScheduler(optimizer(), init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=12,
                                       lr_decay_steps=60, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                       wd_incr_steps=84, wd_incr_style="constant")
    assert (ours.lr_warmup_steps, ours.lr_decay_steps, ours.wd_incr_steps) == (12, 60, 84)   # samples, as given
    seen = []
    for _ in range(args.iters):
        seen.append(current_lr(ours))
        assert seen[-1] == pytest.approx(current_lr(megatron), rel=1e-12, abs=1e-15)
        ours.step(8)
        megatron.step(8)
    assert seen[1] == pytest.approx(1e-3 * 8 / 12) and seen[-1] == pytest.approx(1e-5)   # mid-warm-up; decayed


def test_exit_duration_stops_every_rank_after_the_same_iteration_with_a_checkpoint(tmp_path):
    """--exit-duration-in-mins (Megatron-LM's, for a job's time limit): P=2, a limit of 1.2 s; both ranks agree on
    the iteration (a collective), save it, and exit 0."""
    import re
    import subprocess

    from pipeline_runs import REPO, run_env

    checkpoints = tmp_path / "checkpoints"
    result = subprocess.run(["bash", str(REPO / "run_single.sh"), "--pipeline_parallel", "2", "--iters", "100000",
                             "--exit-duration-in-mins", "0.02", "--num-layers", "2", "--hidden-size", "32",
                             "--seq-length", "32", "--no-trace", "--save", str(checkpoints)],
                            cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    stopped = re.search(r"stopping after iteration (\d+) \(--exit-duration-in-mins 0\.02: ([\d.]+) minutes",
                        result.stdout)
    assert stopped, result.stdout[-2000:]
    iteration = int(stopped.group(1))
    assert 0 < iteration < 100000 and float(stopped.group(2)) >= 0.02
    assert (checkpoints / "latest_iteration.txt").read_text().strip() == str(iteration)
    saved = sorted(path.name for path in (checkpoints / f"iter_{iteration:07d}").iterdir())
    assert [name for name in saved if name.startswith("model_optim_rng_")] == ["model_optim_rng_pp000_tp00.pt",
                                                                              "model_optim_rng_pp001_tp00.pt"]


def test_exit_duration_must_be_positive():
    with pytest.raises(UsageError, match="--exit-duration-in-mins must be positive"):
        parse_args(["--exit-duration-in-mins", "0"], ENV)


def test_sigterm_under_exit_signal_handler_saves_and_stops_every_rank_after_the_same_iteration(tmp_path):
    """SLURM signals every process of a job step: here run_single.sh's whole process group (torchrun and both ranks)
    gets SIGTERM once iteration 3 is printed. The ranks finish their iteration, agree, save it and stop."""
    import os
    import re
    import signal
    import subprocess

    from pipeline_runs import REPO, run_env

    checkpoints = tmp_path / "checkpoints"
    run = subprocess.Popen(["bash", str(REPO / "run_single.sh"), "--pipeline_parallel", "2", "--iters", "100000",
                            "--exit-signal-handler", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "32",
                            "--no-trace", "--save", str(checkpoints)], cwd=REPO, env=run_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = []
    try:
        for line in run.stdout:
            output.append(line)
            if "iter 3/100000" in line:
                os.killpg(run.pid, signal.SIGTERM)
                break
        output.extend(run.stdout)
        run.wait(timeout=300)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    text = "".join(output)
    stopped = re.search(r"stopping after iteration (\d+) \(--exit-signal-handler: SIGTERM received\)", text)
    assert stopped, text[-3000:]
    iteration = int(stopped.group(1))
    assert 3 <= iteration < 100000
    assert (checkpoints / "latest_iteration.txt").read_text().strip() == str(iteration)
    saved = sorted(path.name for path in (checkpoints / f"iter_{iteration:07d}").iterdir())
    assert [name for name in saved if name.startswith("model_optim_rng_")] == ["model_optim_rng_pp000_tp00.pt",
                                                                              "model_optim_rng_pp001_tp00.pt"]
    assert "Traceback" not in text, text[-3000:]
    assert "run_single.sh: stopped by SIGTERM" in text, text[-3000:]   # the launcher waited it out, then said so
