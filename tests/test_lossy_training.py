"""The loss layer in the trainer: flags checked at start-up (one line, exit 2), a P=2 run under loss logs and traces
per-link statistics, p = 0 trains bit-identically to no loss layer; tools/loss_sweep.py's bookkeeping."""

import importlib.util
import json
import subprocess
import sys

import pytest

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
    assert not parse_args([], environ={}).loss_config.enabled


@pytest.mark.parametrize("flags, message", [
    (["--loss-model", "bernoulli", "--loss-rate", "1.2"], "--loss-rate must be a probability in [0, 1]"),
    (["--loss-model", "gilbert-elliott", "--loss-rate", "0.1", "--burst-length", "-3"],
     "--burst-length must not be negative"),
    (["--loss-model", "python:json.decoder"], "has none of send(tensor) -> mask"),
    (["--loss-on", "sideways", "--loss-model", "bernoulli", "--loss-rate", "0.1"], "--loss-on takes a comma list"),
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


def _train(tmp_path, name, *flags):
    log_json, traces = tmp_path / f"{name}.json", tmp_path / f"{name}_traces"
    result = subprocess.run(
        ["bash", str(REPO / "run_single.sh"), "--pipeline_parallel", "2", "--iters", "2", "--num-layers", "2",
         "--log-json", str(log_json), "--trace-dir", str(traces), *flags],
        cwd=REPO, env=run_env(LOG_DIR=tmp_path / f"{name}_logs"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [entry["loss"] for entry in json.loads(log_json.read_text())["iterations"]]
    events = []
    for path in sorted(traces.glob("trace_rank*.jsonl")):
        lines = path.read_text().splitlines()
        assert json.loads(lines[0])["schema_version"] == "1.1"
        events += [event for event in map(json.loads, lines[1:]) if event["kind"] == "loss"]
    return result.stdout, losses, events


@pytest.mark.slow
def test_pipeline_loss_in_training_is_logged_traced_and_zero_rate_is_exact(tmp_path):
    _, clean_losses, no_events = _train(tmp_path, "clean")
    assert no_events == []
    _, zero_losses, zero_events = _train(tmp_path, "zero", "--loss-model", "bernoulli", "--loss-rate", "0")
    assert zero_losses == clean_losses  # p = 0 changes nothing, bit for bit
    assert zero_events and all(event["extra"]["lost"] == 0 for event in zero_events)
    stdout, lossy_losses, events = _train(tmp_path, "lossy", "--loss-model", "bernoulli", "--loss-rate", "0.3",
                                          "--loss-packet-bytes", "256")
    assert lossy_losses != clean_losses
    assert "[lossy] rank 0 iteration 1: lost" in stdout and "pipeline 1->0 backward" in stdout
    links = {(event["extra"]["link"], event["extra"]["direction"]) for event in events}
    assert links == {("0->1", "forward"), ("1->0", "backward")}
    packets = sum(event["extra"]["packets"] for event in events)
    lost = sum(event["extra"]["lost"] for event in events)
    sigma = (0.3 * 0.7 / packets) ** 0.5
    assert abs(lost / packets - 0.3) < 3 * sigma


def _load_sweep():
    spec = importlib.util.spec_from_file_location("loss_sweep", REPO / "tools" / "loss_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loss_sweep_grid_and_baseline():
    sweep = _load_sweep()
    full = sweep.grid(sweep.parse_args([]))
    assert len(full) == 2 * (1 + 2 * 3)
    assert ("pipeline", "none", 0.0) in full and ("tp", "gilbert-elliott", 0.05) in full
    assert sweep.grid(sweep.parse_args(["--quick"])) == [
        ("pipeline", "none", 0.0), ("pipeline", "bernoulli", 0.1), ("tp", "none", 0.0), ("tp", "bernoulli", 0.1)]
    results = [{"traffic": "tp", "model": "none", "final_loss": 2.0},
               {"traffic": "tp", "model": "bernoulli", "final_loss": 2.5}]
    sweep.add_baseline(results)
    assert results[1]["delta"] == pytest.approx(0.5) and results[1]["relative"] == pytest.approx(0.25)
