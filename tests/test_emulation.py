"""Compute emulation: the spec and its draws, the timed autograd function, emulated chunks through Megatron's own
forward_step/backward_step, and the trainer's flags. (Multi-rank runs: tests/test_bench_schedule.py.)"""

import time

import pytest
import torch

from megatron_app.schedule import Kind, PipelineShape, ScheduleConfigError
from megatron_app.sim.costs import ComputeCosts, ComputePerturbations, draw_durations
from megatron_app.emulation.spec import EmulationSpec, TaskDurations

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")

SHAPE = PipelineShape(4, 2, 8)


def test_parse_reads_times_and_jitter():
    spec = EmulationSpec.parse("10,20,0.3", slow_rank=1, slow_factor=1.5, straggler_prob=0.1, straggler_factor=3,
                               seed=7)
    assert (spec.forward_ms, spec.backward_ms, spec.seed) == (10.0, 20.0, 7)
    assert spec.perturbations == ComputePerturbations(slow_rank=1, slow_factor=1.5, jitter=0.3, straggler_prob=0.1,
                                                      straggler_factor=3.0)
    assert EmulationSpec.parse("4,8").perturbations == ComputePerturbations()


@pytest.mark.parametrize("text", ["10", "10,20,0.3,1", "a,20", "10,-1", "10,20,1.5", "10,inf"])
def test_parse_rejects_bad_text_with_one_line(text):
    with pytest.raises(ScheduleConfigError) as info:
        EmulationSpec.parse(text)
    assert "\n" not in str(info.value)


def test_durations_are_the_simulators_draws():
    """Same (seed, iteration, rank) keyed draws as megatron_app.sim: schedules and simulator see equal tasks."""
    spec = EmulationSpec.parse("10,20,0.3", slow_rank=2, slow_factor=1.5, straggler_prob=0.2, seed=3)
    durations = TaskDurations(spec, SHAPE)
    for iteration in (0, 1, 5):
        want = draw_durations(SHAPE, ComputeCosts.uniform(SHAPE, 10_000, 20_000), spec.perturbations, 3, iteration)
        for rank in range(4):
            for kind, index in ((Kind.FORWARD, 0), (Kind.BACKWARD, 1)):
                for chunk in range(2):
                    got = [durations.seconds(iteration, rank, kind, chunk, mb) * 1e6 for mb in range(8)]
                    assert got == pytest.approx(want[rank][index][chunk])


def test_slow_rank_and_stragglers_change_only_what_they_should():
    plain = TaskDurations(EmulationSpec.parse("10,20"), SHAPE)
    slow = TaskDurations(EmulationSpec.parse("10,20", slow_rank=1, slow_factor=1.5), SHAPE)
    for rank in range(4):
        factor = 1.5 if rank == 1 else 1.0
        assert slow.seconds(0, rank, Kind.BACKWARD, 1, 3) == pytest.approx(0.020 * factor)
        assert plain.seconds(4, rank, Kind.FORWARD, 0, 7) == pytest.approx(0.010)
    stragglers = TaskDurations(EmulationSpec.parse("10,20", straggler_prob=0.5, straggler_factor=3), SHAPE)
    values = {round(stragglers.seconds(0, r, Kind.FORWARD, c, mb), 9) for r in range(4) for c in range(2)
              for mb in range(8)}
    assert values == {0.010, 0.030}


def test_slow_rank_outside_the_pipeline_is_rejected():
    with pytest.raises(ScheduleConfigError, match="slow_rank 4"):
        TaskDurations(EmulationSpec.parse("10,20", slow_rank=4), SHAPE)


def test_timed_scale_waits_in_forward_and_backward_and_has_the_right_gradients():
    from megatron_app.emulation.compute import TimedScale

    x = torch.randn(3, 2, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    spans = []
    start = time.monotonic()
    y = TimedScale.apply(x, w, 0.040, 0.050, 0.030, lambda a, b: spans.append((a, b)))
    forward_s = time.monotonic() - start
    grad = torch.randn_like(y)
    start = time.monotonic()
    y.backward(grad)
    backward_s = time.monotonic() - start
    assert 0.040 <= forward_s < 0.070
    assert 0.080 <= backward_s < 0.120
    assert len(spans) == 1 and spans[0][1] - spans[0][0] >= 0.080
    torch.testing.assert_close(y.detach(), x.detach() * w.detach())
    torch.testing.assert_close(x.grad, grad * w.detach())
    torch.testing.assert_close(w.grad, (grad * x.detach()).sum(dim=(0, 1)))


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, pipeline_dtype=torch.float32,
                             params_dtype=torch.float32, use_cpu_initialization=True, cuda_graph_scope=[])


def test_emulated_chunk_through_megatrons_step_functions_takes_the_drawn_times():
    """Megatron's forward_step / backward_step (what forward_backward_app calls) on a one-chunk pipeline."""
    from megatron.core.pipeline_parallel.schedules import forward_step

    from megatron_app.emulation import compute as emulation
    from megatron_app.megatron_compat import backward_step   # 0.16's signature or 0.17+'s
    from megatron_app.train.emulation import ComputeEmulation

    shape = PipelineShape(1, 1, 2)
    spec = EmulationSpec.parse("40,80", straggler_prob=1.0, straggler_factor=1.5)   # every task 1.5x
    chunk = emulation.EmulatedChunk(_config(), TaskDurations(spec, shape), pp_rank=0, chunk=0, pre_process=True,
                                    post_process=True, vp_stage=None, vocab_size=64)
    data = emulation.emulated_microbatches(2, micro_batch_size=2, seq_length=8, vocab_size=64, iterations=1)
    store = []

    def one_microbatch(index):
        start = time.monotonic()
        output, _tokens = forward_step(ComputeEmulation.trainer_forward_step, data, chunk, 2, None, store, chunk.config, 1, False,
                                       is_first_microbatch=index == 0, current_microbatch=index, is_last_stage=True)
        middle = time.monotonic()
        backward_step(None, output, None, chunk.model_type, chunk.config)
        return middle - start, time.monotonic() - middle

    one_microbatch(0)                    # the first call also pays Megatron's lazy imports
    forward_s, backward_s = one_microbatch(1)
    assert 0.060 <= forward_s < 0.090     # 1.5 x 40 ms
    assert 0.120 <= backward_s < 0.160    # 1.5 x 80 ms
    assert chunk.weight.grad is not None and torch.isfinite(chunk.weight.grad).all()
    assert list(store[0]) == ["lm loss"] and store[0]["lm loss"][1].item() == 2 * 8   # tokens of the microbatch


def test_emulated_chunk_passes_its_input_through_as_a_seq_mbs_hidden_activation():
    from megatron_app.emulation import compute as emulation

    spec = EmulationSpec.parse("0,0")
    first = emulation.EmulatedChunk(_config(), TaskDurations(spec, PipelineShape(2, 1, 1)), 0, 0, True, False,
                                    None, 64)
    second = emulation.EmulatedChunk(_config(), TaskDurations(spec, PipelineShape(2, 1, 1)), 1, 0, False, True,
                                     None, 64)
    tokens = torch.arange(2 * 8).view(2, 8)
    activation = first(tokens, 0, 0)
    assert activation.shape == (8, 2, 16)
    second.set_input_tensor([activation.detach().requires_grad_()])
    assert second(None, 0, 0).shape == (2, 8)
    second.set_input_tensor(None)
    with pytest.raises(RuntimeError, match="got no input tensor"):
        second(None, 0, 0)


# ---- trainer flags ------------------------------------------------------------------------------------------------
def _parse(*flags, world=4):
    from megatron_app.train.args import parse_args

    env = {"WORLD_SIZE": str(world), "MASTER_ADDR": "localhost"}
    return parse_args(["--pipeline_parallel", str(world), "--model_chunks", "2", "--num-layers", "8", *flags],
                      environ=env)


def test_trainer_accepts_the_emulation_flags():
    args = _parse("--emulate-compute", "10,20,0.3", "--slow-rank", "1", "--slow-factor", "2",
                  "--straggler-prob", "0.1", "--link-delay", "1-2:0-300:12", "--link-delay", "0-1:5-9:3")
    from megatron_app.emulation.spec import spec_from_args

    spec = spec_from_args(args)
    assert spec.perturbations.slow_rank == 1 and spec.perturbations.slow_factor == 2.0
    assert spec.perturbations.jitter == 0.3 and spec.seed == args.seed
    assert args.link_delay == ["1-2:0-300:12", "0-1:5-9:3"]   # every --link-delay kept, not the last only


@pytest.mark.parametrize("flags, message", [
    (("--slow-rank", "1"), "--slow-rank needs --emulate-compute"),
    (("--link-delay", "0-1:0-10:5"), "--link-delay needs --emulate-compute"),
    (("--emulate-compute", "10,20", "--slow-link", "0-1:0-10:5"), "--slow-link is the simulator's flag"),
    (("--emulate-compute", "10"), "FWD_MS,BWD_MS"),
    (("--emulate-compute", "10,20", "--slow-rank", "4"), "slow_rank 4 is outside"),
    (("--emulate-compute", "10,20", "--link-delay", "1-2:0-1:1", "--link-delay", "1-7:0-10:5"), "rank 7 is outside"),
    (("--emulate-compute", "10,20", "--link-delay", "1-2:10-5:5"), "window must end after it starts"),
    (("--emulate-compute", "10,20", "--straggler-prob", "2"), "straggler_prob"),
])
def test_trainer_rejects_bad_emulation_flags_in_one_line(flags, message):
    from megatron_app.train.args import UsageError

    with pytest.raises(UsageError) as info:
        _parse(*flags)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_emulated_runs_iteration_line_says_emulated_instead_of_a_loss(monkeypatch, capsys, tmp_path):
    import json

    from megatron_app.train import report

    monkeypatch.setattr(report, "is_reporting_rank", lambda: True)
    log = tmp_path / "log.json"
    report.IterationReporter({}, 5, 1000, str(log), emulated=True).record(1, 6.93, 0.5)
    line = capsys.readouterr().out.strip()
    assert line == "iter 1/5 | emulated compute, no real loss | 500.0 ms | 2000 tokens/s"
    assert json.loads(log.read_text())["emulated"] is True
    report.IterationReporter({}, 5, 1000, None).record(1, 6.93, 0.5)
    assert capsys.readouterr().out.startswith("iter 1/5 | loss 6.9300 | ")
