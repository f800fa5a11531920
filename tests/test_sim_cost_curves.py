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
