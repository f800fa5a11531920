"""Megatron-LM's optimizer flags: --clip-grad, --weight-decay, Adam's betas and epsilon, and the learning-rate schedule
(--lr-decay-style, warm-up, --min-lr) with its checkpointing. Their meaning is Megatron's: the norm is checked
against torch's own clip_grad_norm_, the schedule against its closed form, the parameter groups against Megatron-Core's
no-weight-decay rule. That pipelined training with them equals P=1 (norms across pipeline and tensor-parallel ranks):
tests/test_pipeline_equality.py."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_app.train.args import UsageError, parse_args
from megatron_app.train.optim import AdamSettings, Fp32Optimizer, GlobalNormClipper, MixedPrecision, param_groups
from megatron_app.train.optimizer_choice import build_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = {"WORLD_SIZE": "1"}


# ---- flags ----------------------------------------------------------------------------------------------------------

def test_defaults_keep_a_constant_lr_adam_without_clipping_or_decay(tmp_path):
    args = parse_args([], WORLD)
    assert (args.clip_grad, args.weight_decay, args.lr_decay_style, args.min_lr) == (0.0, 0.0, "constant", 0.0)
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps) == (0.9, 0.999, 1e-8)
    megatron_names = parse_args(["--override-opt_param-scheduler", "--load", str(tmp_path)], WORLD)
    assert megatron_names.override_opt_param_scheduler


@pytest.mark.parametrize("argv,fragment", [
    (["--clip-grad", "-1"], "--clip-grad must be >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--adam-beta2", "1.0"], "--adam-beta2 must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps must be positive"),
    (["--lr-decay-style", "exponential"], "invalid choice"),
    (["--lr-decay-iters", "0", "--lr-decay-style", "linear"], "--lr-decay-iters must be a positive integer"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "both give the warm-up"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1)"),
    (["--min-lr", "1e-5"], "--min-lr shapes a decay; --lr-decay-style constant has none"),
    (["--lr-decay-iters", "10"], "--lr-decay-iters shapes a decay"),
    (["--lr-decay-style", "cosine", "--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.001"),
    (["--lr-warmup-init", "1e-4"], "give --lr-warmup-iters or --lr-warmup-fraction"),
    (["--lr-warmup-iters", "5", "--iters", "5"], "must end before --lr-decay-iters (5, default --iters)"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters N"),
    (["--lr-wsd-decay-style", "cosine"], "--lr-wsd-decay-style shapes WSD's anneal"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5", "--lr-warmup-iters", "1"],
     "--lr-wsd-decay-iters 5 must be 1..4"),
    (["--start-weight-decay", "0.1"], "--start-weight-decay shapes a changing weight decay"),
    (["--weight-decay-incr-style", "linear", "--end-weight-decay", "0.1"], "needs --start-weight-decay and"),
    (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.2", "--end-weight-decay", "0.1"],
     "--end-weight-decay 0.1 is below --start-weight-decay 0.2"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0", "--end-weight-decay", "0.1",
      "--weight-decay", "0.1"], "--weight-decay is a constant decay"),
    (["--override-opt-param-scheduler"], "applies when resuming (--load)"),
    (["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler", "--load", "x"], "give one"),
])
def test_optimizer_mistakes_are_refused_in_one_line(argv, fragment):
    with pytest.raises(UsageError) as error:
        parse_args(argv, WORLD)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def _schedule_of(*argv, iters=10, batch=8):
    """Each step's learning rate under these flags, from the scheduler the trainer builds."""
    from types import SimpleNamespace

    from megatron_app.train.lr_schedule import build_scheduler, current_lr

    args = parse_args(["--iters", str(iters), "--global-batch-size", str(batch), *argv], WORLD)
    scheduler = build_scheduler(SimpleNamespace(param_groups=[{"wd_mult": 1.0}]), args)
    rates = []
    for _ in range(iters):
        rates.append(current_lr(scheduler))
        scheduler.step(increment=batch)
    return rates


@pytest.mark.parametrize("style,closed_form", [
    ("linear", lambda s: 1e-4 + 9e-4 * (1 - (s - 2) / 8)),
    ("cosine", lambda s: 1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8))),
    ("inverse-square-root", lambda s: max(1e-4, 1e-3 * math.sqrt(2 / s))),
])
def test_each_decay_style_is_megatron_lms_closed_form(style, closed_form):
    """Step s (global batches done): warm-up from --lr-warmup-init for 2 steps, then the style down to --min-lr."""
    rates = _schedule_of("--lr-decay-style", style, "--lr-warmup-iters", "2", "--lr-warmup-init", "1e-5",
                         "--min-lr", "1e-4")
    expected = [1e-5 + (1e-3 - 1e-5) * s / 2 if s <= 2 else closed_form(s) for s in range(10)]
    assert rates == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("anneal,closed_form", [
    ("exponential", lambda r: 2 * 0.5 ** r - 1), ("linear", lambda r: 1 - r),
    ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)), ("minus_sqrt", lambda r: 1 - math.sqrt(r)),
])
def test_wsd_holds_the_peak_then_anneals_over_its_last_iterations(anneal, closed_form):
    rates = _schedule_of("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4", "--lr-wsd-decay-style", anneal,
                         "--min-lr", "1e-4")
    expected = [1e-3 if s <= 6 else 1e-4 + 9e-4 * closed_form((s - 6) / 4) for s in range(10)]
    assert rates == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("style,closed_form", [("linear", lambda r: r),
                                                ("cosine", lambda r: 0.5 * (math.cos(math.pi * (1 - r)) + 1))])
def test_an_increasing_weight_decay_follows_megatron_lm_and_spares_the_exempt_group(style, closed_form):
    from types import SimpleNamespace

    from megatron_app.train.lr_schedule import build_scheduler

    args = parse_args(["--iters", "10", "--global-batch-size", "8", "--weight-decay-incr-style", style,
                       "--start-weight-decay", "0.01", "--end-weight-decay", "0.1"], WORLD)
    groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}]
    scheduler = build_scheduler(SimpleNamespace(param_groups=groups), args)
    decays = []
    for _ in range(10):
        decays.append((groups[0]["weight_decay"], groups[1]["weight_decay"]))
        scheduler.step(increment=8)
    assert [d for d, _ in decays] == pytest.approx([0.01 + 0.09 * closed_form(s / 10) for s in range(10)])
    assert all(exempt == 0.0 for _, exempt in decays)


# ---- parameter groups, clipping -------------------------------------------------------------------------------------

class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.config = None


def test_weight_decay_spares_biases_and_norms_as_megatron_core_does():
    block = _Block()
    assert [len(group["params"]) for group in param_groups([block], 0.0)] == [4]   # one group: no decay anywhere
    decayed, exempt = param_groups([block], 0.1)
    assert decayed["params"] == [block.linear.weight] and decayed["wd_mult"] == 1.0
    assert exempt["params"] == [block.linear.bias, block.norm.weight, block.norm.bias] and exempt["wd_mult"] == 0.0


@pytest.fixture
def one_rank_group(tmp_path):
    """GlobalNormClipper all-reduces over the model-parallel group: Megatron's groups of a 1-rank gloo job."""
    from megatron.core import parallel_state

    from megatron_app.train.init import init_model_parallel

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        init_model_parallel(1, 1, 1, "cpu")
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _gradients(seed=0):
    torch.manual_seed(seed)
    block = _Block()
    block.linear(torch.randn(5, 4)).pow(2).sum().backward()
    block.norm(torch.randn(5, 3)).pow(3).sum().backward()
    return block


def test_clipping_matches_torch_clip_grad_norm(one_rank_group):
    ours, theirs = _gradients(), _gradients()
    params = list(ours.parameters())
    expected = torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), max_norm=0.5)
    norm = GlobalNormClipper(params, 0.5)([p.grad for p in params])
    assert norm == pytest.approx(expected.item(), rel=1e-6) and norm > 0.5
    for mine, reference in zip(params, theirs.parameters()):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-6, atol=0)
    unclipped = _gradients()
    before = [p.grad.clone() for p in unclipped.parameters()]
    GlobalNormClipper(list(unclipped.parameters()), 1e9)([p.grad for p in unclipped.parameters()])
    assert all(torch.equal(a, p.grad) for a, p in zip(before, unclipped.parameters()))   # below the clip: untouched


def test_fp32_optimizer_steps_adamw_on_the_clipped_gradients(one_rank_group):
    block, reference = _gradients(), _gradients()
    settings = AdamSettings(lr=0.1, weight_decay=0.2, betas=(0.8, 0.9), eps=1e-6, clip_grad=0.3)
    optimizer = build_optimizer([block], settings)
    assert isinstance(optimizer, Fp32Optimizer)
    for group in optimizer.param_groups:      # the scheduler multiplies wd_mult in; here by hand
        group["weight_decay"] = 0.2 * group["wd_mult"]
    norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.3)
    torch_adamw = torch.optim.AdamW([{"params": [reference.linear.weight], "weight_decay": 0.2},
                                     {"params": [reference.linear.bias, reference.norm.weight, reference.norm.bias],
                                      "weight_decay": 0.0}], lr=0.1, betas=(0.8, 0.9), eps=1e-6)
    assert optimizer.step()
    torch_adamw.step()
    assert optimizer.report()["grad_norm"] == pytest.approx(norm.item(), rel=1e-6)
    for mine, theirs in zip(block.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_mixed_precision_clips_the_unscaled_main_gradients(one_rank_group):
    """Under a loss scale the norm is the unscaled gradients' (Megatron clips after unscaling), and the step is
    AdamW on the fp32 main parameters with the clipped main gradients."""
    torch.manual_seed(1)
    chunk = torch.nn.Linear(4, 2, bias=False).to(torch.bfloat16)
    chunk.config = type("Config", (), {"grad_scale_func": None})()
    start = chunk.weight.detach().float().clone()
    optimizer = build_optimizer([chunk], AdamSettings(lr=0.01, clip_grad=0.25),
                                MixedPrecision(accumulate_in_fp32=True, loss_scale=1024.0))
    x = torch.randn(3, 4).to(torch.bfloat16)
    optimizer.scale_loss(chunk(x).float().pow(2).sum()).backward()
    unscaled = chunk.weight.main_grad.clone() / 1024.0
    assert optimizer.step()
    assert optimizer.report()["grad_norm"] == pytest.approx(unscaled.norm().item(), rel=1e-5)
    main = start.clone().requires_grad_(True)
    main.grad = unscaled * (0.25 / (unscaled.norm().item() + 1e-6))
    torch.optim.AdamW([main], lr=0.01, weight_decay=0.0).step()
    torch.testing.assert_close(optimizer.main_params[0], main.detach(), rtol=1e-6, atol=1e-7)


# ---- runs: the schedule in the log, checkpoints ------------------------------------------------------------------

def _train(*argv, check=True):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    for launcher_variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(launcher_variable, None)
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", *map(str, argv)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=240)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


SMALL = ["--no-trace", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--vocab-size", "256",
         "--global-batch-size", "8", "--clip-grad", "0.5", "--weight-decay", "0.05"]
SCHEDULE = ["--lr", "2e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--lr-warmup-init", "1e-4",
            "--min-lr", "2e-4"]


def _cosine_lr(iteration, iters=6, warmup=2, peak=2e-3, init=1e-4, floor=2e-4):
    """Megatron-LM's schedule in closed form: step s = iteration - 1 global batches done."""
    step = iteration - 1
    if step <= warmup:
        return init + (peak - init) * step / warmup
    ratio = (step - warmup) / (iters - warmup)
    return floor + (peak - floor) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def _log(path):
    return json.loads(path.read_text())["iterations"]


def test_the_schedule_and_norms_are_logged_and_a_resumed_run_continues_exactly(tmp_path):
    logs = {name: tmp_path / f"{name}.json" for name in ("full", "first", "resumed")}
    full = _train(*SMALL, *SCHEDULE, "--iters", 6, "--log-json", logs["full"])
    lines = [line for line in full.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == 6 and all(" | lr " in line and " | grad norm " in line for line in lines), lines
    iterations = _log(logs["full"])
    assert [entry["lr"] for entry in iterations] == pytest.approx([_cosine_lr(i) for i in range(1, 7)], rel=1e-12)
    assert all(entry["grad_norm"] > 0 for entry in iterations)
    _train(*SMALL, *SCHEDULE, "--iters", 6, "--save", tmp_path / "ckpt", "--exit-interval", 3, "--log-json",
           logs["first"])
    _train(*SMALL, *SCHEDULE, "--iters", 6, "--load", tmp_path / "ckpt", "--log-json", logs["resumed"])
    for key in ("loss", "lr", "grad_norm"):
        got = [entry[key] for entry in _log(logs["first"]) + _log(logs["resumed"])]
        assert got == [entry[key] for entry in iterations], key

    # Another schedule is refused before any rank starts, in one line naming the flag and both ways out ...
    with pytest.raises(UsageError, match=r"was trained with --lr 0.002 but this run has 0.003; give "
                                         r"--override-opt-param-scheduler .* --use-checkpoint-opt-param-scheduler"):
        parse_args([*SMALL, *SCHEDULE, "--lr", "3e-3", "--iters", "6", "--load", str(tmp_path / "ckpt")], WORLD)
    refused = _train(*SMALL, *SCHEDULE, "--lr-decay-style", "linear", "--iters", "6", "--load", tmp_path / "ckpt",
                     check=False)
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "was trained with --lr-decay-style cosine but this run has linear" in refused.stderr
    # ... and each way out does what it says: this run's peak, or the checkpoint's whatever the flags say.
    ours, kept = tmp_path / "override.json", tmp_path / "kept.json"
    _train(*SMALL, *SCHEDULE, "--lr", "3e-3", "--iters", 6, "--load", tmp_path / "ckpt",
           "--override-opt-param-scheduler", "--log-json", ours)
    assert [entry["lr"] for entry in _log(ours)] == pytest.approx([_cosine_lr(i, peak=3e-3) for i in (4, 5, 6)])
    _train(*SMALL, *SCHEDULE, "--lr", "3e-3", "--iters", 6, "--load", tmp_path / "ckpt",
           "--use-checkpoint-opt-param-scheduler", "--log-json", kept)
    assert [entry["lr"] for entry in _log(kept)] == pytest.approx([_cosine_lr(i) for i in (4, 5, 6)])


def test_a_checkpoint_from_before_schedules_resumes_at_its_samples(tmp_path):
    """A rank file without the scheduler's state and a manifest without the schedule (what earlier versions wrote,
    at a constant lr and without weight decay): the run resumes at its consumed samples; asking for weight decay
    there is refused in one line (the checkpoint trained without it)."""
    plain = SMALL[:-4]   # no --clip-grad, no --weight-decay
    _train(*plain, "--iters", 2, "--save", tmp_path / "ckpt")
    directory = tmp_path / "ckpt" / "iter_0000002"
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["training"]["lr_schedule"]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    for rank_file in directory.glob("*.pt"):
        payload = torch.load(rank_file, weights_only=True)
        del payload["opt_param_scheduler"]
        torch.save(payload, rank_file)
    log = tmp_path / "resumed.json"
    _train(*plain, "--iters", 4, "--load", tmp_path / "ckpt", "--log-json", log)
    assert [entry["lr"] for entry in _log(log)] == [1e-3, 1e-3]
    refused = _train(*SMALL, "--iters", 4, "--load", tmp_path / "ckpt", check=False)
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "was trained with --weight-decay 0.0 but this run has 0.05" in refused.stderr


def test_an_overflowed_fp16_step_does_not_advance_the_schedule(tmp_path):
    log = tmp_path / "log.json"
    _train("--fp16", *SMALL, "--iters", 6, "--lr-decay-style", "linear", "--initial-loss-scale", 2 ** 20,
           "--loss-scale-window", 2, "--log-json", log)
    iterations = _log(log)
    steps_taken = 0
    for entry in iterations:
        assert entry["lr"] == pytest.approx(1e-3 * (1 - steps_taken / 6)), iterations
        assert ("grad_norm" in entry) == (not entry["skipped"])   # a skipped step has no clipped norm
        steps_taken += not entry["skipped"]
    assert iterations[0]["skipped"] and steps_taken >= 2
