"""--bf16 / --fp16: the flags (Megatron-LM's names and rules), the mixed-precision optimizer's arithmetic, and a short
fp16 run whose log reports the loss scale. Pipelined equality in bf16 and fp16: tests/test_pipeline_equality.py."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_app.train.args import UsageError, parse_args
from megatron_app.train.optim import AdamSettings, MixedPrecision, MixedPrecisionOptimizer
from megatron_app.train.optimizer_choice import build_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = {"WORLD_SIZE": "1"}


# ---- flags ----------------------------------------------------------------------------------------------------------

def test_precision_defaults_follow_megatron_lm():
    assert parse_args([], WORLD).precision == "fp32"
    bf16 = parse_args(["--bf16"], WORLD)
    assert bf16.precision == "bf16" and bf16.accumulate_allreduce_grads_in_fp32   # forced, as in Megatron-LM
    assert bf16.loss_scale is None and MixedPrecision.from_args(bf16).grad_scaler(torch.device("cpu")) is None
    fp16 = parse_args(["--fp16"], WORLD)
    assert fp16.precision == "fp16" and not fp16.accumulate_allreduce_grads_in_fp32
    assert (fp16.initial_loss_scale, fp16.min_loss_scale, fp16.loss_scale_window, fp16.hysteresis) == (2.0 ** 32, 1.0,
                                                                                                       1000, 2)
    assert MixedPrecision.from_args(fp16).dynamic["growth_interval"] == 1000
    constant = parse_args(["--bf16", "--loss-scale", "1024"], WORLD)
    assert MixedPrecision.from_args(constant).grad_scaler(torch.device("cpu")).scale.item() == 1024.0


def test_precision_reaches_the_transformer_config():
    from megatron_app.train.model import build_transformer_config

    for flag, dtype in (("--bf16", torch.bfloat16), ("--fp16", torch.float16), (None, torch.float32)):
        config = build_transformer_config(parse_args([flag] if flag else [], WORLD))
        assert config.params_dtype == config.pipeline_dtype == dtype
        assert (config.bf16, config.fp16) == (flag == "--bf16", flag == "--fp16")


@pytest.mark.parametrize("argv,fragment", [
    (["--bf16", "--fp16"], "--bf16 and --fp16 are two precisions"),
    (["--loss-scale", "1024"], "--loss-scale applies to --fp16 or --bf16 only"),
    (["--initial-loss-scale", "65536"], "--initial-loss-scale applies to --fp16 or --bf16 only"),
    (["--accumulate-allreduce-grads-in-fp32"], "applies to --fp16 or --bf16 only"),
    (["--bf16", "--hysteresis", "3"], "--bf16 has none"),
    (["--fp16", "--loss-scale", "1024", "--loss-scale-window", "10"], "--loss-scale makes the scale constant"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale must be positive"),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], "is above --initial-loss-scale"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis must be a positive integer"),
    (["--bf16", "--emulate-compute", "1,2"], "--emulate-compute replaces the model"),
])
def test_precision_mistakes_are_refused_in_one_line(argv, fragment):
    with pytest.raises(UsageError) as error:
        parse_args(argv, WORLD)
    assert fragment in str(error.value) and "\n" not in str(error.value)


# ---- the optimizer's arithmetic ---------------------------------------------------------------------------------------

def _chunk(dtype):
    chunk = torch.nn.Linear(4, 1, bias=False).to(dtype)
    chunk.config = SimpleNamespace(grad_scale_func=None)   # a model chunk's TransformerConfig, for the schedules
    with torch.no_grad():
        chunk.weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 3.0]]))
    return chunk


def _backward(chunk, scale=1.0, factor=1.0):
    """d(loss)/dw = factor * [1, 1, 1, 1] (times the loss scale)."""
    x = torch.full((1, 4), factor, dtype=chunk.weight.dtype)
    (chunk(x).float().sum() * scale).backward()


def test_bf16_gradients_accumulate_in_fp32_and_adam_steps_fp32_main_params():
    chunk = _chunk(torch.bfloat16)
    optimizer = build_optimizer([chunk], AdamSettings(lr=0.1), MixedPrecision(accumulate_in_fp32=True))
    weight = chunk.weight
    assert isinstance(optimizer, MixedPrecisionOptimizer) and optimizer.grad_scaler is None
    assert chunk.config.grad_scale_func is None
    assert weight.dtype == torch.bfloat16 and weight.main_grad.dtype == torch.float32
    assert [main.dtype for main in optimizer.main_params] == [torch.float32]
    # 1 + 256 x 2^-9: bf16 accumulation rounds every 1 + 2^-9 back to 1; the fp32 main_grad keeps them all.
    _backward(chunk)
    for _ in range(256):
        _backward(chunk, factor=2.0 ** -9)
    assert weight.grad is None                                        # the hook moved every gradient to main_grad
    assert torch.equal(weight.main_grad, torch.full((1, 4), 1.5))
    assert optimizer.step()
    state = optimizer.optimizer.state[optimizer.main_params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    main = optimizer.main_params[0]
    assert torch.allclose(main, torch.tensor([[0.9, -2.1, 0.4, 2.9]]), atol=1e-6)   # Adam's first step: lr x sign
    assert torch.equal(weight, main.to(torch.bfloat16))                # the model holds the main params, rounded
    optimizer.zero_grad()
    assert not weight.main_grad.any() and main.grad is None


def test_fp16_overflow_skips_the_step_and_the_scale_follows_megatron_rules():
    chunk = _chunk(torch.float16)
    mixed = MixedPrecision(accumulate_in_fp32=False, dynamic={
        "initial_scale": 2.0 ** 16, "min_scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 2, "hysteresis": 1})
    optimizer = build_optimizer([chunk], AdamSettings(lr=0.1), mixed)
    assert chunk.weight.main_grad.dtype == torch.float16
    assert chunk.config.grad_scale_func == optimizer.scale_loss          # the schedules' backward scales the loss
    before = chunk.weight.detach().clone()
    _backward(chunk, scale=optimizer.get_loss_scale(), factor=65504.0)    # 2^16 x 65504 overflows fp16
    assert not optimizer.step() and optimizer.last_step_skipped
    assert torch.equal(chunk.weight, before) and optimizer.get_loss_scale() == 2.0 ** 15
    for expected_scale in (2.0 ** 15, 2.0 ** 16):           # two clean steps, then growth (growth_interval 2)
        optimizer.zero_grad()
        _backward(chunk, scale=optimizer.get_loss_scale())
        assert optimizer.step()
        assert optimizer.get_loss_scale() == expected_scale
    assert torch.allclose(optimizer.main_params[0].grad, torch.ones(1, 4))   # unscaled before Adam saw it
    assert optimizer.report() == {"loss_scale": 2.0 ** 16, "skipped_iterations": 1, "skipped": False}


def test_state_dict_keeps_main_params_adam_state_and_loss_scale():
    def trained():
        chunk = _chunk(torch.float16)
        optimizer = build_optimizer([chunk], AdamSettings(lr=0.1), MixedPrecision(False, dynamic={
            "initial_scale": 1024.0, "min_scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": 1, "hysteresis": 2}))
        return chunk, optimizer

    chunk, optimizer = trained()
    _backward(chunk, scale=optimizer.get_loss_scale())
    optimizer.step()
    state = optimizer.state_dict()
    _, restored = trained()
    restored.load_state_dict(state)
    assert restored.get_loss_scale() == optimizer.get_loss_scale() == 2048.0
    assert torch.equal(restored.main_params[0], optimizer.main_params[0])
    assert torch.equal(restored.optimizer.state[restored.main_params[0]]["exp_avg"],
                       optimizer.optimizer.state[optimizer.main_params[0]]["exp_avg"])


# ---- short runs -----------------------------------------------------------------------------------------------------

def _train(*argv):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    for launcher_variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(launcher_variable, None)
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", *map(str, argv)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


SMALL = ["--no-trace", "--num-layers", "4", "--hidden-size", "32", "--seq-length", "32", "--vocab-size", "256",
         "--global-batch-size", "8", "--schedule", "megatron"]


def test_bf16_checkpoint_resumes_exactly_and_is_refused_in_fp32(tmp_path):
    """The checkpoint holds the fp32 main parameters and Adam state: a run resumed at iteration 2 continues with the
    losses of an uninterrupted one; resuming it without --bf16 is refused in one line."""
    logs = {name: tmp_path / f"{name}.json" for name in ("full", "first", "resumed")}
    _train("--bf16", *SMALL, "--iters", 4, "--log-json", logs["full"])
    _train("--bf16", *SMALL, "--iters", 4, "--save", tmp_path / "ckpt", "--exit-interval", 2, "--log-json", logs["first"])
    _train("--bf16", *SMALL, "--iters", 4, "--load", tmp_path / "ckpt", "--log-json", logs["resumed"])
    losses = {name: [entry["loss"] for entry in json.loads(path.read_text())["iterations"]]
              for name, path in logs.items()}
    assert losses["first"] + losses["resumed"] == losses["full"], losses
    with pytest.raises(UsageError, match="was trained in bf16 but this run has neither --bf16 nor --fp16"):
        parse_args([*SMALL, "--iters", "4", "--load", str(tmp_path / "ckpt")], WORLD)


def test_fp16_run_trains_and_reports_the_loss_scale(tmp_path):
    """Our schedule at P=1 with Megatron's dynamic loss scale from 2^20 (growth every 2 clean iterations): the first
    iterations overflow and are skipped, the scale halves, grows back, ...: the scales the log reports are those
    Megatron's DynamicGradScaler gives for the skips it reports, and the loss falls. Each iteration line shows the scale
    and the skipped iterations, as Megatron-LM's does."""
    log = tmp_path / "log.json"
    result = _train("--fp16", "--iters", "8", "--no-trace", "--num-layers", "4", "--hidden-size", "32", "--seq-length",
                    "32", "--vocab-size", "256", "--global-batch-size", "8", "--lr", "5e-3", "--initial-loss-scale",
                    2 ** 20, "--loss-scale-window", "2", "--log-json", log)
    lines = [line for line in result.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == 8 and all("| loss scale " in line for line in lines), lines
    assert "gradients overflowed" in lines[0]
    iterations = json.loads(log.read_text())["iterations"]
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron_app.train.cpu_compat import CudaDeviceToCpu

    with CudaDeviceToCpu():
        megatron = DynamicGradScaler(2.0 ** 20, 1.0, 2.0, 0.5, 2, 2)
    expected = []
    for entry in iterations:
        megatron.update(entry["skipped"])
        expected.append(megatron.scale.item())
    scales = [entry["loss_scale"] for entry in iterations]
    assert scales == expected and iterations[0]["skipped"]
    assert any(later > earlier for earlier, later in zip(scales, scales[1:]))   # it grew back at least once
    assert [entry["skipped_iterations"] for entry in iterations] == [
        sum(entry["skipped"] for entry in iterations[:i + 1]) for i in range(len(iterations))]
    assert not all(entry["skipped"] for entry in iterations)
    assert iterations[-1]["loss"] < iterations[0]["loss"] - 0.05
    assert json.loads(log.read_text())["config"]["precision"] == "fp16"
