"""The loss layer in the trainer: flags checked at start-up (one line, exit 2), p = 0 trains bit-identically to no
loss layer; tools/loss_sweep.py's bookkeeping, and its quick sweep, whose real runs show per-link loss statistics in
logs and traces and --loss-tp-sites narrowing tensor-parallel loss."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_app.lossy import TP_SITES
from megatron_app.trace.schema import SCHEMA_VERSION
from megatron_app.train.args import UsageError, parse_args
from pipeline_runs import REPO, run_env


def test_flags_become_a_loss_config():
    args = parse_args(["--loss-model", "gilbert-elliott", "--loss-rate", "0.05", "--burst-length", "4",
                       "--loss-on", "forward,tp-backward", "--loss-fill", "stale", "--loss-packet-bytes", "1500"],
                      environ={})
    config = args.loss_config
    assert (config.model, config.fill, config.packet_bytes, config.seed) == ("gilbert-elliott", "stale", 1500, 1234)
    assert config.loss_on == {"forward", "tp-backward"}
    assert config.pipeline and config.tp_backward and not config.tp_forward
    assert config.stationary_loss_rate() == pytest.approx(0.05)
    assert config.tp_sites == set(TP_SITES)  # default: every site
    assert not parse_args([], environ={}).loss_config.enabled
    narrowed = parse_args(["--loss-model", "bernoulli", "--loss-rate", "0.1", "--loss-tp-sites", "mappings, layers"],
                          environ={}).loss_config
    assert narrowed.tp_sites == {"mappings", "layers"}
    assert "(tp sites mappings,layers)" in narrowed.describe()


def test_loss_tp_sites_reach_the_integration():
    from megatron.core.tensor_parallel import cross_entropy, layers, mappings

    from megatron_app.lossy.training import TrainingLossLayer

    config = parse_args(["--loss-model", "bernoulli", "--loss-rate", "0.1", "--loss-on", "tp",
                         "--loss-tp-sites", "mappings,layers"], environ={}).loss_config
    layer = TrainingLossLayer(config, tensor_parallel_size=2, rank=0, log=lambda line: None)
    try:
        assert layer.integration.sites == {"mappings", "layers"}
        assert mappings.torch is not torch and layers.torch is not torch and cross_entropy.torch is torch
    finally:
        layer.close()
    assert mappings.torch is torch


@pytest.mark.parametrize("flags, message", [
    (["--loss-model", "bernoulli", "--loss-rate", "1.2"], "--loss-rate must be a probability in [0, 1]"),
    (["--loss-model", "gilbert-elliott", "--loss-rate", "0.1", "--burst-length", "-3"],
     "--burst-length must not be negative"),
    (["--loss-model", "python:json.decoder"], "has none of send(tensor) -> mask"),
    (["--loss-on", "sideways", "--loss-model", "bernoulli", "--loss-rate", "0.1"], "--loss-on takes a comma list"),
    (["--loss-model", "bernoulli", "--loss-rate", "0.1", "--loss-tp-sites", "mappings,cross-entropy"],
     "--loss-tp-sites: unknown site 'cross-entropy'; give all or a comma list of mappings, layers, cross_entropy, "
     "fused_cross_entropy, tp_utils, core_utils"),
    (["--loss-model", "bernoulli", "--loss-rate", "0.1", "--loss-tp-sites", ""], "--loss-tp-sites: unknown site ''"),
    (["--loss-tp-sites", "mappings"], "--loss-tp-sites needs a --loss-model"),
    (["--loss-model", "bernoulli", "--loss-rate", "0.1", "--loss-on", "forward", "--loss-tp-sites", "layers"],
     "--loss-tp-sites applies to tensor-parallel traffic: add tp, tp-forward or tp-backward to --loss-on"),
])
def test_bad_loss_flags_are_one_line_errors(flags, message):
    with pytest.raises(UsageError) as error:
        parse_args(flags, environ={})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_loss_flag_exits_2_with_one_line():
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", "--loss-model", "bernoulli",
                             "--loss-rate", "-1", "--check-config"], cwd=REPO, env=run_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "megatron_app.train: error: --loss-rate must be a probability in [0, 1], got -1.0"]


@pytest.mark.parametrize("launcher", [
    ["run_single.sh"],
    ["run_master.sh", "--nnodes", "2", "--master_addr", "127.0.0.1"],
    ["run_worker.sh", "--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1"],
])
def test_launchers_refuse_an_unknown_tp_site_before_starting_ranks(launcher):
    result = subprocess.run(["bash", *launcher, "--tensor_parallel", "2", "--loss-model", "bernoulli",
                             "--loss-rate", "0.1", "--loss-tp-sites", "mappings,xentropy"], cwd=REPO,
                            env=run_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "megatron_app.train: error: --loss-tp-sites: unknown site 'xentropy'; give all or a comma list of mappings, "
        "layers, cross_entropy, fused_cross_entropy, tp_utils, core_utils"]


def _train(tmp_path, name, *flags, layout=("--pipeline_parallel", "2")):
    log_json, traces = tmp_path / f"{name}.json", tmp_path / f"{name}_traces"
    result = subprocess.run(
        ["bash", str(REPO / "run_single.sh"), *layout, "--iters", "2", "--num-layers", "2",
         "--log-json", str(log_json), "--trace-dir", str(traces), *flags],
        cwd=REPO, env=run_env(LOG_DIR=tmp_path / f"{name}_logs"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [entry["loss"] for entry in json.loads(log_json.read_text())["iterations"]]
    return result.stdout, losses, _loss_events(traces)


@pytest.mark.slow
def test_zero_loss_rate_trains_bit_identically_to_no_loss_layer(tmp_path):
    _, clean_losses, no_events = _train(tmp_path, "clean")
    assert no_events == []
    _, zero_losses, zero_events = _train(tmp_path, "zero", "--loss-model", "bernoulli", "--loss-rate", "0")
    assert zero_losses == clean_losses  # p = 0 changes nothing, bit for bit
    assert zero_events and all(event["extra"]["lost"] == 0 for event in zero_events)


def _loss_events(trace_root):
    events = []
    for path in sorted((trace_root / "latest").glob("trace_rank*.jsonl")):
        lines = path.read_text().splitlines()
        assert json.loads(lines[0])["schema_version"] == SCHEMA_VERSION
        events += [event for event in map(json.loads, lines[1:]) if event["kind"] == "loss"]
    return events


def _load_sweep():
    from megatron_app.bench import loss_sweep

    return loss_sweep


def test_loss_sweep_grid_and_baseline():
    sweep = _load_sweep()
    full = sweep.grid(sweep.parse_args([]))
    assert len(full) == 2 * (1 + 2 * 3) + 2 * 3  # the tp groups share one lossless run
    assert ("pipeline", "none", 0.0) in full and ("tp", "gilbert-elliott", 0.05) in full
    assert ("tp_all_sites", "bernoulli", 0.01) in full and ("tp_all_sites", "none", 0.0) not in full
    assert sweep.grid(sweep.parse_args(["--quick"])) == [
        ("pipeline", "none", 0.0), ("pipeline", "bernoulli", 0.1), ("tp", "none", 0.0), ("tp", "bernoulli", 0.1),
        ("tp_all_sites", "bernoulli", 0.1)]
    results = [{"traffic": "tp", "model": "none", "final_loss": 2.0},
               {"traffic": "tp", "model": "bernoulli", "final_loss": 2.5},
               {"traffic": "tp_all_sites", "model": "bernoulli", "final_loss": 3.0},
               {"traffic": "tp_all_sites", "model": "gilbert-elliott", "final_loss": None}]
    sweep.add_baseline(results)
    assert results[1]["delta"] == pytest.approx(0.5) and results[1]["relative"] == pytest.approx(0.25)
    assert results[2]["lossless_final_loss"] == 2.0 and results[2]["relative"] == pytest.approx(0.5)
    assert results[3]["delta"] is None and results[3]["relative"] is None


def test_loss_sweep_narrows_to_pipeline_rates_at_the_default_model_size():
    sweep = _load_sweep()
    args = sweep.parse_args(["--traffic", "pipeline", "--rates", "0.1,0.005,0.02", "--num-layers", "8"])
    assert sweep.grid(args) == [("pipeline", "none", 0.0)] + [
        ("pipeline", model, rate) for model in sweep.MODELS for rate in (0.005, 0.02, 0.1)]
    flags = sweep.model_flags(args.num_layers)
    assert flags[flags.index("--num-layers") + 1] == "8" and sweep.MODEL_FLAGS[1] == "4"
    only_ce = sweep.grid(sweep.parse_args(["--traffic", "tp_all_sites", "--models", "bernoulli", "--rates", "0.01"]))
    assert only_ce == [("tp", "none", 0.0), ("tp_all_sites", "bernoulli", 0.01)]  # its lossless run still comes
    assert [sweep.percent(rate) for rate in (0.1, 0.01, 0.005, 0.002)] == ["10%", "1%", "0.5%", "0.2%"]


@pytest.mark.parametrize("flags, message", [
    (["--rates", "0.1,x"], "--rates takes a comma list"), (["--rates", "0,0.1"], "between 0 and 1"),
    (["--traffic", "pipe"], "--traffic takes a comma list"), (["--models", "uniform"], "--models takes"),
    (["--num-layers", "0"], "--num-layers must be positive")])
def test_loss_sweep_refuses_bad_grid_flags(flags, message, capsys):
    sweep = _load_sweep()
    with pytest.raises(SystemExit) as exit_info:
        sweep.parse_args(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("traffic, sites", [
    ("tp", {"mappings", "layers", "tp_utils", "core_utils"}), ("tp_all_sites", set(TP_SITES))])
def test_loss_sweep_tp_groups_choose_sites_the_trainer_accepts(traffic, sites):
    sweep = _load_sweep()
    layout, placement, _ = sweep.TRAFFIC[traffic]
    args = parse_args([*layout, *sweep.MODEL_FLAGS, "--loss-model", "bernoulli", "--loss-rate", "0.1", *placement],
                      environ={"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    assert args.loss_config.tp_sites == sites and args.loss_config.tensor_parallel


def test_loss_sweep_reports_a_diverged_run_instead_of_crashing(tmp_path, capsys):
    sweep = _load_sweep()
    nan, inf = float("nan"), float("inf")
    assert sweep.summarize_losses([6.9, 6.5, 6.0, 5.8], tail=2) == {
        "losses": [6.9, 6.5, 6.0, 5.8], "final_loss": pytest.approx(5.9), "diverged": None}
    diverged = sweep.summarize_losses([6.9, 6.5, 6.1, nan, nan], tail=2)
    assert diverged == {"losses": [6.9, 6.5, 6.1, None, None], "final_loss": None,
                        "diverged": {"iteration": 4, "value": "NaN"}}
    assert sweep.summarize_losses([6.9, -inf, nan], tail=2)["diverged"] == {"iteration": 2, "value": "-inf"}

    def run(traffic, model, rate, losses):
        return {"traffic": traffic, "model": model, "rate": rate, "observed_rate": rate, **losses}

    results = [run("tp", "none", 0.0, sweep.summarize_losses([6.9, 6.5, 6.1], tail=2)),
               run("tp", "bernoulli", 0.01, sweep.summarize_losses([6.9, 6.6, 6.2], tail=2)),
               run("tp_all_sites", "bernoulli", 0.01, diverged)]
    sweep.add_baseline(results)
    sweep.print_table(results)
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["traffic", "model"] and len(table) == 4
    assert "tp (T=2), cross-entropy exact" in table[2] and "+1.59%" in table[2]
    assert "tp (T=2) incl. cross-entropy" in table[3] and "diverged (NaN at iter 4)" in table[3]
    assert sweep.markdown_table(results).splitlines()[2:] == [
        "| tp (T=2), cross-entropy exact | bernoulli | +1.6% |",
        "| tp (T=2) incl. cross-entropy | bernoulli | diverged (NaN at iter 4) |"]
    json.dumps(results, allow_nan=False)  # the sweep's JSON stays standard
    sweep.plot(results, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


@pytest.mark.slow
def test_loss_sweep_quick_runs_every_traffic_group(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "tools" / "loss_sweep.py"), "--quick", "--iters", "3",
                             "--out-dir", str(tmp_path)], cwd=REPO, env=run_env(), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "loss_sweep.json").read_text())
    runs = {(run["traffic"], run["model"]): run for run in summary["runs"]}
    assert set(runs) == {("pipeline", "none"), ("pipeline", "bernoulli"), ("tp", "none"), ("tp", "bernoulli"),
                         ("tp_all_sites", "bernoulli")}
    for (traffic, model), run in runs.items():
        assert len(run["losses"]) == 3
        assert (run["lost"] > 0) == (model != "none"), (traffic, model)
    assert runs[("tp_all_sites", "bernoulli")]["packets"] > runs[("tp", "bernoulli")]["packets"]
    assert len(result.stdout.splitlines()) == 1 + len(runs) + 1  # header, one row per run, "wrote ..."
    assert (tmp_path / "loss_sweep.png").stat().st_size > 0

    # Each run is a real training run under loss: its log and trace say what was lost, where.
    pipeline_log = (tmp_path / "pipeline_bernoulli_0.1.log").read_text()
    assert "[lossy] rank 0 iteration 1: lost" in pipeline_log and "pipeline 1->0 backward" in pipeline_log
    events = _loss_events(tmp_path / "pipeline_bernoulli_0.1_trace")
    assert {(event["extra"]["link"], event["extra"]["direction"]) for event in events} == {
        ("0->1", "forward"), ("1->0", "backward")}
    packets = sum(event["extra"]["packets"] for event in events)
    lost = sum(event["extra"]["lost"] for event in events)
    assert abs(lost / packets - 0.1) < 3 * (0.1 * 0.9 / packets) ** 0.5
    # --loss-tp-sites narrows tensor-parallel loss: the "tp" group leaves the cross-entropy all-reduces exact.
    every_site = {event["extra"]["link"] for event in _loss_events(tmp_path / "tp_all_sites_bernoulli_0.1_trace")}
    assert any(link.startswith("tp:cross_entropy.") for link in every_site), every_site
    narrowed = {event["extra"]["link"] for event in _loss_events(tmp_path / "tp_bernoulli_0.1_trace")}
    assert narrowed and not any("cross_entropy" in link for link in narrowed), narrowed
    assert "tp:mappings.all_reduce@rank0" in narrowed
    lossy_lines = [line for line in (tmp_path / "tp_bernoulli_0.1.log").read_text().splitlines() if "[lossy]" in line]
    assert lossy_lines and not any("cross_entropy" in line for line in lossy_lines)


def test_loss_sweep_runs_keep_going_past_a_nan(tmp_path):
    sweep = _load_sweep()
    flags = sweep.trainer_flags(sweep.parse_args([]), "tp_all_sites", "bernoulli", 0.1, tmp_path / "log.json",
                                tmp_path / "trace")
    layout_world = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    assert parse_args(flags, environ=layout_world).check_for_nan_in_loss_and_grad is False   # it measures divergence
