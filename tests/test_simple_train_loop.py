"""examples/simple_train_loop.py, a user's own loop in the shape of NVIDIA's examples/run_simple_mcore_train_loop.py
(Megatron's DDP and config hooks, model chunks per virtual stage, one data iterator per chunk,
get_forward_backward_func after install(), keyed dropout 0.1 with set_iteration, optimizer step): at P=2 and P=2 V=2
it gives the losses of Megatron's own schedule at P=1 (Megatron's P > 1 schedules need CUDA)."""

import json

import pytest

from pipeline_runs import HELPERS, torchrun

WORKER = HELPERS / "simple_train_loop_worker.py"


def _run(tmp_path, name, nproc, flags, launcher=()):
    out = tmp_path / name
    out.mkdir()
    return out, torchrun(nproc, [*launcher, WORKER, *flags, "--out", out])


def _losses(tmp_path, name, nproc, flags):
    out, result = _run(tmp_path, name, nproc, flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "losses.json").read_text()), result.stderr


def _assert_equal(name, got, want):
    assert len(got) == len(want) == 3
    for it, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= 1e-5 * abs(w), f"{name} iteration {it}: {g} != P=1's {w}"


@pytest.mark.slow
def test_nvidia_shaped_loop_at_p2_v2_matches_megatrons_schedule_at_p1(tmp_path):
    """Dropout 0.1 (the example's default, Megatron's), keyed: P=2, P=2 V=2 and P=2 V=2 with a split backward, where
    DDP's overlapped reduction is driven by its own hooks (each weight's gradient must be registered ready exactly
    once, by a chunk's last B or last W), give Megatron's P=1 losses."""
    reference, _ = _losses(tmp_path, "p1", 1, ["--pipeline_parallel", 1, "--reference"])
    for name, nproc, extra in (("p2", 2, ["--pipeline_parallel", 2]),
                               ("p2v2", 2, ["--pipeline_parallel", 2, "--model_chunks", 2]),
                               ("p2v2-split", 2, ["--pipeline_parallel", 2, "--model_chunks", 2, "--split-backward"])):
        pipelined, stderr = _losses(tmp_path, name, nproc, extra)
        _assert_equal(name, pipelined, reference)
        assert stderr.count("megatron_app: rank") == 2, "one line per rank says the schedule is active"
    assert len(reference) == len(set(reference)), "the optimizer step changed nothing"


@pytest.mark.slow
def test_example_with_variable_lengths_through_wrap_data_iterator(tmp_path):
    """Whole documents through wrap_data_iterator, per-token loss, dropout 0.1 keyed by document: P=2 V=2 under our
    schedule, its documents packed or regrouped by 'balanced', equals P=1 under Megatron's on the loader's padded
    microbatches."""
    flags = ["--variable-lengths"]
    reference, _ = _losses(tmp_path, "p1", 1, ["--pipeline_parallel", 1, "--reference", *flags,
                                               "--composition", "loader"])
    for composition in ("packed", "balanced"):
        pipelined, _ = _losses(tmp_path, f"p2v2-{composition}", 2, ["--pipeline_parallel", 2, "--model_chunks", 2,
                                                                   *flags, "--composition", composition])
        _assert_equal(f"p2v2 {composition}", pipelined, reference)


@pytest.mark.slow
def test_a_misbuilt_stage_is_refused_in_one_line(tmp_path):
    """Every chunk built with pre_process=True (NVIDIA's one-stage model provider): the first call stops each rank,
    before any task runs, with one line naming the rank, the chunk and the fix, and no traceback (the hook that
    megatron_app.install() puts in front of sys.excepthook, runtime/one_line_errors.py). Each rank's own stderr is
    read (torchrun --redirects): what torchrun itself prints after a rank's exit (its ChildFailedError report) is the
    launcher's."""
    logs = tmp_path / "logs"
    _, result = _run(tmp_path, "misbuilt", 2, ["--pipeline_parallel", 2, "--model_chunks", 2, "--misbuild"],
                     launcher=["--log-dir", logs, "--redirects", "3"])
    assert result.returncode != 0
    fixes = {0: "pipeline rank 0's model chunk 1 (virtual stage 2 of 4, P=2 V=2) was built with pre_process=True; "
                "build it with pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1)",
             1: "pipeline rank 1's model chunk 0 (virtual stage 1 of 4, P=2 V=2) was built with pre_process=True; "
                "build it with pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0)"}
    for rank, fix in fixes.items():
        [stderr] = logs.glob(f"*/attempt_0/{rank}/stderr.log")
        lines = [line for line in stderr.read_text().splitlines() if line.strip()]
        assert lines == [f"megatron_app: rank {rank}: AppConfigError: {fix}"], lines


@pytest.mark.slow
def test_one_misbuilt_rank_stops_every_rank_with_one_line(tmp_path):
    """Only rank 1 misbuilt: rank 1 names its own fix, and rank 0, built right, does not wait for it and die of a closed
    connection: the ranks share their refusals at the first call (session.agree_on_layout), so rank 0 ends with one
    line naming rank 1 and its fix."""
    logs = tmp_path / "logs"
    _, result = _run(tmp_path, "misbuilt_one", 2, ["--pipeline_parallel", 2, "--model_chunks", 2, "--misbuild-rank", 1],
                     launcher=["--log-dir", logs, "--redirects", "3"])
    assert result.returncode != 0
    fix = ("pipeline rank 1's model chunk 0 (virtual stage 1 of 4, P=2 V=2) was built with pre_process=True; "
           "build it with pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0)")
    want = {0: f"megatron_app: rank 0: AppConfigError: stopped at the first call: rank 1 refused its model: {fix}",
            1: f"megatron_app: rank 1: AppConfigError: {fix}"}
    for rank, line in want.items():
        [stderr] = logs.glob(f"*/attempt_0/{rank}/stderr.log")
        lines = [text for text in stderr.read_text().splitlines() if text.strip()]
        assert lines == [line], lines
