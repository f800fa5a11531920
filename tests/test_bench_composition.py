"""tools/bench_schedule.py's composition rows (issue 23): which runs a composition scenario plans, the trainer flags
they become, the host-cost probe's formula, and the targets as data. The rows' runs themselves are the emulated
trainer's (tests/test_emulation_composition.py); a full bench run is the lead's quiet re-measure (BENCHMARKS.md)."""

import statistics

import pytest

from megatron_app.bench.schedule.analysis import Row, measure_host_cost
from megatron_app.bench.schedule.cli import parse_args
from megatron_app.bench.schedule.plan import build_plan
from megatron_app.bench.schedule.rows import COMPOSITION_ROWS
from megatron_app.bench.schedule.scenarios import HOST_PROBE, HOST_PROBE_COMPUTE
from megatron_app.bench.schedule.targets import TARGETS, check_targets
from megatron_app.bench.schedule.worker import trainer_argv
from megatron_app.emulation.sim_replay import simulate_emulation
from megatron_app.emulation.spec import EmulationSpec
from megatron_app.schedule import PipelineShape


def _plan(tmp_path, *flags):
    return build_plan(parse_args(["-P", "4", "-V", "2", "-m", "16", *map(str, flags)]), tmp_path)


def test_copyright_scenarios_run_the_four_compositions_on_two_documents_a_microbatch_and_probe_host_cost(tmp_path):
    plan = _plan(tmp_path, "--scenarios", "copyright-2048,copyright-8192")
    rows = [run for run in plan["runs"] if not run.get("host_probe")]
    assert [run["key"] for run in rows] == list(COMPOSITION_ROWS) * 2
    for run in rows:
        assert run["documents_per_microbatch"] == 2 and run["lengths_file"].endswith(".txt")
        argv = trainer_argv(run, None)
        assert argv[argv.index("--composition") + 1] == COMPOSITION_ROWS[run["key"]].composition
        assert argv[argv.index("--documents-per-microbatch") + 1] == "2"
        schedule = argv[argv.index("--schedule") + 1]
        policy = argv[argv.index("--policy") + 1] if "--policy" in argv else None   # static orders take none
        assert (schedule, policy) == (("app", "planned") if run["key"] == "balanced" else ("interleaved", None))
    probes = [run for run in plan["runs"] if run.get("host_probe")]
    assert len(probes) == 1 and probes[0]["emulate_compute"] == HOST_PROBE_COMPUTE
    assert not any(run.get("host_probe") for run in _plan(tmp_path, "--scenarios", "copyright-2048",
                                                          "--host-ms", "0.5")["runs"])
    repeated = _plan(tmp_path, "--scenarios", "copyright-2048", "--repeats", "2")["runs"]
    assert [run["repeat"] for run in repeated if run.get("host_probe")] == [0, 1]   # one a repeat, round robin


def test_composition_rows_join_the_variable_length_scenario_only_when_named(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("30\n90\n500\n")
    plan = _plan(tmp_path, "--scenarios", "variable-length,homogeneous", "--lengths-file", lengths,
                 "--schedules", "interleaved,loader-padded,balanced")
    keys = [(run["scenario"], run["key"]) for run in plan["runs"] if not run.get("host_probe")]
    assert keys == [("variable length", "interleaved"), ("variable length", "loader-padded"),
                    ("variable length", "balanced"), ("homogeneous", "interleaved")]
    default = _plan(tmp_path, "--scenarios", "variable-length", "--lengths-file", lengths)
    assert not any(run.get("composition") for run in default["runs"])


def test_bad_host_ms_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--scenarios", "copyright-2048", "--host-ms", "-1"])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_host_cost_is_what_the_simulator_must_add_per_task_to_meet_the_probe():
    """A probe whose every task took 0.5 ms longer than emulated measures 0.5 ms per task."""
    run = {"pipeline_parallel": 4, "model_chunks": 2, "microbatches": 8, "iterations": 3, "warmup": 1, "seed": 0,
           "emulate_compute": "0.1,0.2"}
    slower = simulate_emulation(EmulationSpec(0.6, 0.7), PipelineShape(4, 2, 8), "interleaved", 3)[1:]
    measured = statistics.median(p.makespan_us for p in slower) / 1e3
    probe = Row(HOST_PROBE, HOST_PROBE, HOST_PROBE, "app", "interleaved", 2, measured, [measured], measured, 0.0,
                [1, 1, 1, 1], "interleaved")
    cost = measure_host_cost(probe, run)
    assert cost["host_ms"] == pytest.approx(0.5, rel=1e-6)
    assert cost["critical_path_tasks"] >= 2 * (8 * 2 + 4 - 1) - 1e-6   # at least one rank's tasks plus the fill


def _row(key, ms, peaks, sim_ms):
    row = Row("copyright 2048", COMPOSITION_ROWS[key].label, key, "app", "app", 2, ms, [ms], ms, 0.1, [1] * 4,
              "interleaved", sim_ms=sim_ms, sim_error=ms / sim_ms - 1.0, peak_tokens=peaks)
    row.composition = COMPOSITION_ROWS[key].composition
    return row


def test_composition_targets_come_from_the_table():
    base = _row("loader-padded", 1400.0, [100, 90, 80, 70], 1400.0)
    ours = _row("balanced", 1000.0, [100, 80, 80, 60], 1050.0)
    ours.peak_tokens_over_base = 1.0
    rows = [base, _row("loader-packed", 1200.0, [90] * 4, 1200.0), _row("dp-balanced", 1080.0, [90] * 4, 1000.0),
            ours]
    checks = {check.target: check.passed for check in check_targets(rows)}
    needs = {target.baseline: target.min_speedup for target in TARGETS
             if target.family == "composition" and target.applies("copyright 2048", 4)}
    assert checks[f"{ours.label} >= {needs['loader-padded']}x {base.label}"] is True       # 1.40x
    assert checks[f"{ours.label} >= {needs['loader-packed']}x {rows[1].label}"] is True    # 1.20x
    assert checks[f"{ours.label} >= {needs['dp-balanced']}x {rows[2].label}"] is False     # 1.08x
    assert checks[f"{ours.label} peak activation tokens <= 1.0x the baseline's on every rank"] is True
    assert checks[f"simulator predicts {rows[2].label} within 10%"] is True                # +8.0%
    assert all(checks[f"simulator predicts {r.label} within 10%"] for r in rows)
