"""--tensorboard-dir (train/tensorboard_scalars.py): Megatron-LM's TensorBoard scalars, read back with TensorBoard's
own reader; the reporter's hook; a real run's 'lm loss' equal to --log-json's; the refusal without the package."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_app.train import args as train_args
from megatron_app.train import report
from megatron_app.train.args import UsageError, parse_args
from megatron_app.train.tensorboard_scalars import TensorBoardScalars
from pipeline_runs import REPO

WORLD = {"WORLD_SIZE": "1"}
GLOBAL_BATCH = 8


def _read(directory):
    """{tag: [(step, value), ...]} of every scalar in the directory's event files, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def _f32(value):
    """A scalar event holds a float32."""
    return float(np.float32(value))


def _entry(iteration, **extra):
    return {"iteration": iteration, "loss": 10.0 - iteration, "time_ms": 250.0 * iteration,
            "tokens_per_s": 1000.0 + iteration, "lr": 1e-4 * iteration, "peak_memory_mib": 512.5, **extra}


def test_the_sink_writes_megatron_lms_tags_and_ours_with_exact_steps_and_values(tmp_path):
    pytest.importorskip("tensorboard")
    sink = TensorBoardScalars.open(tmp_path, GLOBAL_BATCH)
    sink.iteration(_entry(1, grad_norm=2.5, loss_scale=65536.0, skipped_iterations=0,
                          composed={"num_microbatches": 4, "predicted_ms": 240.0}))
    sink.iteration(_entry(2, grad_norm=1.5, loss_scale=32768.0, skipped_iterations=1,
                          composed={"num_microbatches": 4, "predicted_ms": 480.0}))
    sink.validation(2, 7.5, 1808.04)
    sink.close()
    scalars = _read(tmp_path)
    steps = [1, 2]
    assert scalars["lm loss"] == [(1, 9.0), (2, 8.0)]
    assert scalars["lm loss vs samples"] == [(8, 9.0), (16, 8.0)]     # x: consumed samples, iteration x 8
    assert scalars["learning-rate"] == [(1, _f32(1e-4)), (2, _f32(2e-4))]
    assert scalars["learning-rate vs samples"] == [(8, _f32(1e-4)), (16, _f32(2e-4))]
    assert scalars["grad-norm"] == [(1, 2.5), (2, 1.5)]
    assert scalars["loss-scale"] == [(1, 65536.0), (2, 32768.0)]
    assert scalars["iteration-time"] == [(1, 0.25), (2, 0.5)]        # seconds, as Megatron-LM's timers
    assert scalars["batch-size"] == [(step, 8.0) for step in steps]
    assert scalars["tokens-per-second"] == [(1, 1001.0), (2, 1002.0)]
    assert scalars["peak-memory-mib"] == [(step, 512.5) for step in steps]
    assert scalars["predicted-iteration-time"] == [(1, _f32(0.24)), (2, _f32(0.48))]
    assert scalars["lm loss validation"] == [(2, 7.5)]
    assert scalars["lm loss validation ppl"] == [(2, _f32(1808.04))]


def test_a_tag_without_a_value_is_not_written(tmp_path):
    """No --clip-grad: no grad-norm; fp32: no loss-scale; not composed (or no prediction yet): no predicted time;
    emulated compute: no loss."""
    pytest.importorskip("tensorboard")
    sink = TensorBoardScalars.open(tmp_path / "plain", GLOBAL_BATCH)
    sink.iteration(_entry(1, composed={"num_microbatches": 4, "predicted_ms": None}))
    sink.close()
    tags = set(_read(tmp_path / "plain"))
    assert tags == {"lm loss", "lm loss vs samples", "learning-rate", "learning-rate vs samples", "iteration-time",
                    "batch-size", "tokens-per-second", "peak-memory-mib"}
    emulated = TensorBoardScalars.open(tmp_path / "emulated", GLOBAL_BATCH, emulated=True)
    emulated.iteration(_entry(1))
    emulated.close()
    assert not {"lm loss", "lm loss vs samples"} & set(_read(tmp_path / "emulated"))


class _Sink:
    def __init__(self):
        self.calls = []

    def iteration(self, entry):
        self.calls.append(("iteration", entry["iteration"], entry["loss"]))

    def validation(self, iteration, loss, perplexity):
        self.calls.append(("validation", iteration, loss))

    def close(self):
        self.calls.append(("close",))


def test_the_reporter_hands_each_entry_and_validation_to_its_sink_and_closes_it_once(monkeypatch, tmp_path):
    monkeypatch.setattr(report, "is_reporting_rank", lambda: True)
    sink = _Sink()
    reporter = report.IterationReporter({}, 2, 1000, None, log_interval=2, scalars=sink)
    reporter.record(1, 3.0, 0.5)          # inside a --log-interval: no line, but the sink gets it
    reporter.record(2, 2.0, 0.5)
    reporter.record_validation(2, 1.5)
    reporter.close()
    reporter.close()
    assert sink.calls == [("iteration", 1, 3.0), ("iteration", 2, 2.0), ("validation", 2, 1.5), ("close",)]


def test_a_rank_that_does_not_report_writes_nothing(monkeypatch):
    monkeypatch.setattr(report, "is_reporting_rank", lambda: False)
    sink = _Sink()
    reporter = report.IterationReporter({}, 1, 1000, None, scalars=sink)
    reporter.record(1, 3.0, 0.5)
    assert sink.calls == []


@pytest.mark.slow
def test_a_trainer_run_writes_lm_loss_equal_to_its_log_json(tmp_path):
    """A real run (3 iterations, P=1): each iteration's 'lm loss' in the event file is --log-json's loss (float32),
    with the learning rate of a schedule and the gradient norm of --clip-grad; no loss scale in fp32."""
    pytest.importorskip("tensorboard")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for launcher_variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(launcher_variable, None)
    log_json = tmp_path / "log.json"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_app.train", "--iters", "3", "--num-layers", "2", "--hidden-size", "32",
         "--seq-length", "32", "--no-trace", "--tensorboard-dir", str(tmp_path / "tb"), "--clip-grad", "1.0",
         "--lr-decay-style", "cosine", "--log-json", str(log_json)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logged = json.loads(log_json.read_text())
    iterations = logged["iterations"]
    global_batch = logged["config"]["global_batch_size"]
    scalars = _read(tmp_path / "tb")
    assert scalars["lm loss"] == [(entry["iteration"], _f32(entry["loss"])) for entry in iterations]
    assert [step for step, _ in scalars["lm loss"]] == [1, 2, 3]
    assert scalars["learning-rate"] == [(entry["iteration"], _f32(entry["lr"])) for entry in iterations]
    assert scalars["grad-norm"] == [(entry["iteration"], _f32(entry["grad_norm"])) for entry in iterations]
    assert [step for step, _ in scalars["lm loss vs samples"]] == [global_batch, 2 * global_batch, 3 * global_batch]
    assert scalars["batch-size"] == [(step, float(global_batch)) for step in (1, 2, 3)]
    assert "loss-scale" not in scalars
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1   # one writer: the reporting rank's


def test_tensorboard_dir_alone_is_accepted(tmp_path):
    pytest.importorskip("tensorboard")
    assert parse_args(["--tensorboard-dir", str(tmp_path / "tb")], WORLD).tensorboard_dir == str(tmp_path / "tb")


def test_tensorboard_dir_without_the_package_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(train_args, "tensorboard_importable", lambda: False)
    with pytest.raises(UsageError) as error:
        parse_args(["--tensorboard-dir", str(tmp_path / "tb")], WORLD)
    assert str(error.value) == ("--tensorboard-dir writes TensorBoard scalars, which need the tensorboard package: "
                                "pip install -r requirements-tensorboard.txt")
    parse_args([], WORLD)   # a run without it never asks
    # the profiler's traces need no package: they still go there, and the run says the scalars do not
    args = parse_args(["--tensorboard-dir", str(tmp_path / "tb"), "--profile", "--use-pytorch-profiler",
                       "--iters", "12"], WORLD)
    assert "gets the profiler's traces only" in args.tensorboard_scalars_note


def test_without_the_package_the_trainer_imports_and_runs_without_it_but_refuses_the_flag(tmp_path):
    """A host without tensorboard (sys.modules' None makes its import fail, as not installed): the trainer's modules
    import (megatron-core's own timers.py tries it and goes on), a run without --tensorboard-dir parses, one with it
    is refused in one line."""
    code = ("import sys; sys.modules['tensorboard'] = None\n"
            "import megatron_app.train.loop\n"
            "from megatron_app.train.args import UsageError, parse_args\n"
            "parse_args([], {'WORLD_SIZE': '1'})\n"
            "try:\n"
            f"    parse_args(['--tensorboard-dir', {str(tmp_path / 'tb')!r}], {{'WORLD_SIZE': '1'}})\n"
            "except UsageError as error:\n"
            "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == (
        "--tensorboard-dir writes TensorBoard scalars, which need the tensorboard package: "
        "pip install -r requirements-tensorboard.txt")
