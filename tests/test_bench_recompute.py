"""tools/bench_recompute.py's logic (the modes' flags, the summary and its table) without training, and one short
real run of megatron_app.bench.peak_memory.run_once, which it and tools/bench_distributed_optimizer.py share."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_app.train.args import parse_args

REPO = Path(__file__).resolve().parent.parent
# tools/ is no package (nothing in megatron_app may import it): load the script by its path
_spec = importlib.util.spec_from_file_location("bench_recompute", REPO / "tools" / "bench_recompute.py")
bench_recompute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_recompute)

TWO_RANKS = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def test_every_mode_is_accepted_by_the_trainer_at_two_pipeline_stages_and_resolves_as_named():
    shared = bench_recompute.model_flags(bench_recompute.parse_options([]))
    resolved = {}
    for mode, mode_flags in bench_recompute.mode_flags(shared).items():
        args = parse_args(mode_flags, TWO_RANKS)
        assert (args.pipeline_parallel, args.hidden_dropout, args.attention_dropout) == (2, 0.1, 0.1)
        resolved[mode] = (args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
                          args.recompute_modules)
    assert resolved == {"none": (None, None, None, None),
                        "selective": ("selective", None, None, ["core_attn"]),
                        "full": ("full", "uniform", 1, None)}


def test_extra_trainer_flags_after_the_double_dash_reach_every_mode():
    flags = bench_recompute.mode_flags(bench_recompute.model_flags(
        bench_recompute.parse_options(["--num-layers", "4", "--", "--seed", "7"])))
    assert all(mode_flags[mode_flags.index("--num-layers") + 1] == "4" and "--seed 7" in " ".join(mode_flags)
               for mode_flags in flags.values())


@pytest.mark.parametrize("argv,line", [(["--iters", "1"], "--iters must be at least 2"),
                                       (["--repeats", "0"], "--repeats must be at least 1")])
def test_bad_bench_flags_exit_2_with_the_reason(argv, line, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_recompute.parse_options(argv)
    assert exited.value.code == 2 and line in capsys.readouterr().err


def test_summary_takes_medians_skips_the_first_iteration_and_compares_with_none():
    peaks = {"none": [1000.0, 1200.0, 1100.0], "selective": [700.0, 800.0, 600.0], "full": [500.0, 500.0, 500.0]}
    iteration_ms = {"none": [[900.0, 100.0, 100.0], [50.0, 110.0, 90.0], [1.0, 95.0, 105.0]],
                    "selective": [[900.0, 120.0, 120.0]] * 3,
                    "full": [[9.0, 150.0, 150.0, 160.0]] * 3}
    summary = bench_recompute.summarise(peaks, iteration_ms)
    assert list(summary) == ["none", "selective", "full"]
    assert summary["none"] == {"peak_rss_mib": 1100.0, "iteration_ms": 100.0, "memory_ratio": 1.0,
                               "saved_mib": 0.0, "time_ratio": 1.0}
    assert summary["selective"]["peak_rss_mib"] == 700.0 and summary["selective"]["saved_mib"] == 400.0
    assert summary["selective"]["memory_ratio"] == pytest.approx(7 / 11)
    assert summary["selective"]["time_ratio"] == pytest.approx(1.2)
    assert summary["full"]["iteration_ms"] == 150.0 and summary["full"]["time_ratio"] == pytest.approx(1.5)
    table = bench_recompute.format_table(summary).splitlines()
    assert table[0].split() == ["mode", "peak", "MiB", "vs", "none", "saved", "MiB", "iteration", "ms", "vs", "none"]
    assert table[2].split() == ["selective", "700", "0.64x", "400", "120.0", "1.20x"]
    assert table[3].split() == ["full", "500", "0.45x", "600", "150.0", "1.50x"]


def test_run_once_refuses_a_log_json_of_the_callers():
    from megatron_app.bench.peak_memory import run_once

    with pytest.raises(ValueError, match="its own --log-json"):
        run_once(["--log-json=out.json"], 1)


def test_a_short_pipelined_run_reports_each_ranks_peak_and_every_iterations_time():
    """Two spawned ranks, a tiny model, two iterations (a few seconds of training, mostly start-up)."""
    from megatron_app.bench.peak_memory import run_once

    run = run_once(["--pipeline-model-parallel-size", 2, "--num-layers", 2, "--hidden-size", 32,
                    "--num-attention-heads", 2, "--seq-length", 32, "--micro-batch-size", 1, "--global-batch-size", 2,
                    "--iters", 2, "--device", "cpu", "--no-trace", "--recompute-activations"], 2)
    assert len(run.peak_rss_mib) == 2 and all(peak > 0 for peak in run.peak_rss_mib)
    assert run.max_peak_rss_mib == max(run.peak_rss_mib)
    assert len(run.iteration_ms) == 2 and all(ms > 0 for ms in run.iteration_ms)
