"""tools/bench_data_parallel.py's logic (megatron_app.bench.data_parallel): flags, the simulator's rows, the table."""

from megatron_app.bench.data_parallel import format_rows, launcher_flags, simulated_ms
from megatron_app.bench.real_composition import CompositionRun
from megatron_app.train.args import parse_args

SHAPE = dict(pipeline_parallel=2, model_chunks=2, data_parallel=2, microbatches=4, documents_per_microbatch=2,
             lengths_file="docs/results/lengths/copyright_2048.txt", fwd_ms=10.0, bwd_ms=20.0, iters=3,
             slow_replica=1, slow_factor=1.3)


def test_the_launcher_flags_are_the_trainers():
    args = parse_args(launcher_flags(**SHAPE, extra=["--composition", "balanced"]), environ={"WORLD_SIZE": "4", "MASTER_ADDR": "localhost"})
    assert args.data_parallel == 2 and args.slow_replica == 1 and args.num_microbatches == 4


def test_the_simulated_rows_and_the_table():
    simulated = {name: simulated_ms(name, host_ms=1.0, **SHAPE) for name in ("loader", "balanced")}
    assert simulated["balanced"] < simulated["loader"]
    runs = [CompositionRun("loader", 0, [2.0, 2.2], [1.0, 1.0], [0.1, 0.1], [None, None]),
            CompositionRun("balanced", 0, [1.0, 1.2], [2.0, 2.0], [0.1, 0.1], [900.0, 1000.0])]
    table = format_rows(runs, "loader", simulated).splitlines()
    assert table[1].split()[:3] == ["loader", "2100.0", "1.000"]
    assert table[2].split()[:4] == ["balanced", "1100.0", "1.909", "950.0"]


def test_the_speed_blind_row_is_balanced_without_replica_speeds():
    from megatron_app.bench.data_parallel import SPEED_BLIND, row_flags

    assert row_flags(SPEED_BLIND) == ["--composition", "balanced", "--no-replica-speeds"]
    args = parse_args(launcher_flags(**SHAPE, extra=row_flags(SPEED_BLIND)),
                      environ={"WORLD_SIZE": "4", "MASTER_ADDR": "localhost"})
    assert args.composition == "balanced" and args.no_replica_speeds
    blind = simulated_ms(SPEED_BLIND, host_ms=1.0, **{**SHAPE, "iters": 4})
    aware = simulated_ms("balanced", host_ms=1.0, **{**SHAPE, "iters": 4})
    assert aware < blind
