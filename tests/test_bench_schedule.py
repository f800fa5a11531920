"""tools/bench_schedule.py: a --quick run end to end (every scenario x schedule row in the JSON, every policy of our
runtime completing under every perturbation), the emulated task durations its traces show, the slow link's delayed
sends, the simulator's view of emulation, and one-line errors for bad flags."""

import json
import math
import subprocess
import sys

import pytest

from pipeline_runs import REPO, run_env

from megatron_app.bench.schedule import cli as bench_schedule
from megatron_app.bench.schedule.analysis import spec_of, torch_span_metrics
from megatron_app.bench.schedule.plan import build_plan
from megatron_app.bench.schedule.rows import DEFAULT_SCHEDULE_KEYS, SCHEDULES, SPLIT_BACKWARD_KEYS
from megatron_app.bench.schedule.scenarios import SCENARIO_KEYS
from megatron_app.schedule import PipelineShape
from megatron_app.emulation.sim_replay import simulate_emulation
from megatron_app.emulation.spec import EmulationSpec
from megatron_app.trace.schema import FIRST_ITERATION

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")
TOOL = REPO / "tools" / "bench_schedule.py"


def _bench(*flags, timeout=240):
    return subprocess.run([sys.executable, str(TOOL), *map(str, flags)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=timeout)


# Every schedule row but planned with a split backward (the split mechanism of adaptive's row, another policy),
# torch's zero-bubble order in our runtime (its schedule file runs in the equality test) and planned-fixed (planned's
# own runtime path, one flag apart): the CI budget.
QUICK_KEYS = [key for key in DEFAULT_SCHEDULE_KEYS if key not in ("app-planned-split", "torch-zb-order",
                                                                  "planned-fixed")]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick run (P=2, every scenario, the QUICK_KEYS schedules), traces kept: (JSON payload, run directory, stdout)."""
    out = tmp_path_factory.mktemp("bench")
    result = _bench("--quick", "--schedules", ",".join(QUICK_KEYS), "--json", out / "bench.json",
                    "--png", out / "bench.png", "--work-dir", out / "work")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dirs = [p for p in (out / "work").iterdir() if p.is_dir()]
    assert len(run_dirs) == 1
    assert (out / "bench.png").stat().st_size > 10_000
    return json.loads((out / "bench.json").read_text()), run_dirs[0], result.stdout


def test_quick_json_has_every_scenario_and_schedule(quick):
    payload, _, stdout = quick
    rows = payload["rows"]
    assert {(row["scenario"], row["key"]) for row in rows} == {
        (scenario, key) for scenario in SCENARIO_KEYS.values() for key in QUICK_KEYS}
    P = payload["config"]["pipeline_parallel"]
    for row in rows:
        assert row["iteration_ms"] > 0 and len(row["iteration_ms_each"]) == payload["config"]["iters"]
        assert 0.0 <= row["bubble_ratio"] < 1.0
        assert len(row["peak_activations"]) == P and all(p >= 1 for p in row["peak_activations"])
        assert row["bound_ms"] > 0
        if row["key"] in ("torch-zb", "torch-zb-order"):    # the simulator runs no torch order
            assert row["sim_ms"] is None
        else:
            assert row["sim_ms"] >= row["bound_ms"] - 1e-6 and math.isfinite(row["sim_error"])
        if row["system"] == "app":
            assert math.isfinite(row["own_bound_error"]) and row["own_bound_error"] > -0.05
            assert row["key"] == "torch-zb-order" or math.isfinite(row["replay_error"])
    assert any(check["target"].startswith("simulator predicts") for check in payload["targets"])
    assert "targets:" in stdout and "APP adaptive" in stdout


def test_static_orders_hold_what_megatron_holds(quick):
    """Megatron's interleaved order on our runtime and torch's interleaved 1F1B hold the same activations per rank
    (both follow Megatron's warm-up rule), and our greedy policies stay within that cap in every scenario."""
    rows = quick[0]["rows"]
    for scenario in SCENARIO_KEYS.values():
        by_key = {row["key"]: row for row in rows if row["scenario"] == scenario}
        cap = by_key["interleaved"]["peak_activations"]
        assert by_key["torch-interleaved"]["peak_activations"] == cap
        for key in ("dfc", "bfc", "adaptive"):
            assert all(a <= b for a, b in zip(by_key[key]["peak_activations"], cap)), (scenario, key)


def _plan(run_dir):
    return json.loads((run_dir / "plan.json").read_text())


def test_traced_task_durations_are_the_emulated_ones(quick):
    """Every traced forward/backward of our runtime lasts at least its drawn duration and little more."""
    from megatron_app.trace import read_trace_dir
    from megatron_app.emulation.sim_replay import measured_durations

    _, run_dir, _ = quick
    checked = 0
    for run in _plan(run_dir)["runs"]:
        if run["system"] != "app" or run.get("split_backward"):   # split rows: B + W share the drawn backward
            continue
        spec = spec_of(run)
        shape = PipelineShape(run["pipeline_parallel"], run["model_chunks"], run["microbatches"])
        trace = read_trace_dir(run_dir / run["id"] / "trace", shape.num_stages, shape.num_chunks)
        for iteration in range(run["iterations"]):
            drawn = spec.draw(shape, iteration)
            measured = measured_durations(trace, iteration + FIRST_ITERATION)   # the trace counts from 1
            excess = [m - d for rank_m, rank_d in zip(measured, drawn) for kind_m, kind_d in zip(rank_m, rank_d)
                      for chunk_m, chunk_d in zip(kind_m, kind_d) for m, d in zip(chunk_m, chunk_d)]
            assert min(excess) >= -200.0, run["label"]            # a wait never ends early (200 us clock slack)
            assert sorted(excess)[len(excess) // 2] < 5_000.0, run["label"]   # typical overhead well under 5 ms
            checked += 1
    runtime_schedules = sum(1 for key in QUICK_KEYS
                            if SCHEDULES[key].system == "app" and key not in SPLIT_BACKWARD_KEYS)
    assert checked == len(SCENARIO_KEYS) * runtime_schedules * 3    # x (1 warm-up + 2 measured) iterations


def test_slow_link_sends_in_the_window_are_delayed(quick):
    from megatron_app.trace import read_trace_dir
    from megatron_app.emulation import SlowLink

    _, run_dir, _ = quick
    run = next(r for r in _plan(run_dir)["runs"] if r["scenario"] == "slow link" and r["key"] == "interleaved")
    spec = SlowLink.parse_delay(run["slow_link"])
    trace = read_trace_dir(run_dir / run["id"] / "trace", run["pipeline_parallel"], run["model_chunks"])
    delayed, in_window = 0, []
    # the measured iterations, numbered as the trace does; not the first, which also opens the transport
    for iteration in range(run["warmup"] + FIRST_ITERATION, run["iterations"] + FIRST_ITERATION):
        # The window opens when the step begins, just before each rank's forward_backward call (its `iteration`
        # event; the first task can come tens of ms later on a loaded machine): 20 ms of margin at its end.
        start = min(e.start for rank in trace.ranks for e in rank.events_of(iteration, ["iteration"]))
        for rank in trace.ranks:
            for send in rank.events_of(iteration, ["send"]):
                since_us = send.start - start
                if spec.joins(rank.meta.pp_rank, send.peer) and spec.start_us <= since_us < spec.end_us - 20_000:
                    in_window.append(send)
                    delayed += send.duration >= spec.delay_us * 0.95
    # A rank's window opens at its own step's start, which can come before its call by more than the margin when the
    # 2-core machine is loaded (planning, a descheduled rank): a send of such a step may fall outside its window
    # while inside the trace's. Nearly every send in the window is delayed, and at least two an iteration.
    assert delayed >= 2 * (run["iterations"] - run["warmup"]), in_window
    assert delayed >= 0.8 * len(in_window), [send for send in in_window if send.duration < spec.delay_us * 0.95]


def test_simulated_emulation_meets_the_closed_forms():
    """Uniform costs, free messages: 1F1B takes (m+P-1)(f+b), Megatron's interleaved order V*m*(f+b)+(P-1)(f+b)."""
    spec = EmulationSpec.parse("10,20")
    one = simulate_emulation(spec, PipelineShape(4, 1, 8), "1f1b", iterations=2)
    assert [it.makespan_us for it in one] == pytest.approx([(8 + 3) * 30_000] * 2)
    interleaved = simulate_emulation(spec, PipelineShape(4, 2, 8), "interleaved", iterations=1)[0]
    assert interleaved.makespan_us == pytest.approx(2 * 8 * 30_000 + 3 * 30_000)
    assert interleaved.lower_bound_us == pytest.approx(interleaved.makespan_us)


def test_torch_span_metrics_counts_idle_time_and_held_activations():
    # two ranks, iteration 3; rank 0 busy 0-10 and 20-30 (of a 0-40 window), rank 1 busy 10-40
    spans = [[(3, "forward", 0, 0, 0.000, 0.010), (3, "forward", 0, 1, 0.020, 0.025),
              (3, "backward", 0, 0, 0.025, 0.030), (2, "forward", 0, 0, 5.0, 6.0)],
             [(3, "forward", 0, 0, 0.010, 0.020), (3, "backward_input", 0, 0, 0.020, 0.030),
              (3, "forward", 0, 1, 0.030, 0.035), (3, "backward_weight", 0, 0, 0.035, 0.040)]]
    metrics = torch_span_metrics(spans, 3)
    assert metrics["makespan_us"] == pytest.approx(40_000)
    assert metrics["bubble"] == pytest.approx(((1 - 20 / 40) + (1 - 30 / 40)) / 2)
    assert metrics["peaks"] == [2, 2]     # rank 1 frees only when the weight-gradient part ends


@pytest.mark.parametrize("flags, message", [
    (["--schedules", "dfc,nope"], "unknown schedule nope"),
    (["--scenarios", "sunny"], "unknown scenario sunny"),
    (["-P", "1"], "at least 2"),
    (["-P", "4", "-m", "6"], "num_microbatches=6"),
    (["--link-delay", "0-9:0-1:1"], "rank 9 is outside"),
    (["--slow-link", "0-1:0-1:1"], "--slow-link is the simulator's flag"),
    (["--warmup", "0"], "--warmup must be >= 1"),
    (["--fwd-ms", "-3"], "expected a number > 0"),
])
def test_bad_flags_give_one_line_and_exit_2(flags, message):
    result = _bench(*flags, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_replay_of_a_traced_run_compares_every_iteration(quick, tmp_path, capsys):
    """--replay-trace: the simulator fed with a run's measured task durations, next to its measured makespans."""

    _, run_dir, _ = quick
    run = next(r for r in _plan(run_dir)["runs"] if r["scenario"] == "homogeneous" and r["key"] == "interleaved")
    code = bench_schedule.main(["--replay-trace", str(run_dir / run["id"] / "trace"),
                                "--json", str(tmp_path / "replay.json")])
    assert code == 0
    payload = json.loads((tmp_path / "replay.json").read_text())
    assert payload["policy"] == "interleaved"
    assert [row["iteration"] for row in payload["iterations"]] == list(range(FIRST_ITERATION,
                                                                             run["iterations"] + FIRST_ITERATION))
    assert {row["microbatches"] for row in payload["iterations"]} == {run["microbatches"]}   # each iteration's own
    for row in payload["iterations"]:
        # the replayed makespan can only miss what the durations do not hold: message latency and overheads
        assert 0 < row["sim_ms"] <= row["measured_ms"] * 1.02
    assert "median |error|" in capsys.readouterr().out


def test_replay_of_a_missing_directory_is_one_line(tmp_path):
    result = _bench("--replay-trace", tmp_path / "nothing", timeout=60)
    assert result.returncode == 2
    assert "does not exist" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_repeats_are_planned_round_robin_and_pooled_per_row(quick, tmp_path):
    from megatron_app.bench.schedule.analysis import analyse_plan

    args = bench_schedule.parse_args(["--quick", "--repeats", "2", "--scenarios", "homogeneous,jitter",
                                      "--schedules", "dfc,torch-zb"])
    plan = build_plan(args, tmp_path)
    assert [(r["repeat"], r["scenario"], r["key"]) for r in plan["runs"]] == [
        (repeat, scenario, key) for repeat in (0, 1) for scenario in ("homogeneous", "jitter +-30%")
        for key in ("dfc", "torch-zb")]
    assert len({r["id"] for r in plan["runs"]}) == 8
    # Pooling: one row per (scenario, schedule) holding the measured iterations of every repeat (here the quick
    # run's results, listed twice).
    _, run_dir, _ = quick
    quick_plan = _plan(run_dir)
    chosen = [r for r in quick_plan["runs"] if r["scenario"] == "homogeneous" and r["key"] in ("dfc", "torch-zb")]
    rows = analyse_plan({"out_dir": str(run_dir), "runs": chosen + [dict(r, repeat=1) for r in chosen]})
    assert [row.key for row in rows] == ["dfc", "torch-zb"]
    measured_per_run = chosen[0]["iterations"] - chosen[0]["warmup"]
    for row in rows:
        assert len(row.iteration_ms_each) == 2 * measured_per_run


def test_torchs_zero_bubble_order_row_runs_our_trainer_on_torchs_lists(tmp_path):
    """The row is planned with torch's lists written beside the runs and handed to the trainer (--schedule-file);
    the lists are checked to complete on the pipeline the row runs."""
    from megatron_app.bench.schedule.worker import trainer_argv

    from megatron_app.runtime.settings import read_action_lists
    from megatron_app.schedule.action_lists import orders_from_action_lists

    args = bench_schedule.parse_args(["--quick", "--scenarios", "homogeneous", "--schedules", "torch-zb-order"])
    (run,) = build_plan(args, tmp_path)["runs"]
    assert run["split_backward"] and run["sim_policy"] is None
    argv = trainer_argv(run, None)
    assert argv[argv.index("--schedule-file") + 1] == run["schedule_file"] and "--split-backward" in argv
    shape = PipelineShape(run["pipeline_parallel"], run["model_chunks"], run["microbatches"], split_backward=True)
    assert len(orders_from_action_lists(shape, read_action_lists(run["schedule_file"]))) == shape.num_stages
