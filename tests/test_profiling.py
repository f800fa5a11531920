"""Megatron-LM's profiling flags (train/profiling.py): their refusals, a torch.profiler trace of the steps asked for
(the log's iterations start+1..end), a run ending inside the range, and nsys's capture range on CUDA."""

import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_app.train.args import UsageError, parse_args
from megatron_app.train.profiling import StepProfiler
from pipeline_runs import REPO

WORLD = {"WORLD_SIZE": "1"}
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "256", "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu"]


def test_megatron_lms_defaults_profile_the_logs_iterations_11_and_12():
    args = parse_args(["--profile", "--use-pytorch-profiler", "--iters", "12"], WORLD)
    assert (args.profile_step_start, args.profile_step_end, tuple(args.profile_ranks)) == (10, 12, (0,))
    profiler = StepProfiler.from_args(args, rank=0, trace_dir="run")
    assert (profiler.first, profiler.last, str(profiler.out_dir)) == (11, 12, "run/profile")
    assert StepProfiler.from_args(args, rank=1, trace_dir="run") is None     # not a profiled rank
    assert StepProfiler.from_args(parse_args([], WORLD), rank=0, trace_dir="run") is None


@pytest.mark.parametrize("argv,fragment", [
    (["--use-pytorch-profiler"], "--use-pytorch-profiler takes effect with --profile"),
    (["--profile-step-start", "3"], "--profile-step-start takes effect with --profile"),
    (["--profile-ranks", "0"], "--profile-ranks takes effect with --profile"),
    (["--profile-step-start", "0"], "--profile-step-start takes effect with --profile"),   # 0 is given
    (["--profile-step-end", "0"], "--profile-step-end takes effect with --profile"),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "3"],
     "needs 0 <= start < end"),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", "-1"], "needs 0 <= start < end"),
    (["--profile", "--use-pytorch-profiler", "--iters", "5"], "--profile-step-start 10: a run of --iters 5"),
    (["--profile", "--use-pytorch-profiler", "--iters", "12", "--profile-ranks", "0", "1"],
     "--profile-ranks 1: this run has global ranks 0..0"),
    (["--profile", "--iters", "12", "--device", "cpu"], "nsys's CUDA capture range: on --device cpu add"),
    (["--profile", "--use-pytorch-profiler", "--iters", "12", "--no-trace"], "give --tensorboard-dir DIR"),
])
def test_profiling_mistakes_are_refused_in_one_line(argv, fragment):
    with pytest.raises(UsageError) as error:
        parse_args(argv, WORLD)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def _train(*argv):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for launcher_variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(launcher_variable, None)
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", *map(str, argv)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _profile_of(directory):
    """(path, names of its events, how many optimizer steps it holds): the gzipped Chrome trace of rank 0."""
    [path] = list(directory.glob("rank0.*.pt.trace.json.gz"))
    with gzip.open(path, "rt") as trace:
        events = json.load(trace)["traceEvents"]
    names = [event.get("name") or "" for event in events]
    return path, set(names), sum(name.startswith("Optimizer.step#") for name in names)


def test_the_pytorch_profiler_writes_one_trace_of_the_steps_asked_for(tmp_path):
    """Steps 1..2 of 3 (counted from 0) are the log's iterations 2-3: one Chrome trace with the model's operators,
    where --tensorboard-dir says (beside the run's TensorBoard scalars), and a line that says where; the iteration
    lines are those of a plain run."""
    pytest.importorskip("tensorboard")   # --tensorboard-dir also writes scalars (tests/test_tensorboard_scalars.py)
    out = _train(*SMALL, "--iters", "3", "--no-trace", "--profile", "--use-pytorch-profiler",
                 "--profile-step-start", "1", "--profile-step-end", "3", "--tensorboard-dir", tmp_path / "tb")
    path, names, optimizer_steps = _profile_of(tmp_path / "tb")
    assert f"profile: iterations 2-3 of rank 0 in {path}" in out
    assert "aten::mm" in names and optimizer_steps == 2     # iterations 2 and 3, not 1 (the window's bounds)
    # each task of the schedule is a range named as the trace labels it (kind, chunk-microbatch)
    assert {"forward 0-0", "backward 0-1"} <= names
    # beside it, the operators with the most host time of their own, most first
    [ops] = list((tmp_path / "tb").glob("rank0.*.ops.json"))
    summary = json.loads(ops.read_text())
    assert summary["iterations"] == [2, 3] and summary["rank"] == 0
    host = [op["self_host_us"] for op in summary["operators"]]
    assert len(host) == 30 and host == sorted(host, reverse=True) and host[0] > 0
    assert all(op["calls"] >= 1 and op["self_device_us"] == 0 for op in summary["operators"])   # CPU: no device
    assert sum(line.startswith("iter ") for line in out.splitlines()) == 3
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1   # both in one directory, as Megatron-LM


def test_a_run_that_ends_inside_the_range_writes_what_was_recorded(tmp_path):
    """Megatron-LM's default end (step 12) after a run of 3 iterations: iterations 2-3 are written at the end, into
    the run's trace directory when no --tensorboard-dir is given."""
    out = _train(*SMALL, "--iters", "3", "--trace-dir", tmp_path / "traces", "--profile", "--use-pytorch-profiler",
                 "--profile-step-start", "1")
    path, names, optimizer_steps = _profile_of((tmp_path / "traces" / "latest" / "profile").resolve())
    assert "profile: iterations 2-3 of rank 0 in" in out and path.name in out
    assert "aten::mm" in names and optimizer_steps == 2


def test_a_resumed_run_profiles_what_is_left_of_the_range_and_says_when_nothing_is():
    profiler = StepProfiler(first=11, last=12, rank=0, out_dir=None, cuda=False)
    assert profiler.resumed_at(10) is None and profiler.first == 11      # resumed before the range: all of it
    assert profiler.resumed_at(11) is None and profiler.first == 12      # inside: what is left
    said = StepProfiler(first=11, last=12, rank=0, out_dir=None, cuda=False).resumed_at(12)
    assert said == "profile: iterations 11-12 are before this run's first, 13 (resumed): nothing profiled"


def test_a_profiler_that_cannot_start_or_write_says_so_and_training_goes_on(tmp_path, monkeypatch):
    import torch.profiler

    profiler = StepProfiler(first=2, last=3, rank=0, out_dir=tmp_path / "unwritable", cuda=False)
    assert profiler.before(1) is None and not profiler.running      # not its iteration
    monkeypatch.setattr(torch.profiler.profile, "start", lambda self: (_ for _ in ()).throw(RuntimeError("no CUPTI")))
    assert profiler.before(2) == "profile: not started on rank 0: RuntimeError: no CUPTI"
    assert not profiler.running and profiler.after(3) is None
    monkeypatch.undo()
    (tmp_path / "unwritable").write_text("a file where the directory would go")
    profiler.before(2)
    assert profiler.running
    said = profiler.after(3)
    assert said.startswith("profile: iterations 2-3 of rank 0 not written: FileExistsError") and not profiler.running


@pytest.mark.cuda
def test_nsys_capture_range_starts_and_stops_on_cuda():
    """Without --use-pytorch-profiler: cudaProfilerStart/Stop and NVTX ranges around the range (outside nsys both
    are no-ops that must not fail)."""
    profiler = StepProfiler(first=1, last=1, rank=0, out_dir=None, cuda=True)
    profiler.before(1)
    assert profiler.running
    torch.ones(4, device="cuda").sum().item()
    assert "nsys's capture range" in profiler.after(1) and not profiler.running
