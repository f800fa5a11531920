"""Emulated compute with composed microbatches: the trainer draws m x K documents per iteration as the simulator's
composition rows do, plan_microbatches groups them, forward_backward runs the planned count, and each task waits the
simulator's cost of its own microbatch's composition."""

import json

import pytest

from pipeline_runs import HELPERS, forked_ranks

from megatron_app.emulation.spec import EmulationSpec, TaskDurations
from megatron_app.schedule import Kind, PipelineShape
from megatron_app.schedule.composition import COMPOSITION_NAMES, loader_composition
from megatron_app.schedule.composition_plan import valid_microbatch_counts
from megatron_app.sim.composition import CompositionSimConfig, composed_durations
from megatron_app.sim.lengths import MicrobatchLengths
from megatron_app.train.args import UsageError, parse_args

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")
LENGTHS = (40, 7, 300, 12, 96, 180, 5, 64, 22, 150, 33, 410)


def test_composed_task_waits_are_the_simulators_composition_costs(tmp_path):
    """Same draw keys and the same cost function as sim/composition.py, less the host cost the runtime pays."""
    lengths = MicrobatchLengths(corpus=LENGTHS)
    documents = lengths.draw(8, 5, 2)
    composition = loader_composition(8, 2, packed=True)
    tokens, squared = composition.microbatch_tokens(documents), composition.microbatch_squared_tokens(documents)
    shape = PipelineShape(2, 2, composition.num_microbatches)
    durations = TaskDurations(EmulationSpec.parse("10,20", seed=5, lengths=lengths), PipelineShape(2, 2, 4))
    durations.compose(2, tokens, squared)
    simulated = composed_durations(CompositionSimConfig(2, 2, 4, 2, lengths, seed=5, host_us=0.0), shape, tokens,
                                   squared, 2)
    for mb in range(shape.num_microbatches):
        assert durations.seconds(2, 1, Kind.BACKWARD, 1, mb) * 1e6 == pytest.approx(simulated[1][1][1][mb])
    # a packed microbatch of two documents costs less than the two rows padded to the longer one
    padded = loader_composition(8, 2, packed=False).microbatch_squared_tokens(documents)
    assert all(s <= p for s, p in zip(squared, padded))


def _train_args(tmp_path, *flags):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("".join(f"{n}\n" for n in LENGTHS))
    return ["--pipeline_parallel", 2, "--model_chunks", 2, "--num-layers", 4, "--hidden-size", 16,
            "--num-attention-heads", 1, "--seq-length", 512, "--vocab-size", 64, "--micro-batch-size", 1,
            "--global-batch-size", 4, "--iters", 3, "--schedule", "app", "--emulate-compute", "2,4",
            "--emulate-lengths-file", lengths, *flags]


def test_trainer_composition_flags_are_checked_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="--documents-per-microbatch needs --emulate-lengths-file"):
        parse_args(["--documents-per-microbatch", "2", "--emulate-compute", "2,4"], environ={"WORLD_SIZE": "1"})
    with pytest.raises(UsageError, match="must be >= 1"):
        parse_args(["--documents-per-microbatch", "0"], environ={"WORLD_SIZE": "1"})
    args = parse_args([str(a) for a in _train_args(tmp_path, "--documents-per-microbatch", 2,
                                                   "--composition", "dp-balanced")],
                      environ={"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    assert args.documents_per_microbatch == 2 and args.composition == "dp-balanced"


def test_emulated_p2_v2_runs_every_composition_with_its_planned_microbatch_counts(tmp_path):
    """Each composition is its own short forked run: 4 loader microbatches of 2 documents, 3 iterations."""
    logs = {name: tmp_path / f"{name}.json" for name in COMPOSITION_NAMES}
    runs = [[str(a) for a in _train_args(tmp_path, "--documents-per-microbatch", 2, "--composition", name,
                                         "--log-json", logs[name], "--no-trace")] for name in COMPOSITION_NAMES]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    result = forked_ranks(2, [HELPERS / "train_runs_worker.py", tmp_path / "runs.json"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    counts = {}
    for name in COMPOSITION_NAMES:
        iterations = json.loads(logs[name].read_text())["iterations"]
        assert len(iterations) == 3
        composed = [it["composed"] for it in iterations]
        assert all(c["composition"] == name for c in composed)
        assert all(len(c["microbatch_tokens"]) == c["num_microbatches"] for c in composed)
        assert all(c["num_microbatches"] in valid_microbatch_counts(2, 2, 8) and c["wait_for_plan_ms"] >= 0 <= c["planning_ms"]
                   for c in composed)
        counts[name] = composed
        # every composition is planned and predicted on one rank once costs are learnt (the first call teaches
        # them; from the third, what an iteration spends outside its call is known and predicted too)
        assert composed[0]["predicted_ms"] is None
        assert all(c["predicted_pipeline_ms"] > 0 for c in composed[1:])
        assert composed[2]["predicted_ms"] > composed[2]["predicted_pipeline_ms"]
    assert "microbatches" in result.stdout        # the iteration line says how many ran
    # the loader's own groups: 4 microbatches of 2 documents
    assert all(c["num_microbatches"] == 4 for name in ("loader", "packed") for c in counts[name])
    assert all(c["padding_tokens"] == 0 for name in ("packed", "dp-balanced", "balanced") for c in counts[name])
    assert any(c["padding_tokens"] > 0 for c in counts["loader"])
    # the same documents each iteration whatever the composition: total non-padding tokens agree
    for name in COMPOSITION_NAMES:
        for mine, loader in zip(counts[name], counts["loader"]):
            assert sum(mine["microbatch_tokens"]) - mine["padding_tokens"] == \
                sum(loader["microbatch_tokens"]) - loader["padding_tokens"]


def test_simulated_emulation_with_host_cost_is_the_composition_simulators_loader_row():
    """One document a microbatch, loader order: the bench's two simulator paths (its variable-length rows and its
    composition rows) predict the same iterations, host cost included."""
    from megatron_app.emulation.sim_replay import simulate_emulation
    from megatron_app.sim.composition import LOADER_ROW, simulate_composition

    lengths = MicrobatchLengths(corpus=LENGTHS)
    emulated = simulate_emulation(EmulationSpec.parse("10,20", seed=1, lengths=lengths), PipelineShape(2, 2, 4),
                                  "interleaved", 3, host_us=400.0)
    composed = simulate_composition(CompositionSimConfig(2, 2, 4, 1, lengths, host_us=400.0, iterations=3,
                                                         warmup_iterations=0, seed=1), LOADER_ROW)
    assert [it.makespan_us for it in emulated] == pytest.approx([it.makespan_us for it in composed.iterations])
    without_host = simulate_emulation(EmulationSpec.parse("10,20", seed=1, lengths=lengths), PipelineShape(2, 2, 4),
                                      "interleaved", 3)
    assert all(a.makespan_us > b.makespan_us for a, b in zip(emulated, without_host))


def test_emulated_run_replaying_another_models_curves_says_so_once_and_its_trace_records_its_model(tmp_path):
    """--emulate-cost-curves fitted on another model (hidden 32 where this run's is 16): one line, on rank 0, once,
    naming what differs; the run's own trace header records the model it computed (runtime/call_setup.py)."""
    from megatron_app.sim.cost_curves import CostCurves
    from megatron_app.trace.reader import read_trace_dir

    layer = {"forward": (5.0, 0.01, 0.0), "backward": (10.0, 0.02, 0.0)}
    zero = {"forward": (0.0, 0.0, 0.0), "backward": (0.0, 0.0, 0.0)}
    traced = {"hidden_size": 32, "num_attention_heads": 1, "ffn_hidden_size": 128, "vocab_size": 64,
              "params_dtype": "float32", "tensor_parallel": 1}
    curves = tmp_path / "curves.json"
    curves.write_text(json.dumps(CostCurves(layer, zero, zero, {"model": traced}).to_json()))
    run = [str(a) for a in _train_args(tmp_path, "--documents-per-microbatch", 2, "--composition", "packed",
                                       "--emulate-cost-curves", curves, "--trace-dir", tmp_path / "trace")]
    (tmp_path / "runs.json").write_text(json.dumps([run]))
    result = forked_ranks(2, [HELPERS / "train_runs_worker.py", tmp_path / "runs.json"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = [line for line in (result.stdout + result.stderr).splitlines() if "replayed for another model" in line]
    assert said == [f"cost curves {curves}: replayed for another model than the traced one (hidden_size 32 -> 16, "
                    "ffn_hidden_size 128 -> 64): the task costs are the traced model's, not this one's"], said
    trace = read_trace_dir(tmp_path / "trace" / "latest", 2, 2)
    assert trace.pipeline_view()[1].meta.extra["model"] == dict(traced, hidden_size=16, ffn_hidden_size=64,
                                                                 num_layers=4, vocab_size=None)
