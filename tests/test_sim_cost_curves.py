"""Cost curves fitted on a trace (sim/cost_curves.py): recovered from known costs, replayed at another shape."""

from types import SimpleNamespace

import numpy as np
import pytest

from megatron_app.schedule import PipelineShape, ScheduleConfigError
from megatron_app.schedule.tasks import Kind
from megatron_app.sim.cost_curves import CostCurves, fit_curves, main
from megatron_app.trace.schema import TraceEvent

LAYER = {"forward": (50.0, 2.0, 1e-3), "backward": (80.0, 4.0, 2e-3)}
FIRST = {"forward": (300.0, 0.5, 0.0), "backward": (100.0, 0.5, 0.0)}
LAST = {"forward": (500.0, 1.5, 0.0), "backward": (700.0, 2.5, 0.0)}


def _cost(kind, role, layers, t, s):
    a, b, c = LAYER[kind]
    value = layers * (a + b * t + c * s)
    if role != "middle":
        ea, eb, ec = (FIRST if role == "first" else LAST)[kind]
        value += ea + eb * t + ec * s
    return value


def _fake_run(P=2, V=2, layers=2, iterations=3):
    rng = np.random.default_rng(0)
    ranks = []
    for pp in range(P):
        by_iteration = {}
        for it in range(iterations):
            events, clock = [], 0.0
            for chunk in range(V):
                stage = chunk * P + pp
                role = "first" if stage == 0 else "last" if stage == P * V - 1 else "middle"
                for mb in range(6):
                    t = float(rng.integers(100, 2000))
                    s = t * t * float(rng.uniform(0.2, 1.0))
                    for kind in ("forward", "backward"):
                        duration = _cost(kind, role, layers, t, s)
                        events.append(TraceEvent(rank=pp, pp_rank=pp, iteration=it, kind=kind, start=clock,
                                                 end=clock + duration, chunk=chunk, microbatch=mb,
                                                 extra={"tokens": t, "squared_tokens": s}))
                        clock += duration
            by_iteration[it] = events
        ranks.append(SimpleNamespace(meta=SimpleNamespace(pp_rank=pp),
                                     events_of=lambda k, b=by_iteration: b[k]))
    return SimpleNamespace(pipeline_parallel=P, model_chunks=V, trace_dir="fake", pipeline_view=lambda: ranks,
                           iterations=lambda: list(range(iterations)))


def test_the_fit_recovers_a_layer_and_the_first_and_last_extras():
    curves = fit_curves(_fake_run(), num_layers=8)
    for kind in ("forward", "backward"):
        assert curves.layer[kind] == pytest.approx(LAYER[kind], rel=1e-6)
        assert curves.first_extra[kind] == pytest.approx(FIRST[kind], rel=1e-6, abs=1e-6)
        assert curves.last_extra[kind] == pytest.approx(LAST[kind], rel=1e-6, abs=1e-6)


def test_replayed_at_another_shape_each_chunk_costs_its_layers_plus_its_role():
    curves = CostCurves(LAYER, FIRST, LAST, {})
    shape = PipelineShape(4, 2, 4)
    table = np.asarray(curves.durations(shape, 8, [1000.0] * 4, [5e5] * 4))
    assert table[0, Kind.FORWARD.index, 0, 0] == pytest.approx(_cost("forward", "first", 1, 1000.0, 5e5))
    assert table[3, Kind.BACKWARD.index, 1, 0] == pytest.approx(_cost("backward", "last", 1, 1000.0, 5e5))
    assert table[1, Kind.FORWARD.index, 1, 0] == pytest.approx(_cost("forward", "middle", 1, 1000.0, 5e5))
    assert CostCurves.from_json(curves.to_json()).layer == curves.layer
    with pytest.raises(ScheduleConfigError, match="do not split"):
        curves.durations(shape, 6, [1.0], [1.0])


def test_a_trace_without_tokens_is_one_clear_line(tmp_path, capsys):
    code = main(["--trace-dir", str(tmp_path), "--pipeline_parallel", "2", "--model_chunks", "2", "--num-layers", "8",
                 "--out", str(tmp_path / "c.json")])
    assert code == 2 and "no trace files" in capsys.readouterr().out


def test_the_emulation_waits_the_replayed_costs(tmp_path):
    from megatron_app.emulation.spec import spec_from_args
    from megatron_app.train.args import UsageError, parse_args

    path = tmp_path / "curves.json"
    path.write_text(__import__("json").dumps(CostCurves(LAYER, FIRST, LAST, {}).to_json()))
    flags = ["--pipeline_parallel", "2", "--model_chunks", "2", "--emulate-compute", "10,20", "--emulate-lengths-file",
             "docs/results/lengths/copyright_2048.txt", "--documents-per-microbatch", "2", "--num-layers", "8",
             "--emulate-cost-curves", str(path)]
    args = parse_args(flags, environ={"WORLD_SIZE": "2", "MASTER_ADDR": "localhost"})
    spec = spec_from_args(args)
    shape = PipelineShape(2, 2, 2)
    table = np.asarray(spec.draw_composed(shape, 0, [1000.0, 500.0], [5e5, 2e5]))
    assert table[0, Kind.FORWARD.index, 0, 1] == pytest.approx(_cost("forward", "first", 2, 500.0, 2e5))
    with pytest.raises(UsageError, match="not divisible"):
        parse_args(flags[:-4] + ["--num-layers", "6", "--emulate-cost-curves", str(path)],
                   environ={"WORLD_SIZE": "2", "MASTER_ADDR": "localhost"})


def test_a_p1_trace_spread_evenly_keeps_the_whole_models_cost():
    from megatron_app.sim.cost_curves import fit_whole_curves

    curves = fit_whole_curves(_fake_run(P=1, V=1, layers=8), num_layers=8)
    for kind in ("forward", "backward"):   # the whole model (8 layers + what the one chunk adds), over 8 layers
        expected = tuple((8 * lv + fv) / 8 for lv, fv in zip(LAYER[kind], FIRST[kind]))
        assert curves.layer[kind] == pytest.approx(expected, rel=1e-6)
        assert curves.first_extra[kind] == curves.last_extra[kind] == (0.0, 0.0, 0.0)
    table = np.asarray(curves.durations(PipelineShape(4, 2, 4), 8, [1000.0] * 4, [5e5] * 4))
    assert table[:, Kind.FORWARD.index, :, 0].sum() == pytest.approx(_cost("forward", "first", 8, 1000.0, 5e5))
    with pytest.raises(ScheduleConfigError, match="P=1 V=1"):
        fit_whole_curves(_fake_run(), num_layers=8)


def _write_p1_trace(directory, model=None):
    import json

    header = {"schema_version": "1.4", "format": "megatron_app.trace", "global_rank": 0, "pp_rank": 0, "tp_rank": 0,
              "dp_rank": 0, "pipeline_parallel": 1, "model_chunks": 1, "microbatches": 4, "policy": "planned",
              "host": "test", "source": "runtime", "clock_offset_us": 0.0}
    if model is not None:
        header["extra"] = {"model": model}
    lines, clock = [json.dumps(header)], 0.0
    for iteration in (1, 2, 3):
        for microbatch, tokens in enumerate((512, 1024, 2048, 4096)):
            for kind in ("forward", "backward"):
                duration = _cost(kind, "middle", 8, tokens, tokens * tokens / 2)
                lines.append(json.dumps({"rank": 0, "pp_rank": 0, "iteration": iteration, "kind": kind,
                                         "start": clock, "end": clock + duration, "chunk": 0,
                                         "microbatch": microbatch,
                                         "extra": {"tokens": tokens, "squared_tokens": tokens * tokens / 2}}))
                clock += duration + 10.0
    (directory / "trace_rank0.jsonl").write_text("\n".join(lines) + "\n")


def test_the_cli_fits_a_p1_trace_only_when_told_to_spread_it(tmp_path, capsys):
    import json

    _write_p1_trace(tmp_path)
    flags = ["--trace-dir", str(tmp_path), "--pipeline_parallel", "1", "--num-layers", "8",
             "--out", str(tmp_path / "c.json")]
    assert main(flags) == 2 and "--spread-evenly" in capsys.readouterr().out
    assert main(flags + ["--spread-evenly", "--note", "made by the test"]) == 0
    written = CostCurves.load(str(tmp_path / "c.json"))
    assert written.layer["backward"] == pytest.approx(LAYER["backward"], rel=1e-6)
    source = json.loads((tmp_path / "c.json").read_text())["source"]
    assert source["fit"].startswith("whole model") and source["note"] == "made by the test"


def test_flop_curves_keep_the_calibration_traces_sums_per_kind():
    """tools/flop_cost_curves.py: FLOP-shaped curves whose time per FLOP is a P=1 trace's, per kind."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "flop_cost_curves_tool", Path(__file__).resolve().parents[1] / "tools" / "flop_cost_curves.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    run = _fake_run(P=1, V=1, layers=8)
    sums = tool.calibrate(run, 8, hidden=64, ffn=256, vocab=100, skip_iterations=1)
    curves = tool.curves_from_flops(sums, 64, 256, 100, {})
    per_token, per_square = tool.flops_per_layer(64, 256)
    assert per_token == 24 * 64 * 64 and per_square == 4 * 64
    for kind, index in (("forward", Kind.FORWARD.index), ("backward", Kind.BACKWARD.index)):
        events = [e for r in run.pipeline_view() for it in run.iterations()[1:] for e in r.events_of(it)
                  if e.kind == kind]
        tokens = [e.extra["tokens"] for e in events]
        squared = [e.extra["squared_tokens"] for e in events]
        table = np.asarray(curves.durations(PipelineShape(2, 2, len(events)), 8, tokens, squared))
        assert table[:, index].sum() == pytest.approx(sum(e.duration for e in events), rel=1e-9)
    assert curves.layer["backward"][1] == pytest.approx(
        2 * curves.layer["forward"][1] * sums["backward"]["us"] / sums["backward"]["flops"]
        / (sums["forward"]["us"] / sums["forward"]["flops"]))


def test_replayed_lengths_far_outside_the_fitted_range_are_warned_of_once_with_the_factor(capsys):
    curves = fit_curves(_fake_run(), num_layers=8)
    low, high = curves.source["tokens_range"]
    assert 100 <= low < 200 and 1900 < high < 2000
    shape = PipelineShape(2, 2, 4)
    curves.durations(shape, 8, [high] * 4, [high * high] * 4)            # within the range: nothing said
    assert capsys.readouterr().err == ""
    for _ in range(2):
        curves.durations(shape, 8, [30 * high] * 4, [(30 * high) ** 2] * 4)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"cost curves: microbatches of up to {30 * high:,.0f} tokens, 30.0x "
                                               f"the largest the curves were fitted on ({low:,.0f}-{high:,.0f} tokens")
    fitted = CostCurves(LAYER, FIRST, LAST, {"tokens_range": [100, 2000]})
    assert "microbatches of 10 tokens, 10.0x below the smallest" in fitted.out_of_range(np.asarray([10.0]))
    assert fitted.out_of_range(np.asarray([60.0, 3000.0])) is None                     # within 2x: nothing
    assert CostCurves(LAYER, FIRST, LAST, {}).out_of_range(np.asarray([1e9])) is None   # no range recorded


def test_the_fit_summary_says_its_units():
    from megatron_app.sim.cost_curves import summary

    text = summary(fit_curves(_fake_run(), num_layers=8))
    assert text.splitlines()[0] == ("per task, in microseconds, for a microbatch of T tokens whose documents' squared "
                                    "lengths sum to S:")
    assert "forward: each layer 50.0 + 2.0000 T + 1.000e-03 S us; the first chunk adds 300.0 + 0.5000 T us" in text
    assert "fitted on microbatches of" in text


MODEL = {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256, "vocab_size": 128,
         "params_dtype": "float32", "tensor_parallel": 1}


def _traced(run, model):
    """The fake run as a trace whose header records `model` (runtime traces do: meta.extra["model"])."""
    for rank in run.pipeline_view():
        rank.meta.extra = {"model": dict(model)}
    return run


def test_curves_record_the_traced_model_and_a_replay_for_another_warns_once_naming_what_differs(capsys, tmp_path):
    import json

    curves = fit_curves(_traced(_fake_run(), MODEL), num_layers=8)
    assert curves.source["model"] == MODEL
    with pytest.raises(ScheduleConfigError, match="^the trace is of a 8-layer model, not 4 layers: fit it with "
                                                  "--num-layers 8$"):
        fit_curves(_traced(_fake_run(), MODEL), num_layers=4)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(curves.to_json()))
    curves = CostCurves.load(str(path))
    assert curves.model_mismatch(dict(MODEL, num_layers=32)) is None      # per layer: any depth replays them
    other = dict(MODEL, hidden_size=128, params_dtype="bfloat16", vocab_size=None)   # None: not known, not compared
    for _ in range(2):
        curves.warn_model(other)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"cost curves {path}: replayed for another model than the traced one (hidden_size 64 -> 128, "
                   "params_dtype float32 -> bfloat16): the task costs are the traced model's, not this one's"]
    assert curves.replay_note(16) == (f"cost curves {path}: the traced model (num_layers 8, hidden_size 64, "
                                      "num_attention_heads 4, ffn_hidden_size 256, vocab_size 128, params_dtype "
                                      "float32, tensor_parallel 1) replayed at 16 layers")


def test_old_curves_without_a_model_still_load_and_say_once_that_nothing_is_checked(capsys, tmp_path):
    import json

    old = CostCurves(LAYER, FIRST, LAST, {"tokens_range": [100, 2000]}).to_json()   # as files written before
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    curves = CostCurves.load(str(path))
    assert curves.model is None and curves.layer == {k: tuple(v) for k, v in LAYER.items()}
    for _ in range(3):
        curves.warn_model(MODEL)
    assert capsys.readouterr().err.splitlines() == [
        f"cost curves {path}: the file records no traced model (fitted before curve files recorded one): whether "
        "they are this model's costs is not checked"]
    assert "records no traced model" in curves.replay_note(8)


def test_the_emulation_says_once_when_its_model_is_not_the_traced_one(capsys, tmp_path):
    """The trainer's emulated chunks are built from its flags: rank 0 compares that model with the curves'."""
    import json

    from megatron_app.emulation.spec import spec_from_args
    from megatron_app.trace.model_shape import model_shape
    from megatron_app.train.args import parse_args
    from megatron_app.train.model import build_transformer_config

    path = tmp_path / "curves.json"
    path.write_text(json.dumps(CostCurves(LAYER, FIRST, LAST, {"model": dict(MODEL, hidden_size=32)}).to_json()))
    flags = ["--pipeline_parallel", "2", "--model_chunks", "2", "--emulate-compute", "10,20", "--emulate-lengths-file",
             "docs/results/lengths/copyright_2048.txt", "--documents-per-microbatch", "2", "--num-layers", "8",
             "--hidden-size", "64", "--num-attention-heads", "4", "--emulate-cost-curves", str(path)]
    args = parse_args(flags, environ={"WORLD_SIZE": "2", "MASTER_ADDR": "localhost"})
    spec = spec_from_args(args)
    replayed = model_shape(build_transformer_config(args), args.vocab_size)
    assert replayed["hidden_size"] == 64 and replayed["num_layers"] == 8
    assert spec.cost_curves.model_mismatch(replayed).startswith(
        f"cost curves {path}: replayed for another model than the traced one (hidden_size 32 -> 64")


def test_the_simulator_refuses_curves_it_would_ignore(capsys):
    """--cost-curves cost composed microbatches: without --documents-per-microbatch they used to be ignored."""
    from megatron_app.sim.cli import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--pipeline_parallel", "2", "--microbatches", "4", "--cost-curves", "c.json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and err[-1].endswith("error: --cost-curves needs --documents-per-microbatch (the "
                                                       "curves cost composed microbatches; without it they were "
                                                       "ignored)")


def test_flop_curves_refuse_flags_of_another_model_than_the_traced_one(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "flop_cost_curves_tool", Path(__file__).resolve().parents[1] / "tools" / "flop_cost_curves.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _write_p1_trace(tmp_path, model=MODEL)
    flags = ["--trace-dir", str(tmp_path), "--num-layers", "8", "--vocab-size", "128", "--ffn-hidden-size", "256",
             "--out", str(tmp_path / "c.json")]
    with pytest.raises(SystemExit, match=r"^flop_cost_curves: the flags describe another model than the traced one "
                                         r"\(hidden_size 64 -> 128\): give the traced model's sizes$"):
        tool.main(flags + ["--hidden-size", "128"])
    assert tool.main(flags + ["--hidden-size", "64"]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["source"]["model"] == MODEL
